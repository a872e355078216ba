"""small_conv and the layers using it against TensorFlow's own convolutions."""

import numpy as np
import pytest
import tensorflow as tf

from fedcg_tff.models import layers
from fedcg_tff.models import lenet
from fedcg_tff.models import small_conv
from tests.conv_checks import assert_all_close as _assert_all_close
from tests.conv_checks import value_and_grads as _value_and_grads


def _call_value_and_grads(call, x, weights,
                          loss=lambda y: tf.reduce_sum(tf.sin(y) * y)):
  """call()'s value and the gradients of loss(value) for x and `weights`."""
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = call()
    value = loss(y)
  return [y] + tape.gradient(value, [x] + list(weights))


def _layer_value_and_grads(layer, x, call,
                           loss=lambda y: tf.reduce_sum(tf.sin(y) * y)):
  """call()'s value and the gradients of loss(value) for x and the kernel."""
  return _call_value_and_grads(call, x, [layer.kernel], loss)


def _model_value_and_grads(model, x):
  """model(x), and the gradients of a non-uniform loss of it for x and the
  model's trainable weights."""
  return _call_value_and_grads(lambda: model(x), x, model.trainable_weights,
                               lambda y: tf.reduce_sum(tf.sin(3.0 * y) * y))


@pytest.fixture
def avx2_choices(monkeypatch):
  """The AVX2 hosts' kernel choices (swapped products, the banded conv1),
  whatever this host is, for the tests of those mechanisms."""
  monkeypatch.setattr(small_conv, 'ORIENTED_PRODUCTS', True)
  monkeypatch.setattr(small_conv, 'BANDED_CONVS', True)


SHAPES = [  # (batch, height, width, c_in, kernel h, kernel w, c_out)
    (8, 3, 3, 256, 2, 2, 512),
    (3, 5, 4, 7, 2, 3, 5),
    (2, 1, 1, 110, 1, 1, 9),
    (2, 6, 6, 3, 3, 3, 4),
]


@pytest.mark.parametrize('conv', [small_conv.conv2d,
                                  small_conv.banded_conv2d])
@pytest.mark.parametrize(
    'n,h,w,c_in,kh,kw,c_out',
    SHAPES + [(8, 28, 28, 1, 5, 5, 6),  # E's conv1.
              (2, 4, 7, 2, 3, 2, 3)])  # Not square.
def test_conv2d_matches_tf_conv2d(conv, n, h, w, c_in, kh, kw, c_out):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, h + kh - 1, w + kw - 1, c_in)).astype(np.float32)
  kernel = rng.normal(size=(kh, kw, c_in, c_out)).astype(np.float32)
  _assert_all_close(
      _value_and_grads(conv, x, kernel),
      _value_and_grads(lambda a, k: tf.nn.conv2d(a, k, 1, 'VALID'), x, kernel))


@pytest.mark.parametrize('n,h,w,c_in,kh,kw,c_out', SHAPES)
def test_conv2d_transpose_matches_tf(n, h, w, c_in, kh, kw, c_out):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(n, h, w, c_in)).astype(np.float32)
  kernel = rng.normal(size=(kh, kw, c_out, c_in)).astype(np.float32)
  out_shape = [n, h + kh - 1, w + kw - 1, c_out]
  _assert_all_close(
      _value_and_grads(small_conv.conv2d_transpose, x, kernel),
      _value_and_grads(
          lambda a, k: tf.nn.conv2d_transpose(a, k, out_shape, 1, 'VALID'),
          x, kernel))


def test_applies_only_to_stride_one_valid_convolutions_of_known_maps():
  x = tf.zeros([2, 5, 5, 3])
  assert small_conv.applies(tf.keras.layers.Conv2D(4, 2), x)
  assert small_conv.applies(tf.keras.layers.Conv2DTranspose(4, 2), x)
  assert not small_conv.applies(tf.keras.layers.Conv2D(4, 2, strides=2), x)
  assert not small_conv.applies(
      tf.keras.layers.Conv2D(4, 2, padding='same'), x)
  assert not small_conv.applies(
      tf.keras.layers.Conv2D(4, 2, dilation_rate=2), x)
  assert not small_conv.applies(
      tf.keras.layers.Conv2DTranspose(4, 2, dilation_rate=2), x)
  assert not small_conv.applies(tf.keras.layers.Conv2D(4, 2),
                                tf.keras.Input((None, None, 3)))


def test_layers_take_maps_of_unknown_size():
  """Keras' path then: the windows need a static height and width."""
  x = tf.keras.Input((None, None, 3))
  y = layers.SpectralNormConv2D(4, 2, use_bias=False)(x, training=True)
  y = layers.SmallConv2DTranspose(5, 2, use_bias=False)(y)
  model = tf.keras.Model(x, y)
  assert model(tf.zeros([2, 6, 7, 3])).shape == (2, 6, 7, 5)


@pytest.mark.parametrize('strides,padding,use_bias,training,iterations', [
    (1, 'valid', False, False, 1), (2, 'same', False, False, 1),
    (1, 'valid', True, False, 1), (1, 'valid', False, True, 1),
    (1, 'valid', True, True, 2), (2, 'same', False, True, 1)])
def test_spectral_norm_conv_is_conv_by_normalised_kernel(
    strides, padding, use_bias, training, iterations):
  """Both the small_conv path and Keras' path, in values and gradients; in
  training both sides start from the same u and take the same power
  steps."""
  layer = layers.SpectralNormConv2D(16, 2, strides, padding=padding,
                                    use_bias=use_bias, activation='tanh',
                                    power_iterations=iterations)
  x = tf.random.stateless_normal([4, 5, 5, 8], [0, 1])
  layer.build(x.shape)
  layer.kernel.assign(tf.random.stateless_normal(layer.kernel.shape, [0, 2]))
  bias = 0.0
  if use_bias:
    layer.bias.assign(tf.random.stateless_normal(layer.bias.shape, [0, 5]))
    bias = layer.bias

  u = tf.constant(layer.sn_u)
  got = _layer_value_and_grads(layer, x, lambda: layer(x, training=training))
  u_after = tf.constant(layer.sn_u)
  layer.sn_u.assign(u)
  want = _layer_value_and_grads(layer, x, lambda: tf.tanh(bias + tf.nn.conv2d(
      x, layer.normalized_kernel(training=training), strides,
      padding.upper())))
  _assert_all_close(got, want)
  np.testing.assert_array_equal(layer.sn_u.numpy(), u_after.numpy())
  assert training != np.array_equal(u_after.numpy(), u.numpy())
  assert float(tf.reduce_max(tf.abs(want[2]))) > 0.0


@pytest.mark.parametrize('strides,padding,kernel_size', [
    (1, 'valid', (2, 3)), (2, 'same', 2)])
def test_small_conv_transpose_layer_matches_keras_layer(strides, padding,
                                                        kernel_size):
  """In a functional model (batch unknown), values and gradients."""
  kwargs = dict(filters=6, kernel_size=kernel_size, strides=strides,
                padding=padding, use_bias=True, activation='sigmoid')
  inputs = tf.keras.Input((4, 5, 5))
  ours = tf.keras.Model(inputs, layers.SmallConv2DTranspose(**kwargs)(inputs))
  keras = tf.keras.Model(inputs,
                         tf.keras.layers.Conv2DTranspose(**kwargs)(inputs))
  for v in ours.weights:
    v.assign(tf.random.stateless_normal(v.shape, [0, 4]))
  keras.set_weights(ours.get_weights())
  x = tf.random.stateless_normal([3, 4, 5, 5], [0, 3])

  _assert_all_close(_model_value_and_grads(ours, x),
                    _model_value_and_grads(keras, x))


def _ops(fn, *signature):
  graph = tf.function(fn).get_concrete_function(*signature).graph
  ops = [op.type for op in graph.get_operations()]
  for function in graph.as_graph_def().library.function:  # tf.cond branches
    ops += [node.op for node in function.node_def]
  return ops


@pytest.mark.parametrize('rows,weights,swapped', [
    (32, (1024, 512), True), (256, (1024, 512), True),
    (257, (1024, 512), False), (32, (128, 104), False)])
@pytest.mark.usefixtures('avx2_choices')
def test_times_transposed_swaps_few_rows_by_a_large_matrix(rows, weights,
                                                           swapped):
  """(b a^T)^T where oneDNN runs it faster (ORIENT_MAX_ROWS), else a b^T;
  with the row count known when traced, the choice is made then."""
  rng = np.random.default_rng(2)
  a = tf.constant(rng.normal(size=(rows, weights[1])).astype(np.float32))
  b = tf.constant(rng.normal(size=weights).astype(np.float32))
  ops = _ops(small_conv.times_transposed, tf.TensorSpec(a.shape),
             tf.TensorSpec(b.shape))
  assert ops.count('Transpose') == int(swapped)
  assert ops.count('MatMul') == 1
  _assert_all_close([small_conv.times_transposed(a, b)],
                    [tf.matmul(a, b, transpose_b=True)])


@pytest.mark.usefixtures('avx2_choices')
def test_times_transposed_chooses_when_run_if_rows_unknown():
  """Both branches give the same values, so which one ran is read from the
  graph: the swap (a Transpose) must sit in the branch taken at up to
  ORIENT_MAX_ROWS rows, and the predicate must hold there."""
  rng = np.random.default_rng(3)
  b = tf.constant(rng.normal(size=(1024, 512)).astype(np.float32))
  fn = tf.function(small_conv.times_transposed,
                   input_signature=[tf.TensorSpec([None, 512]),
                                    tf.TensorSpec(b.shape)])
  graph = fn.get_concrete_function().graph
  (cond,) = [op for op in graph.get_operations()
             if op.type in ('If', 'StatelessIf')]
  branches = {f.signature.name: [node.op for node in f.node_def]
              for f in graph.as_graph_def().library.function}
  assert 'Transpose' in branches[cond.get_attr('then_branch').name]
  assert 'Transpose' not in branches[cond.get_attr('else_branch').name]
  predicate = small_conv._swaps  # pylint: disable=protected-access
  swaps = tf.function(lambda a: predicate(a, b),
                      input_signature=[tf.TensorSpec([None, 512])])
  for rows, swapped in ((8, True), (256, True), (257, False), (600, False)):
    a = tf.constant(rng.normal(size=(rows, 512)).astype(np.float32))
    _assert_all_close([fn(a, b)], [tf.matmul(a, b, transpose_b=True)])
    assert bool(swaps(a)) == swapped


def test_times_transposed_can_be_turned_off(monkeypatch):
  monkeypatch.setattr(small_conv, 'ORIENTED_PRODUCTS', False)
  ops = _ops(small_conv.times_transposed, tf.TensorSpec([32, 512]),
             tf.TensorSpec([1024, 512]))
  assert 'Transpose' not in ops


@pytest.mark.parametrize('batch', [8, 80])
@pytest.mark.usefixtures('avx2_choices')
def test_convs_with_unknown_batch_match_tf_in_both_orientations(batch):
  """As in the GAN step (batch unknown when traced): conv2d's input
  gradient and conv2d_transpose's product go through times_transposed's
  tf.cond; 8 and 80 examples fall on either side of ORIENT_MAX_ROWS."""
  rng = np.random.default_rng(4)
  spec = lambda shape: tf.TensorSpec([None] + shape)
  kernel = tf.constant(rng.normal(size=(2, 2, 256, 512)).astype(np.float32))
  x = rng.normal(size=(batch, 3, 3, 256)).astype(np.float32)
  conv = tf.function(lambda a, k: _value_and_grads(small_conv.conv2d, a, k),
                     input_signature=[spec([3, 3, 256]),
                                      tf.TensorSpec(kernel.shape)])
  _assert_all_close(conv(x, kernel), _value_and_grads(
      lambda a, k: tf.nn.conv2d(a, k, 1, 'VALID'), x, kernel))
  kernel_t = tf.constant(
      rng.normal(size=(2, 2, 512, 256)).astype(np.float32))
  x_t = rng.normal(size=(batch, 2, 2, 256)).astype(np.float32)
  conv_t = tf.function(
      lambda a, k: _value_and_grads(small_conv.conv2d_transpose, a, k),
      input_signature=[spec([2, 2, 256]), tf.TensorSpec(kernel_t.shape)])
  _assert_all_close(conv_t(x_t, kernel_t), _value_and_grads(
      lambda a, k: tf.nn.conv2d_transpose(a, k, [batch, 3, 3, 512], 1,
                                          'VALID'), x_t, kernel_t))


@pytest.mark.parametrize('paired', [False, True])
def test_spectral_norm_conv_kernel_gradient_is_one_product(paired):
  """In training, each pass's sigma adds its rank-one term to W's gradient
  inside the conv's kernel-gradient product (layers._sigma_divided_product), not
  as kernel-sized products of its own summed after."""
  layer = layers.SpectralNormConv2D(512, 2, use_bias=False)
  layer.build((None, 3, 3, 256))

  @tf.function
  def kernel_gradient(x):
    with tf.GradientTape() as tape:
      if paired:
        with layers.paired_passes():
          y = layer(x, training=True)
      else:
        y = layer(x, training=True)
      loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, layer.kernel)

  graph = kernel_gradient.get_concrete_function(
      tf.TensorSpec([None, 3, 3, 256])).graph
  kernel_sized = [op for op in graph.get_operations() if op.type == 'MatMul'
                  and op.outputs[0].shape == (1024, 512)]
  assert len(kernel_sized) == 1


def test_trained_spectral_norm_conv_on_a_large_kernel_matches_tf():
  """D's third conv at batch 8 in training: its input gradient takes the
  swapped product (32 rows, a 1024 x 512 kernel) inside the sigma-divided
  product; values and gradients against tf.nn.conv2d by the normalised
  kernel, from the same u."""
  layer = layers.SpectralNormConv2D(512, 2, use_bias=False)
  x = tf.random.stateless_normal([8, 3, 3, 256], [0, 9])
  layer.build(x.shape)
  u = tf.constant(layer.sn_u)
  got = _layer_value_and_grads(layer, x, lambda: layer(x, training=True))
  layer.sn_u.assign(u)
  want = _layer_value_and_grads(layer, x, lambda: tf.nn.conv2d(
      x, layer.normalized_kernel(training=True), 1, 'VALID'))
  _assert_all_close(got, want)


@pytest.mark.parametrize('iterations,strides,padding', [
    (1, 1, 'valid'), (2, 1, 'valid'), (1, 2, 'same'), (2, 2, 'same')])
def test_paired_spectral_norm_conv_equals_two_calls(iterations, strides,
                                                    padding):
  """Two passes stacked (layers.paired_passes): each pass its own power step
  (the second from the first's u) and sigma, and its own rank-one term in
  W's gradient, in values and gradients against two training calls; on
  small_conv's path (stride 1) and Keras' (stride 2)."""
  x = tf.random.stateless_normal([6, 3, 3, 32], [0, 6])
  copies = []
  for _ in range(2):
    layer = layers.SpectralNormConv2D(64, 2, strides, padding=padding,
                                      use_bias=False,
                                      power_iterations=iterations)
    layer.build(x.shape)
    layer.kernel.assign(tf.random.stateless_normal(layer.kernel.shape, [0, 7]))
    layer.sn_u.assign(tf.random.stateless_normal(layer.sn_u.shape, [0, 8]))
    copies.append(layer)

  # Weighted to make each pass's sigma term a large part of dW.
  loss = lambda y: tf.reduce_sum(tf.sin(y) * y) + 10.0 * tf.reduce_sum(y[3:])

  def paired():
    with layers.paired_passes():
      return copies[0](x, training=True)

  got = _layer_value_and_grads(copies[0], x, paired, loss)
  want = _layer_value_and_grads(copies[1], x, lambda: tf.concat(
      [copies[1](x[:3], training=True), copies[1](x[3:], training=True)], 0),
                                loss)
  _assert_all_close(got, want)
  np.testing.assert_allclose(copies[0].sn_u.numpy(), copies[1].sn_u.numpy(),
                             rtol=0, atol=1e-6)


@pytest.mark.parametrize('channels', [1, 3])
@pytest.mark.usefixtures('avx2_choices')
def test_banded_conv_layer_matches_keras_layer(channels):
  """In a functional model (batch unknown), values and gradients: the
  banded product on one input channel, Keras' own conv on three."""
  kwargs = dict(filters=6, kernel_size=5, activation='sigmoid')
  inputs = tf.keras.Input((32, 32, channels))
  ours = tf.keras.Model(inputs, layers.BandedConv2D(**kwargs)(inputs))
  keras = tf.keras.Model(inputs, tf.keras.layers.Conv2D(**kwargs)(inputs))
  for v in ours.weights:
    v.assign(tf.random.stateless_normal(v.shape, [0, 5]))
  keras.set_weights(ours.get_weights())
  x = tf.random.stateless_normal([3, 32, 32, channels], [0, 6])

  _assert_all_close(_model_value_and_grads(ours, x),
                    _model_value_and_grads(keras, x))
  convs = _ops(ours, tf.TensorSpec([None, 32, 32, channels]))
  assert ('Conv2D' in convs) == (channels != 1)


@pytest.mark.usefixtures('avx2_choices')
def test_lenet_extractor_runs_its_first_conv_banded():
  """E's conv1 (one input channel) as the banded product, its conv2 as
  oneDNN's convolution."""
  extractor = lenet.build_extractor()
  ops = _ops(lambda x: extractor(x, training=False),
             tf.TensorSpec([None, 32, 32, 1]))
  assert ops.count('Conv2D') == 1 and ops.count('MatMul') == 1
  assert small_conv.bands(extractor.get_layer('conv1'),
                          tf.keras.Input((32, 32, 1)))
  assert not small_conv.bands(extractor.get_layer('conv2'),
                              tf.keras.Input((14, 14, 6)))
  # Not measured wider; Keras' extra batch dimensions are not cut.
  assert not small_conv.bands(extractor.get_layer('conv1'),
                              tf.keras.Input((64, 64, 1)))
  assert not small_conv.bands(extractor.get_layer('conv1'),
                              tf.keras.Input((2, 32, 32, 1)))


_AVX2_HOST = ('vendor_id\t: AuthenticAMD\ncpu family\t: 25\n'
              'flags\t\t: fpu fma avx2\n')
_AVX512_HOST = ('vendor_id\t: GenuineIntel\ncpu family\t: 6\n'
                'flags\t\t: fpu fma avx2 avx512f avx512dq avx512cd avx512bw '
                'avx512vl\n')


def test_the_avx2_tricks_are_off_where_onednn_runs_avx512_kernels(
    monkeypatch):
  """Both tricks speed up oneDNN's AVX2 kernels and slow its AVX-512 ones
  (measured on Zen 3, Zen 1 and an Intel Xeon): chosen by the ISA oneDNN
  dispatches on, which ONEDNN_MAX_CPU_ISA can cap; this host's choice is
  the one its flags give."""
  with open('/proc/cpuinfo') as f:
    here = small_conv.host_tuned_choices(f.read())
  assert (small_conv.ORIENTED_PRODUCTS, small_conv.BANDED_CONVS) == here
  monkeypatch.delenv('ONEDNN_MAX_CPU_ISA', raising=False)
  monkeypatch.delenv('DNNL_MAX_CPU_ISA', raising=False)
  assert small_conv.host_tuned_choices(_AVX2_HOST) == (True, True)
  assert small_conv.host_tuned_choices(_AVX512_HOST) == (False, False)
  # AVX-512 without the byte/word and vector-length extensions (Xeon Phi)
  # gets no oneDNN AVX-512 kernels for this.
  knl = _AVX512_HOST.replace(' avx512bw avx512vl', '')
  assert small_conv.host_tuned_choices(knl) == (True, True)
  # oneDNN capped at AVX2 runs its AVX2 kernels on an AVX-512 host.
  monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX2')
  assert small_conv.host_tuned_choices(_AVX512_HOST) == (True, True)
  monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'avx512_core_amx')
  assert small_conv.host_tuned_choices(_AVX512_HOST) == (False, False)


def test_without_banding_the_lenet_extractor_runs_tfs_convolutions(
    monkeypatch):
  """The AVX-512 hosts' choice for E's conv1: oneDNN's convolution (the
  products' orientation: test_times_transposed_can_be_turned_off)."""
  monkeypatch.setattr(small_conv, 'BANDED_CONVS', False)
  extractor = lenet.build_extractor()
  assert not small_conv.bands(extractor.get_layer('conv1'),
                              tf.keras.Input((32, 32, 1)))
  ops = _ops(lambda x: extractor(x, training=False),
             tf.TensorSpec([None, 32, 32, 1]))
  assert ops.count('Conv2D') == 2 and 'MatMul' not in ops
