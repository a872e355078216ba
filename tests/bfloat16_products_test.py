"""The opt-in bfloat16 products (`FedCGConfig.matmul_precision`): which
products take the route, that it computes the float32 convolutions when
oneDNN may not round, that it does round when the process allows it (in a
TFF worker, as a run has it), and the settings' checks."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from fedcg_tff.algorithms import training_tf
from fedcg_tff.config import FedCGConfig
from fedcg_tff.execution import child_env
from fedcg_tff.execution import precision
from fedcg_tff.models import layers
from fedcg_tff.models import small_conv
from tests import small_conv_test

_AVX2 = 'processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n'
_AMX = ('processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n'
        'flags\t\t: avx2 avx512f avx512bw avx512vl avx512dq avx512_bf16 '
        'amx_bf16 amx_tile\n')


@pytest.fixture(autouse=True)
def _direct_products(monkeypatch):
  """The AVX-512 hosts' choice (bfloat16 hosts are AVX-512 hosts): no
  swapped product, so the counts below read the graph alone, whatever
  this host is."""
  monkeypatch.setattr(small_conv, 'ORIENTED_PRODUCTS', False)


def _ops(fn, *signature):
  graph = tf.function(fn).get_concrete_function(*signature).graph
  return [op.type for op in graph.get_operations()]


def _conv_with_gradients(bfloat16):
  return lambda x, k: small_conv_test._value_and_grads(  # pylint: disable=protected-access
      lambda a, b: small_conv.conv2d(a, b, bfloat16=bfloat16), x, k)


@pytest.mark.parametrize('n,h,w,c_in,kh,kw,c_out', small_conv_test.SHAPES)
def test_the_route_computes_the_float32_convolutions_here(n, h, w, c_in, kh,
                                                          kw, c_out):
  """This process leaves oneDNN strict (TF_SET_ONEDNN_FPMATH_MODE unset):
  batched products are float32 products, so the route's convolutions and
  their gradients are TensorFlow's to float rounding."""
  rng = np.random.default_rng(5)
  x = rng.normal(size=(n, h + kh - 1, w + kw - 1, c_in)).astype(np.float32)
  kernel = rng.normal(size=(kh, kw, c_in, c_out)).astype(np.float32)
  small_conv_test._assert_all_close(  # pylint: disable=protected-access
      _conv_with_gradients(True)(x, kernel),
      small_conv_test._value_and_grads(  # pylint: disable=protected-access
          lambda a, k: tf.nn.conv2d(a, k, 1, 'VALID'), x, kernel))
  x_t = rng.normal(size=(n, h, w, c_in)).astype(np.float32)
  kernel_t = rng.normal(size=(kh, kw, c_out, c_in)).astype(np.float32)
  small_conv_test._assert_all_close(  # pylint: disable=protected-access
      small_conv_test._value_and_grads(  # pylint: disable=protected-access
          lambda a, k: small_conv.conv2d_transpose(a, k, True), x_t, kernel_t),
      small_conv_test._value_and_grads(  # pylint: disable=protected-access
          lambda a, k: tf.nn.conv2d_transpose(
              a, k, [n, h + kh - 1, w + kw - 1, c_out], 1, 'VALID'),
          x_t, kernel_t))


@pytest.mark.parametrize('c_out,batched', [(512, 3), (1, 0)])
def test_products_with_a_small_known_dimension_stay_matmul(c_out, batched):
  """D's third conv (batch unknown, as in the step): its forward product,
  input gradient and kernel gradient all batched; D's last (one output
  channel: n = 1 forwards, k = 1 for the input gradient) none; without the
  route, none."""
  signature = (tf.TensorSpec([None, 3, 3, 256]),
               tf.TensorSpec([2, 2, 256, c_out]))
  ops = _ops(_conv_with_gradients(True), *signature)
  assert ops.count('BatchMatMulV2') == batched
  assert ops.count('MatMul') == 3 - batched
  ops = _ops(_conv_with_gradients(False), *signature)
  assert 'BatchMatMulV2' not in ops and ops.count('MatMul') == 3


def _trained_step_ops(layer, input_shape):
  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(layer(x, training=True)))
    return tape.gradient(loss, layer.trainable_weights)

  layer.build(input_shape)
  graph = step.get_concrete_function(tf.TensorSpec(input_shape)).graph
  return [op.type for op in graph.get_operations()]


def test_layers_built_within_the_context_take_the_route():
  """SpectralNormConv2D (its sigma-divided product, kernel gradient and
  input gradient) and SmallConv2DTranspose; an explicit argument wins over
  the context, and the setting survives get_config."""
  with small_conv.bfloat16_products():
    sn = layers.SpectralNormConv2D(512, 2, use_bias=False)
    tconv = layers.SmallConv2DTranspose(512, 2, use_bias=False)
    strict = layers.SpectralNormConv2D(512, 2, bfloat16_products=False)
  plain = layers.SpectralNormConv2D(512, 2, use_bias=False)
  assert (sn.bfloat16_products, tconv.bfloat16_products,
          strict.bfloat16_products, plain.bfloat16_products) == (
              True, True, False, False)
  assert layers.SpectralNormConv2D.from_config(
      sn.get_config()).bfloat16_products
  assert layers.SmallConv2DTranspose.from_config(
      tconv.get_config()).bfloat16_products
  assert _trained_step_ops(sn, [8, 3, 3, 256]).count('BatchMatMulV2') == 3
  assert _trained_step_ops(tconv, [8, 2, 2, 256]).count('BatchMatMulV2') == 3
  assert 'BatchMatMulV2' not in _trained_step_ops(plain, [8, 3, 3, 256])


@pytest.mark.parametrize('matmul_precision', ['float32', 'bfloat16'])
def test_party_networks_follow_the_configs_precision(matmul_precision):
  nets = training_tf.PartyNetworks(
      FedCGConfig(matmul_precision=matmul_precision), ('generator',
                                                       'discriminator'))
  routed = [layer.bfloat16_products
            for net in (nets.generator, nets.discriminator)
            for layer in net.layers
            if isinstance(layer, (layers.SpectralNormConv2D,
                                  layers.SmallConv2DTranspose))]
  assert len(routed) == 8
  assert set(routed) == {matmul_precision == 'bfloat16'}


_ROUNDING_CHILD = textwrap.dedent('''
    import json, sys
    import numpy as np
    import tensorflow as tf
    import tensorflow_federated as tff
    from fedcg_tff.execution import runtime
    from fedcg_tff.models import small_conv
    runtime.set_local_cpp_context()
    rng = np.random.default_rng(0)
    a = rng.normal(size=(64, 1024)).astype(np.float32)
    b = rng.normal(size=(1024, 512)).astype(np.float32)
    spec = lambda x: tff.TensorType(np.float32, x.shape)

    @tff.tensorflow.computation(spec(a), spec(b))
    def products(x, y):
      return (small_conv.matmul(x, y, bfloat16=True),
              small_conv.matmul(x, y, bfloat16=False))

    want = a.astype(np.float64) @ b.astype(np.float64)
    error = lambda got: float(np.max(np.abs(got - want)) /
                              np.max(np.abs(want)))
    print(json.dumps([error(np.asarray(p)) for p in products(a, b)]))
    ''')


@pytest.mark.skipif(not precision.has_bfloat16_arithmetic(),
                    reason='this host has no bfloat16 arithmetic')
def test_a_worker_started_with_the_setting_rounds_the_routed_products():
  """What a bfloat16 run relies on, end to end: TFF's worker, started from
  a process configured for bfloat16, rounds the inputs of the routed
  products (relative error near bfloat16's 2^-9) and not those of plain
  `MatMul` (float32's)."""
  import json  # pylint: disable=g-import-not-at-top
  env = child_env.environment()
  env.pop(precision.ONEDNN_FPMATH, None)
  env[precision.TF_FPMATH] = 'BF16'
  done = subprocess.run([sys.executable, '-c', _ROUNDING_CHILD], env=env,
                        capture_output=True, text=True, timeout=300,
                        check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  routed, plain = json.loads(done.stdout.strip().splitlines()[-1])
  assert 1e-4 < routed < 2e-2, routed
  assert plain < 1e-5, plain


@pytest.mark.parametrize('asked,environ,cpuinfo,problem', [
    ('float32', {}, _AVX2, None),
    ('float32', {precision.ONEDNN_FPMATH: 'strict'}, _AVX2, None),
    ('float32', {precision.TF_FPMATH: 'BF16'}, _AMX,
     'TF_SET_ONEDNN_FPMATH_MODE=BF16 lets oneDNN round'),
    ('float32', {precision.ONEDNN_FPMATH: 'ANY'}, _AVX2,
     'ONEDNN_DEFAULT_FPMATH_MODE=ANY lets oneDNN round'),
    ('bfloat16', {}, _AMX, None),
    ('bfloat16', {precision.TF_FPMATH: 'bf16'}, _AMX, None),
    ('bfloat16', {}, _AMX.replace(' amx_bf16', ''), None),  # AVX512-BF16.
    ('bfloat16', {}, _AVX2, '--matmul_precision=bfloat16 needs a CPU with '
     'bfloat16 arithmetic (avx512_bf16 or amx_bf16 in /proc/cpuinfo); this '
     'one (AMD EPYC'),
    ('bfloat16', {}, _AMX.replace(' avx512_bf16 amx_bf16', ''),
     '--matmul_precision=bfloat16 needs a CPU with bfloat16'),
    ('bfloat16', {precision.TF_FPMATH: 'F16'}, _AMX,
     'TF_SET_ONEDNN_FPMATH_MODE=F16 conflicts'),
    ('bfloat16', {precision.ONEDNN_FPMATH: 'any'}, _AMX,
     'ONEDNN_DEFAULT_FPMATH_MODE=any allows more than bfloat16'),
])
def test_settings_that_would_not_run_as_recorded_are_named(asked, environ,
                                                           cpuinfo, problem):
  got = precision.problem(asked, environ, cpuinfo)
  if problem is None:
    assert got is None
  else:
    assert got is not None and got.startswith(problem), got


def test_configure_sets_the_workers_variable_only_for_bfloat16(monkeypatch):
  """Only os.environ is touched (TF in this process is not told: its
  oneDNN reads the variable once, and the workers inherit it)."""
  monkeypatch.delenv(precision.TF_FPMATH, raising=False)
  monkeypatch.delenv(precision.ONEDNN_FPMATH, raising=False)
  monkeypatch.setattr(precision, 'has_bfloat16_arithmetic',
                      lambda cpuinfo=None: True)
  precision.configure('float32')
  assert precision.TF_FPMATH not in precision.os.environ
  precision.configure('bfloat16')
  assert precision.os.environ[precision.TF_FPMATH] == 'BF16'
  monkeypatch.setattr(precision, 'has_bfloat16_arithmetic',
                      lambda cpuinfo=None: False)
  monkeypatch.delenv(precision.TF_FPMATH)
  with pytest.raises(ValueError, match='needs a CPU with bfloat16'):
    precision.configure('bfloat16')
  assert precision.TF_FPMATH not in precision.os.environ
