"""A network's weights as plain tuples of tensors, and seeded initial draws.

Weights cross TFF boundaries as tuples of tensors in `model.weights` order
(trainable and non-trainable: batch-norm statistics and the spectral norm's
`u` travel with the network they belong to). `values` reads them, `assign`
writes them, and `sample_initial` draws fresh initial weights from a seed
tensor inside a traced computation.
"""

from typing import Sequence

import tensorflow as tf

from fedcg_tff import graph_code


@graph_code.plain
def values(model: tf.keras.Model) -> tuple[tf.Tensor, ...]:
  """All of `model`'s weights as a tuple of tensors (read, not variables)."""
  return tuple(tf.identity(v) for v in model.weights)


def update(new: Sequence[tf.Tensor], old: Sequence[tf.Tensor]
           ) -> tuple[tf.Tensor, ...]:
  """`new - old`, weight by weight: what a round changed (what clients
  upload under DP, where updates are clipped and noised)."""
  return tuple(n - o for n, o in zip(new, old, strict=True))


@graph_code.plain
def apply_update(model: tf.keras.Model, old: Sequence[tf.Tensor],
                 delta: Sequence[tf.Tensor]) -> tuple[tf.Tensor, ...]:
  """`old + delta`, weight by weight (the inverse of `update`), for
  `model`'s weights (as `values` reads them), with every batch-norm moving
  variance raised to at least 0.

  Where delta is a noised update (DP), the noise can
  push a small moving variance below zero, and inference (which divides by
  its square root) then gives NaN everywhere. A variance cannot be negative,
  so 0 is the nearest valid value; clamping is post-processing of the
  noised update, so DP's guarantee holds. Valid values pass unchanged."""
  variances = {id(layer.moving_variance) for layer in model.submodules
               if isinstance(layer, tf.keras.layers.BatchNormalization)}
  return tuple(tf.maximum(o + d, 0.0) if id(w) in variances else o + d
               for w, o, d in zip(model.weights, old, delta, strict=True))


@graph_code.plain
def assign(model: tf.keras.Model, values: Sequence[tf.Tensor]):
  """Assigns `values` (as from `values`) to `model`; returns the ops."""
  if len(values) != len(model.weights):
    raise ValueError(f'{model.name} has {len(model.weights)} weights, '
                     f'got {len(values)} values')
  return [v.assign(t) for v, t in zip(model.weights, values)]


def _initializer_by_variable(model: tf.keras.Model) -> dict[int, object]:
  """Maps id(variable) to the Keras initialiser that created it."""
  found = {}
  for layer in model.submodules:
    if not isinstance(layer, tf.keras.layers.Layer):
      continue
    for attr, init in vars(layer).items():
      if not attr.endswith('_initializer'):
        continue
      variable = getattr(layer, attr[:-len('_initializer')], None)
      if isinstance(variable, tf.Variable):
        found[id(variable)] = tf.keras.initializers.get(init)
  return found


def _stateless_sample(init, shape, dtype, seed):
  """A draw from `init`'s distribution with a stateless `seed` (shape [2]).

  Dispatches on the class name because Keras hands out its v1 initialiser
  classes instead of the v2 ones when layers are built in graph mode (as
  inside a TFF computation); both carry the same attributes.
  """
  kind = type(init).__name__.lower().replace('_', '').replace('initializer', '')
  if kind == 'zeros':
    return tf.zeros(shape, dtype)
  if kind == 'ones':
    return tf.ones(shape, dtype)
  if kind in ('randomuniform', 'uniform'):
    return tf.random.stateless_uniform(shape, seed, init.minval, init.maxval,
                                       dtype)
  if kind in ('randomnormal', 'normal'):
    return tf.random.stateless_normal(shape, seed, init.mean, init.stddev,
                                      dtype)
  if kind == 'glorotuniform':
    receptive = 1
    for dim in shape[:-2]:
      receptive *= dim
    fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
    limit = (6.0 / (fan_in + fan_out)) ** 0.5
    return tf.random.stateless_uniform(shape, seed, -limit, limit, dtype)
  raise TypeError(f'No stateless sampler for initialiser {init!r}')


def sample_initial(model: tf.keras.Model, seed) -> tuple[tf.Tensor, ...]:
  """Fresh initial weights for `model`, a deterministic function of `seed`.

  Keras initialisers take only Python seeds, but a TFF computation is traced
  once for all clients, each with its own seed tensor. So every weight is
  redrawn here with stateless ops from the distribution of the initialiser
  that created it (one seed stream per weight, salted by the model's name).
  """
  initializers = _initializer_by_variable(model)
  salt = sum(ord(c) * 31**i for i, c in enumerate(model.name)) % (1 << 30)
  values = []
  for index, variable in enumerate(model.weights):
    init = initializers.get(id(variable))
    if init is None:
      raise TypeError(f'{model.name}: no initialiser found for {variable.name}')
    key = tf.constant(salt * 4096 + index, tf.int64)
    values.append(_stateless_sample(
        init, variable.shape, variable.dtype,
        tf.stack([tf.cast(seed, tf.int64), key])))
  return tuple(values)
