"""Plain TF of the gathering aggregation (`aggregators_tff.build_collect`):
its accumulator is every client's value stacked on a leading client axis."""

import tensorflow as tf


def empty_stack(specs):
  """A stack of no clients: `[0, ...]` tensors for a structure of tensor
  specs (anything with `dtype` and `shape`: `tf.TensorSpec`,
  `tff.TensorType`) whose leading (client) dimension is unknown. Each keeps
  that static shape `[None, ...]`, so the accumulator has one type however
  many clients it has seen."""
  return tf.nest.map_structure(
      lambda s: tf.raw_ops.PlaceholderWithDefault(
          input=tf.zeros([0, *s.shape[1:]], s.dtype), shape=s.shape), specs)


def append(stack, value):
  """`stack` with `value` appended along the leading client axis."""
  return tf.nest.map_structure(lambda a, v: tf.concat([a, v[None]], 0),
                               stack, value)


def concat(a, b):
  """Two stacks joined along the client axis, `a`'s clients first."""
  return tf.nest.map_structure(lambda x, y: tf.concat([x, y], 0), a, b)
