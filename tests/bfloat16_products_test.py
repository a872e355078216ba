"""The opt-in bfloat16 products (`FedCGConfig.matmul_precision`): which
products take the route, that it computes the float32 convolutions when
oneDNN may not round, that it does round when the process allows it (in a
TFF worker, as a run has it), and the settings' checks."""

import json
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
from tests import binary_runs
from tests import fake_data
from tests.conv_checks import assert_all_close
from tests.conv_checks import value_and_grads

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
  return lambda x, k: value_and_grads(
      lambda a, b: small_conv.conv2d(a, b, bfloat16=bfloat16), x, k)


# GAN shapes at batch 8, every product dimension at least BFLOAT16_MIN_DIM:
# (batch, height, width, c_in, kernel h, kernel w, c_out) of D's second
# and third convs, and of G's second and third transposed convs (their
# input maps; c_out is the output's channels).
ROUTED_SHAPES = [(8, 4, 4, 128, 2, 2, 256), (8, 3, 3, 256, 2, 2, 512)]
ROUTED_TRANSPOSED_SHAPES = [(8, 2, 2, 512, 2, 2, 256),
                            (8, 3, 3, 256, 2, 2, 128)]


@pytest.mark.skipif(precision.problem('float32') is not None,
                    reason='this process lets oneDNN round its products')
@pytest.mark.parametrize('n,h,w,c_in,kh,kw,c_out', ROUTED_SHAPES)
def test_the_routed_conv_is_the_float32_conv_here(n, h, w, c_in, kh, kw,
                                                 c_out):
  """This process leaves oneDNN strict (no fpmath variable set): batched
  products are float32 products, so the route's convolution and its
  gradients are TensorFlow's to float rounding; every product of it was
  batched."""
  rng = np.random.default_rng(5)
  x = rng.normal(size=(n, h, w, c_in)).astype(np.float32)
  kernel = rng.normal(size=(kh, kw, c_in, c_out)).astype(np.float32)
  assert _ops(_conv_with_gradients(True), tf.TensorSpec(x.shape),
              tf.TensorSpec(kernel.shape)).count('BatchMatMulV2') == 3
  assert_all_close(
      _conv_with_gradients(True)(x, kernel),
      value_and_grads(lambda a, k: tf.nn.conv2d(a, k, 1, 'VALID'), x, kernel))


@pytest.mark.skipif(precision.problem('float32') is not None,
                    reason='this process lets oneDNN round its products')
@pytest.mark.parametrize('n,h,w,c_in,kh,kw,c_out', ROUTED_TRANSPOSED_SHAPES)
def test_the_routed_transposed_conv_is_the_float32_one_here(n, h, w, c_in,
                                                           kh, kw, c_out):
  rng = np.random.default_rng(6)
  x = rng.normal(size=(n, h, w, c_in)).astype(np.float32)
  kernel = rng.normal(size=(kh, kw, c_out, c_in)).astype(np.float32)
  routed = lambda a, k: value_and_grads(
      lambda b, c: small_conv.conv2d_transpose(b, c, True), a, k)
  assert _ops(routed, tf.TensorSpec(x.shape),
              tf.TensorSpec(kernel.shape)).count('BatchMatMulV2') == 3
  assert_all_close(routed(x, kernel), value_and_grads(
      lambda a, k: tf.nn.conv2d_transpose(
          a, k, [n, h + kh - 1, w + kw - 1, c_out], 1, 'VALID'), x, kernel))


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
  with small_conv.bfloat16_products():  # The config's False wins.
    assert not layers.SpectralNormConv2D.from_config(
        strict.get_config()).bfloat16_products
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

    images = rng.normal(size=(8, 14, 14, 6)).astype(np.float32)
    kernel = rng.normal(size=(5, 5, 6, 16)).astype(np.float32)

    @tff.tensorflow.computation(spec(a), spec(b), spec(images), spec(kernel))
    def products(x, y, i, k):
      return (small_conv.matmul(x, y, bfloat16=True),
              small_conv.matmul(x, y, bfloat16=False),
              tf.nn.conv2d(i, k, 1, 'VALID'))

    want = a.astype(np.float64) @ b.astype(np.float64)
    conv = tf.nn.conv2d(images.astype(np.float64), kernel.astype(np.float64),
                        1, 'VALID').numpy()
    error = lambda got, want: float(np.max(np.abs(got - want)) /
                                    np.max(np.abs(want)))
    routed, plain, convolved = products(a, b, images, kernel)
    print(json.dumps([error(np.asarray(routed), want),
                      error(np.asarray(plain), want),
                      error(np.asarray(convolved), conv)]))
    ''')


@pytest.mark.skipif(not precision.has_bfloat16_arithmetic(),
                    reason='this host has no bfloat16 arithmetic')
def test_a_worker_started_with_the_setting_rounds_the_routed_products():
  """What a bfloat16 run relies on, end to end: TFF's worker, started with
  the setting, rounds the inputs of the routed products and of a
  convolution (E's, oneDNN's primitive; relative error near bfloat16's
  2^-9) and not those of plain `MatMul` (float32's)."""
  env = child_env.environment()
  env.pop(precision.ONEDNN_FPMATH, None)
  env[precision.TF_FPMATH] = 'BF16'
  done = subprocess.run([sys.executable, '-c', _ROUNDING_CHILD], env=env,
                        capture_output=True, text=True, timeout=300,
                        check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  routed, plain, convolved = json.loads(done.stdout.strip().splitlines()[-1])
  assert 1e-4 < routed < 2e-2, routed
  assert 1e-4 < convolved < 2e-2, convolved
  assert plain < 1e-5, plain


@pytest.mark.skipif(not precision.has_bfloat16_arithmetic(),
                    reason='this host has no bfloat16 arithmetic')
def test_a_bfloat16_run_starts_its_worker_with_the_setting(tmp_path):
  """run_fedcg as a user runs it (its own process, tiny generated data):
  its TFF worker inherits TF_SET_ONEDNN_FPMATH_MODE=BF16, so the setting
  is in place before the worker starts; run.json records it."""
  data = tmp_path / 'idx'
  data.mkdir()
  fake_data.write_fake_fmnist(str(data), n_train=64, n_test=40)
  out = tmp_path / 'run'
  env = {precision.TF_FPMATH: '', precision.ONEDNN_FPMATH: ''}
  run = binary_runs.BinaryRun('run_fedcg', [
      f'--output_dir={out}', f'--data_dir={data}', '--rounds=1',
      '--num_clients=2', '--train_per_client=16', '--local_epochs=1',
      '--gan_epochs=1', '--server_epochs=1', '--server_steps_per_epoch=2',
      '--matmul_precision=bfloat16'], env=env)
  done, workers = run.wait(300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert workers and set(run.worker_fpmath.values()) == {'BF16'}, (
      run.worker_fpmath)
  assert json.loads((out / 'run.json').read_text())['config'][
      'matmul_precision'] == 'bfloat16'


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
  """Only os.environ is touched (the workers started later inherit it;
  TF in this process reads it at its first oneDNN op, and none runs while
  it is set here). Both variables start empty (as unset) and are removed
  after the test."""
  for name in (precision.TF_FPMATH, precision.ONEDNN_FPMATH):
    monkeypatch.setenv(name, '')
  monkeypatch.setattr(precision, 'has_bfloat16_arithmetic',
                      lambda cpuinfo=None: True)
  precision.configure('float32')
  assert precision.os.environ[precision.TF_FPMATH] == ''
  precision.configure('bfloat16')
  assert precision.os.environ[precision.TF_FPMATH] == 'BF16'
  monkeypatch.setenv(precision.TF_FPMATH, '')
  monkeypatch.setattr(precision, 'has_bfloat16_arithmetic',
                      lambda cpuinfo=None: False)
  with pytest.raises(ValueError, match='needs a CPU with bfloat16'):
    precision.configure('bfloat16')
  assert precision.os.environ[precision.TF_FPMATH] == ''


def test_runs_replayed_together_must_share_their_precision(monkeypatch):
  """The inversion attack replays a FedCG run and optionally a FedAvg run
  in one worker: one precision for both, set as the runs recorded it."""
  for name in (precision.TF_FPMATH, precision.ONEDNN_FPMATH):
    monkeypatch.setenv(name, '')
  monkeypatch.setattr(precision, 'has_bfloat16_arithmetic',
                      lambda cpuinfo=None: True)
  with pytest.raises(ValueError, match=r'^--run_dir=a ran with '
                     r'--matmul_precision=bfloat16 and --fedavg_run_dir=b '
                     r'ran with --matmul_precision=float32: replay them'):
    precision.configure_for_runs({'--run_dir=a': 'bfloat16',
                                  '--fedavg_run_dir=b': 'float32'})
  assert precision.os.environ[precision.TF_FPMATH] == ''
  precision.configure_for_runs({'--run_dir=a': 'bfloat16'})
  assert precision.os.environ[precision.TF_FPMATH] == 'BF16'
  monkeypatch.setattr(precision, 'has_bfloat16_arithmetic',
                      lambda cpuinfo=None: False)
  monkeypatch.setenv(precision.TF_FPMATH, '')
  with pytest.raises(ValueError, match=r'^--run_dir=a ran with '
                     r'--matmul_precision=bfloat16: --matmul_precision='
                     r'bfloat16 needs a CPU'):
    precision.configure_for_runs({'--run_dir=a': 'bfloat16'})
