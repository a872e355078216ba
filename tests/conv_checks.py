"""Checks shared by the convolution tests: a convolution's value with its
gradients, and equality to float rounding relative to the largest value."""

import numpy as np
import tensorflow as tf


def value_and_grads(fn, x, kernel):
  """fn(x, kernel), and the gradients of a non-uniform loss of it."""
  x, kernel = tf.convert_to_tensor(x), tf.convert_to_tensor(kernel)
  with tf.GradientTape() as tape:
    tape.watch([x, kernel])
    y = fn(x, kernel)
    weights = tf.reshape(tf.range(tf.size(y), dtype=tf.float32), tf.shape(y))
    loss = tf.reduce_sum(tf.sin(weights) * y * y)
  return [y] + tape.gradient(loss, [x, kernel])


def assert_all_close(got, want):
  for g, w in zip(got, want):
    assert g.shape == w.shape
    scale = float(tf.reduce_max(tf.abs(w)))
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=0, atol=1e-5 * scale)
