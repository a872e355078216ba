"""small_conv and the layers using it against TensorFlow's own convolutions."""

import numpy as np
import pytest
import tensorflow as tf

from fedcg_tff.models import layers
from fedcg_tff.models import small_conv


def _value_and_grads(fn, x, kernel):
  """fn(x, kernel), and the gradients of a non-uniform loss of it."""
  x, kernel = tf.constant(x), tf.constant(kernel)
  with tf.GradientTape() as tape:
    tape.watch([x, kernel])
    y = fn(x, kernel)
    weights = tf.reshape(tf.range(tf.size(y), dtype=tf.float32), y.shape)
    loss = tf.reduce_sum(tf.sin(weights) * y * y)
  return [y] + tape.gradient(loss, [x, kernel])


def _assert_all_close(got, want):
  for g, w in zip(got, want):
    assert g.shape == w.shape
    scale = float(tf.reduce_max(tf.abs(w)))
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=0, atol=1e-5 * scale)


SHAPES = [  # (batch, height, width, c_in, kernel h, kernel w, c_out)
    (8, 3, 3, 256, 2, 2, 512),
    (3, 5, 4, 7, 2, 3, 5),
    (2, 1, 1, 110, 1, 1, 9),
    (2, 6, 6, 3, 3, 3, 4),
]


@pytest.mark.parametrize('n,h,w,c_in,kh,kw,c_out', SHAPES)
def test_conv2d_matches_tf_conv2d(n, h, w, c_in, kh, kw, c_out):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, h + kh - 1, w + kw - 1, c_in)).astype(np.float32)
  kernel = rng.normal(size=(kh, kw, c_in, c_out)).astype(np.float32)
  _assert_all_close(
      _value_and_grads(small_conv.conv2d, x, kernel),
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


@pytest.mark.parametrize('strides,padding,use_bias,training', [
    (1, 'valid', False, False), (2, 'same', False, False),
    (1, 'valid', True, False), (1, 'valid', False, True),
    (2, 'same', False, True)])
def test_spectral_norm_conv_is_conv_by_normalised_kernel(strides, padding,
                                                         use_bias, training):
  """Both the small_conv path and Keras' path, in values and gradients; in
  training both sides start from the same u and take one power step."""
  layer = layers.SpectralNormConv2D(16, 2, strides, padding=padding,
                                      use_bias=use_bias, activation='tanh')
  x = tf.random.stateless_normal([4, 5, 5, 8], [0, 1])
  layer.build(x.shape)
  layer.kernel.assign(tf.random.stateless_normal(layer.kernel.shape, [0, 2]))
  bias = 0.0
  if use_bias:
    layer.bias.assign(tf.random.stateless_normal(layer.bias.shape, [0, 5]))
    bias = layer.bias

  def value_and_grads(fn):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = fn()
      loss = tf.reduce_sum(tf.sin(y) * y)
    return [y] + tape.gradient(loss, [x, layer.kernel])

  u = tf.constant(layer.sn_u)
  got = value_and_grads(lambda: layer(x, training=training))
  u_after = tf.constant(layer.sn_u)
  layer.sn_u.assign(u)
  want = value_and_grads(lambda: tf.tanh(bias + tf.nn.conv2d(
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

  def value_and_grads(model):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = model(x)
      loss = tf.reduce_sum(tf.sin(3.0 * y) * y)
    return [y] + tape.gradient(loss, [x] + model.trainable_weights)

  _assert_all_close(value_and_grads(ours), value_and_grads(keras))
