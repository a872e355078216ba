"""small_conv and the layers using it against TensorFlow's own convolutions."""

import numpy as np
import pytest
import tensorflow as tf

from fedcg_tff import networks
from fedcg_tff import small_conv


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


def test_applies_only_to_stride_one_valid_convolutions():
  assert small_conv.applies(tf.keras.layers.Conv2D(4, 2))
  assert small_conv.applies(tf.keras.layers.Conv2DTranspose(4, 2))
  assert not small_conv.applies(tf.keras.layers.Conv2D(4, 2, strides=2))
  assert not small_conv.applies(tf.keras.layers.Conv2D(4, 2, padding='same'))
  assert not small_conv.applies(
      tf.keras.layers.Conv2D(4, 2, dilation_rate=2))


@pytest.mark.parametrize('strides,padding,use_bias', [
    (1, 'valid', False), (2, 'same', False), (1, 'valid', True)])
def test_spectral_norm_conv_is_conv_by_normalised_kernel(strides, padding,
                                                         use_bias):
  """Both the small_conv path and Keras' path, in values and gradients."""
  layer = networks.SpectralNormConv2D(16, 2, strides, padding=padding,
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

  got = value_and_grads(lambda: layer(x, training=False))
  want = value_and_grads(lambda: tf.tanh(bias + tf.nn.conv2d(
      x, layer.normalized_kernel(training=False), strides, padding.upper())))
  _assert_all_close(got, want)
  assert float(tf.reduce_max(tf.abs(want[2]))) > 0.0


@pytest.mark.parametrize('strides,padding', [(1, 'valid'), (2, 'same')])
def test_small_conv_transpose_layer_matches_keras_layer(strides, padding):
  kwargs = dict(filters=6, kernel_size=2, strides=strides, padding=padding,
                use_bias=True, activation='sigmoid')
  ours = networks.SmallConv2DTranspose(**kwargs)
  keras = tf.keras.layers.Conv2DTranspose(**kwargs)
  x = tf.random.stateless_normal([3, 4, 4, 5], [0, 3])
  ours.build(x.shape)
  keras.build(x.shape)
  for v in (ours.kernel, ours.bias):
    v.assign(tf.random.stateless_normal(v.shape, [0, 4]))
  keras.set_weights(ours.get_weights())
  np.testing.assert_allclose(ours(x).numpy(), keras(x).numpy(), rtol=1e-5,
                             atol=1e-6)
