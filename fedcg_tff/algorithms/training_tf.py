"""Plain-TensorFlow training pieces shared by FedCG and every baseline.

Nothing here places or builds TFF computations (only its functional
optimizers are used, below). PartyNetworks travel as tuples of tensors
(`model_weights.values`); a function that trains assigns the incoming
values to Keras models, trains them and reads the results back, all inside
one `tf.function`, so automatic control dependencies order the assignments,
updates and reads even inside the graph-mode context of a TFF computation.

Optimizers are `tff.learning.optimizers` (functional Adam or SGD): their state
is a plain structure of tensors, so a client's optimizer state can persist in
its CLIENTS-placed state from round to round. Inside a training loop, Adam
runs as TF's fused kernel instead (`FusedAdamSteps`): same state, same
numbers, one pass over each weight per step.
"""

import functools
import warnings
from typing import Any, Callable, Optional

import attrs
import tensorflow as tf
import tensorflow_federated as tff

from fedcg_tff import graph_code
from fedcg_tff.config import PRIVATE_NETWORKS, FedCGConfig
from fedcg_tff.models import families
from fedcg_tff.models import model_weights
from fedcg_tff.models import small_conv


@attrs.define(frozen=True)
class EvalMetrics:
  val_accuracy: Any
  test_accuracy: Any


NETWORK_NAMES = ('extractor', 'classifier', 'generator', 'discriminator')


def _build_network(config: FedCGConfig, name: str) -> tf.keras.Model:
  """Network `name` of `config`'s family, built in the current graph.

  Reads `_NETWORK_FIELDS` of `config`, and its `matmul_precision`, which
  picks the GAN layers' products (`small_conv.bfloat16_products`) and no
  weight (`_template`, which reads weights only, leaves it float32).

  Built with the learning phase fixed: in graph mode (inside a TFF
  computation) every batch-norm layer otherwise traces a `tf.cond` on the
  symbolic learning phase while the functional model is built (184 of them
  for ResNet's E and C), and those construction-time graphs are never run:
  each call re-runs the layers with the `training` it is given. Same values
  bit for bit (checked on two FedCG rounds); FedCG's ResNet-18 process
  built in 30 s instead of 43 s.
  """
  model = config.model
  if name == 'extractor':
    build = lambda: families.build_extractor(model, config.image_channels)
  elif name == 'classifier':
    build = lambda: families.build_classifier(model, config.num_classes)
  elif name == 'generator':
    build = lambda: families.build_generator(model, config.num_classes,
                                             config.noise_dim)
  else:
    build = lambda: families.build_discriminator(model, config.num_classes)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', UserWarning)  # "deprecated": see above.
    with tf.keras.backend.learning_phase_scope(0), small_conv.bfloat16_products(
        config.matmul_precision == 'bfloat16'):
      return build()


def _check_names(names) -> None:
  if isinstance(names, str):
    raise TypeError(f'names must be a sequence of names, got {names!r}')
  unknown = set(names) - set(NETWORK_NAMES)
  if unknown:
    raise ValueError(f'Unknown networks {sorted(unknown)}; '
                     f'choose from {NETWORK_NAMES}')


class PartyNetworks:
  """The Keras networks of one party, built once per graph.

  `names` picks the networks to build (default: all four). A computation
  builds only those it uses: in graph mode the generator and discriminator
  take ~0.2 s each to build, and TFF builds a fresh set in every traced
  computation (evaluation needs only E and C). Using a network not built is
  an `AttributeError` naming it. Computations that only draw initial
  weights or need the weights' shapes use `InitialNetworks` instead, which
  builds nothing in their graph.
  """

  def __init__(self, config: FedCGConfig, names=NETWORK_NAMES):
    _check_names(names)
    self.config = config
    self._models = {name: _build_network(config, name)
                    for name in NETWORK_NAMES if name in names}
    # Adam's moment estimates of every trainable weight, for FusedAdamSteps
    # (variables must be made here, outside the training `tf.function`s).
    self._moments = {}
    for net in self._models.values():
      for v in net.trainable_variables:
        name = v.name.split(':')[0]
        self._moments[v.ref()] = (
            tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                        name=f'{name}/adam_m'),
            tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                        name=f'{name}/adam_v'))

  def model(self, name: str) -> tf.keras.Model:
    """The network called `name`: extractor, classifier, generator, ..."""
    try:
      return self._models[name]
    except KeyError:
      raise AttributeError(
          f'These PartyNetworks were built without the {name} '
          f'(built: {tuple(self._models)})') from None

  extractor = property(lambda self: self.model('extractor'))
  classifier = property(lambda self: self.model('classifier'))
  generator = property(lambda self: self.model('generator'))
  discriminator = property(lambda self: self.model('discriminator'))

  @graph_code.plain
  def adam_moments(self, variables):
    """The (first, second) moment variables of each of `variables`."""
    return [self._moments[v.ref()] for v in variables]


# What the networks' builders read of a config.
_NETWORK_FIELDS = ('model', 'image_channels', 'num_classes', 'noise_dim')


@functools.lru_cache(maxsize=32)
def _template(fields: tuple, floatx: str, name: str) -> tf.keras.Model:
  """Network `name` built once per process, read for its weights' names,
  shapes, dtypes and initialisers (what `model_weights.sample_initial`
  reads), never run. `fields`: the values of `_NETWORK_FIELDS`; `floatx`:
  Keras' float type, which sets the weights' dtype (the DLG attack builds
  in float64).

  Called while tracing, it builds in a graph of its own, so nothing joins
  the traced graph. Called eagerly, it builds eagerly: Keras invalidates
  every eager network made before a network is built in a graph.
  """
  del floatx  # Part of the cache key: the build reads it from Keras.
  config = FedCGConfig(**dict(zip(_NETWORK_FIELDS, fields)))
  if tf.executing_eagerly():
    return _build_network(config, name)
  with tf.Graph().as_default():
    return _build_network(config, name)


class InitialNetworks:
  """The networks' initial weights and weight shapes, for the computations
  that need nothing else of them (initial server and client states, the
  upload's type).

  Building Keras networks inside a traced computation is most of what
  tracing these costs (the functional API runs every layer once at
  construction: ResNet-18's E and C take ~0.8 s a build), and TFF traces
  each computation on its own. Here each network is built once per process
  (`_template`: in a graph of its own while tracing), and a computation
  adds only the ops
  that draw its weights: the same stateless draws from the same
  initialisers as from a network built in the computation's graph.
  """

  def __init__(self, config: FedCGConfig, names=NETWORK_NAMES):
    _check_names(names)
    self.config = config
    self._names = tuple(names)

  def model(self, name: str) -> tf.keras.Model:
    """Network `name`'s template: read its weights' shapes and dtypes (its
    `trainable_weights` for `initial_optimizer_state`), never run it."""
    if name not in self._names:
      raise AttributeError(f'These InitialNetworks hold no {name} '
                           f'(held: {self._names})')
    return _template(tuple(getattr(self.config, f) for f in _NETWORK_FIELDS),
                     tf.keras.backend.floatx(), name)

  def zeros(self, name: str) -> tuple[tf.Tensor, ...]:
    """Zeros shaped as network `name`'s weights (`model.weights` order)."""
    return tuple(tf.zeros(v.shape, v.dtype) for v in self.model(name).weights)

  def initial_weights(self, name: str, client_seed=None) -> tuple:
    """Initial weights of network `name` for the server (no `client_seed`)
    or for the client whose private seed is `client_seed` (int64 tensor).

    Every network is drawn from the run's seed, so the clients' copies equal
    each other and the server's (`client_init='shared'`, the published
    code), except that with `client_init='private'` a client draws its
    private networks (`config.PRIVATE_NETWORKS`) from its own seed.
    """
    seed = tf.constant(self.config.seed, tf.int64)
    if (client_seed is not None and self.config.client_init == 'private' and
        name in PRIVATE_NETWORKS):
      seed = tf.cast(client_seed, tf.int64)
    return model_weights.sample_initial(self.model(name), seed)


# ---------------------------------------------------------------------------
# Optimizers.


@graph_code.plain
def classification_optimizer(config: FedCGConfig):
  """The client optimizer of E and C: Adam (published code) or plain SGD
  (what `tff.learning`'s FedAvg runs, used by the oracle tests)."""
  if config.client_optimizer == 'sgd':
    return tff.learning.optimizers.build_sgdm(config.lr)
  return tff.learning.optimizers.build_adam(config.lr, config.beta1,
                                            config.beta2, config.adam_epsilon)


@graph_code.plain
def gan_optimizer(config: FedCGConfig):
  return tff.learning.optimizers.build_adam(
      config.lr, config.gan_beta1, config.gan_beta2, config.adam_epsilon)


@graph_code.plain
def server_optimizer(config: FedCGConfig):
  """Adam of the server's training steps (distillation, FedGen's generator)."""
  return tff.learning.optimizers.build_adam(config.lr, config.beta1,
                                            config.beta2, config.adam_epsilon)


def initial_classification_state(config: FedCGConfig, nets) -> Any:
  """The client optimizer's initial state over E's and C's weights
  (`nets`: networks with `model(name)`, as `InitialNetworks`)."""
  return initial_optimizer_state(
      classification_optimizer(config),
      nets.model('extractor').trainable_weights +
      nets.model('classifier').trainable_weights)


def mean_over_steps(total, steps):
  """A loop's summed loss over its steps (0 for a loop of no step)."""
  return total / tf.maximum(tf.cast(steps, tf.float32), 1.0)


def initial_optimizer_state(optimizer, variables):
  """`optimizer.initialize` for `variables`, with every leaf a tensor (so the
  state keeps one structure and dtype as an AutoGraph loop variable)."""
  specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in variables)
  return tf.nest.map_structure(tf.convert_to_tensor, optimizer.initialize(specs))


@graph_code.plain
def apply_gradients(optimizer, state, variables, gradients, weight_decay=0.0):
  """One functional optimizer step on `variables`; returns the new state.

  `weight_decay` is added to the gradient as L2 (`g + wd * w`), which is what
  PyTorch's `Adam(weight_decay=...)` in the published code does.
  """
  weights = tuple(tf.identity(v) for v in variables)
  if weight_decay:
    gradients = tuple(g + weight_decay * w for g, w in zip(gradients, weights))
  state, new_weights = optimizer.next(state, weights, tuple(gradients))
  for v, w in zip(variables, new_weights):
    v.assign(w)
  return state


class FunctionalSteps:
  """Optimizer steps inside a training loop, the loop carrying the whole
  optimizer state: `carry = begin(state)`, `carry = step(carry, grads)` per
  batch, `state = end(carry)`."""

  def __init__(self, optimizer, variables, weight_decay=0.0):
    self.optimizer = optimizer
    self.variables = variables
    self.weight_decay = weight_decay

  @graph_code.plain
  def begin(self, state):
    return state

  @graph_code.plain
  def step(self, carry, gradients):
    return apply_gradients(self.optimizer, carry, self.variables, gradients,
                           self.weight_decay)

  @graph_code.plain
  def end(self, carry):
    return carry


class FusedAdamSteps:
  """The same steps for `tff.learning.optimizers`' Adam with TF's fused
  kernel (`ResourceApplyAdam`), which computes Adam's update with the same
  float32 operations in the same order, so the same numbers bit for bit
  (tests/training_tf_test.py) — in one pass over each weight instead of a
  dozen whole-tensor ops (binaries/benchmark.py: stage 2 of 4 FMNIST
  clients, summed, 35.8 s -> 33.9 s a round).

  The kernel updates variables, so during the loop the moments live in
  `PartyNetworks.adam_moments` variables and the loop carries only the step
  count; `begin` loads them from the optimizer state and `end` reads them
  back into one.
  """

  def __init__(self, moments, variables, weight_decay=0.0):
    self.moments = moments
    self.variables = variables
    self.weight_decay = weight_decay
    self._state = None

  @graph_code.plain
  def begin(self, state):
    self._state = state
    for (m, v), a, p in zip(self.moments, state['accumulator'],
                            state['preconditioner']):
      m.assign(a)
      v.assign(p)
    return state['step']

  @graph_code.plain
  def step(self, step, gradients):
    step = step + 1
    state = self._state
    dtype = self.variables[0].dtype
    cast = lambda x: tf.cast(x, dtype)
    t = cast(step)
    beta_1, beta_2 = cast(state['beta_1']), cast(state['beta_2'])
    beta_1_power = tf.math.pow(beta_1, t)
    beta_2_power = tf.math.pow(beta_2, t)
    # No update may start before every gradient is computed. Otherwise the
    # graph lets an update run while the backward pass still holds a read of
    # its weight (G's deconv2 kernel: its gradient is ready before the
    # product that takes the gradient on to deconv1), and TF then updates a
    # fresh copy of the weight (copy on write): a 2 MB allocation and copy
    # that made that one update 4x slower (results/benchmarks/
    # adam_after_gradients_amd_zen3_avx2_20261205.txt).
    with tf.control_dependencies([g for g in gradients if g is not None]):
      for var, (m, v), g in zip(self.variables, self.moments, gradients):
        if g is None:
          continue
        if self.weight_decay:
          g = g + self.weight_decay * var.read_value()
        tf.raw_ops.ResourceApplyAdam(
            var=var.handle, m=m.handle, v=v.handle, beta1_power=beta_1_power,
            beta2_power=beta_2_power, lr=cast(state['learning_rate']),
            beta1=beta_1, beta2=beta_2, epsilon=cast(state['epsilon']),
            grad=g)
    return step

  @graph_code.plain
  def end(self, step):
    state = type(self._state)(self._state)
    state['step'] = step
    state['accumulator'] = tuple(m.read_value() for m, _ in self.moments)
    state['preconditioner'] = tuple(v.read_value() for _, v in self.moments)
    return state


_ADAM = type(tff.learning.optimizers.build_adam(learning_rate=0.001))


@graph_code.plain
def optimizer_steps(optimizer, nets: PartyNetworks, variables, weight_decay=0.0):
  """FusedAdamSteps for Adam, FunctionalSteps for other optimizers."""
  variables = list(variables)
  if isinstance(optimizer, _ADAM):
    return FusedAdamSteps(nets.adam_moments(variables), variables,
                          weight_decay)
  return FunctionalSteps(optimizer, variables, weight_decay)


# ---------------------------------------------------------------------------
# Timing (binaries/benchmark.py).


class Stamps:
  """Wall-clock stamps (float64 seconds since the epoch) between the phases
  of a traced update, when `enabled`: `with tf.control_dependencies(
  stamps.after(outputs)):` stamps once `outputs` exist and builds the next
  phase after the stamp, so the stamps bracket the phases; the values
  computed are the same either way. Disabled, it adds nothing."""

  def __init__(self, enabled: bool):
    self.enabled = enabled
    self.values = []

  @graph_code.plain
  def after(self, outputs) -> list:
    if not self.enabled:
      return []
    with tf.control_dependencies(tf.nest.flatten(outputs)):
      self.values.append(tf.timestamp())
    return self.values[-1:]


# ---------------------------------------------------------------------------
# Noise, losses.

# Streams of `noise`: each use of random numbers gets its own.
NOISE_STREAM_CLS = 1  # FedCG stage 1: z for G(z, y).
NOISE_STREAM_GAN = 2  # FedCG stage 2.
NOISE_STREAM_GENERATED = 3  # FedGen client: (z, y) for CE(C(G(z, y)), y).
# FedGen's server under replay_draws, where it and the clients share one key
# (otherwise it draws from NOISE_STREAM_GENERATED with the run's seed).
NOISE_STREAM_FEDGEN_SERVER = 4


@graph_code.plain
def draw_key(config, seed, round_num):
  """The (seed, round) that key a party's random draws in a round: its own
  seed and the round, or under `config.replay_draws` the run's seed and
  round 0 for every party and round (the published code's reseeding; see
  FedCGConfig.replay_draws)."""
  if config.replay_draws:
    return tf.constant(config.seed, tf.int64), tf.constant(0, tf.int64)
  return seed, round_num


def server_draw_key(config, round_num):
  """`draw_key` of the server, whose seed is the run's."""
  return draw_key(config, tf.constant(config.seed, tf.int64), round_num)


@graph_code.plain
def noise(seed, stream, round_num, step, shape):
  """Stateless N(0, 1) noise keyed by (client seed, stream, round, step)."""
  return tf.random.stateless_normal(
      shape, tf.stack([tf.cast(seed, tf.int64),
                       _stream_key(stream, round_num, step)]))


@graph_code.plain
def uniform_labels(seed, stream, round_num, step, size, num_classes):
  """Stateless uniform class labels keyed like `noise` (a disjoint key)."""
  key = _stream_key(stream, round_num, step) + (1 << 62)
  return tf.random.stateless_uniform(
      [size], tf.stack([tf.cast(seed, tf.int64), key]), minval=0,
      maxval=num_classes, dtype=tf.int32)


def _stream_key(stream, round_num, step):
  return (tf.cast(stream, tf.int64) * (1 << 40) +
          tf.cast(round_num, tf.int64) * (1 << 24) + tf.cast(step, tf.int64))


_xent = tf.keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction=tf.keras.losses.Reduction.SUM_OVER_BATCH_SIZE)


@graph_code.plain
def cross_entropy(labels, logits):
  """Mean softmax cross-entropy of integer labels."""
  return _xent(labels, logits)


@graph_code.plain
def kl_divergence(teacher_logits, student_logits):
  """KL(softmax(teacher) || softmax(student)), mean over the batch.

  From logits by log-softmax, not `tf.keras.losses.KLDivergence`: that
  takes probabilities and clips them at 1e-7, which changes the values
  (and the gradient) for confident teachers."""
  p = tf.nn.softmax(teacher_logits)
  return tf.reduce_mean(tf.reduce_sum(
      p * (tf.nn.log_softmax(teacher_logits) -
           tf.nn.log_softmax(student_logits)), axis=-1))


# ---------------------------------------------------------------------------
# Client-side loops.

# ITERATE_NOTE: the loops below iterate `iter(dataset)`, not `dataset`.
# AutoGraph turns `for x in dataset` into a `dataset.reduce`, whose body runs
# in tf.data's function runtime: a training step there took ~12 ms on 2 CPU
# cores against ~1.7 ms in the `tf.while_loop` that `for x in iter(dataset)`
# becomes (benchmarks/step_loop_benchmark.py).

# `extra_loss(features, labels, step) -> scalar`: a term added to the
# classification loss of `train_classifier`, with `step` the step count.
ExtraLoss = Callable[[tf.Tensor, tf.Tensor, tf.Tensor], tf.Tensor]

# Examples per call of a FrozenNetworkLoss's network (and at most this many
# bytes of a chunk's input images, so that 224x224 inputs stay at a batch a
# call). Read when the loop is traced; below two batches the network runs
# once a step.
FROZEN_CHUNK_EXAMPLES = 512
FROZEN_CHUNK_BYTES = 8 << 20


@attrs.define(frozen=True)
class FrozenNetworkLoss:
  """A term of `train_classifier`'s loss that runs a frozen network on
  per-step draws: FedCG's G(z, y) target in stage 1, FedGen's G(z, y) fed
  to C. The network runs once for a chunk of steps (FROZEN_CHUNK_EXAMPLES
  examples), not once a step.

  Why: at batch 8 G's products are too small to run well. On the Zen 3
  host (2026-12-05, benchmarks/stage_epoch_benchmark.py) one client's
  FedCG stage-1 epoch took 1.55 s with G once a step on 8 examples, 0.88 s
  with G on 512 a call, 0.95 s on the whole epoch's 2000 at once. The
  network is in inference mode, so an example's output does not depend on
  the others in its call: each step sees the numbers it saw before, up to
  float rounding (products are blocked differently).

  `draws(labels, step)`: a step's per-example draws (a tensor or a tuple of
  them, first dimension the step's batch), keyed by the step as before.
  `network(draws, labels)`: the frozen network on a chunk's draws and labels.
  `loss(features, labels, draws, outputs)`: the term for one step.
  """
  draws: Callable
  network: Callable
  loss: Callable


def batches_per_chunk(dataset, batch_size: int) -> int:
  """Batches of `dataset` a FrozenNetworkLoss chunk holds; 1 (the network
  then runs in each step, as a plain ExtraLoss) when chunks would not hold
  more, or when the batches are not `[None, known image shape]` (a fixed
  batch size or an unknown image size: `ragged_batch` would not give one
  flat tensor of a chunk's images)."""
  shape = dataset.element_spec[0].shape
  if (shape.rank is None or shape.rank < 2 or shape[0] is not None or
      not shape[1:].is_fully_defined()):
    return 1
  example_bytes = dataset.element_spec[0].dtype.size * shape[1:].num_elements()
  examples = min(FROZEN_CHUNK_EXAMPLES, FROZEN_CHUNK_BYTES // example_bytes)
  return max(1, examples // batch_size)


def _per_step(frozen: FrozenNetworkLoss) -> ExtraLoss:
  """`frozen` as a plain ExtraLoss: its network runs in each step."""
  def extra_loss(features, labels, step):
    draws = frozen.draws(labels, step)
    outputs = tf.stop_gradient(frozen.network(draws, labels))
    return frozen.loss(features, labels, draws, outputs)
  return extra_loss


def _chunk_draws(draws, labels, splits, first_step):
  """`draws` of each step of a chunk (step j's labels are
  labels[splits[j]:splits[j + 1]]), concatenated along the examples."""
  steps = tf.size(splits) - 1
  first = draws(labels[splits[0]:splits[1]], first_step)
  arrays = tf.nest.map_structure(
      lambda t: tf.TensorArray(
          t.dtype, size=steps, infer_shape=False,
          element_shape=tf.TensorShape([None]).concatenate(t.shape[1:])).write(
              0, t), first)
  for j in tf.range(1, steps):
    step_draws = draws(labels[splits[j]:splits[j + 1]], first_step + j)
    arrays = tf.nest.map_structure(lambda a, t: a.write(j, t), arrays,
                                   step_draws)
  return tf.nest.map_structure(lambda a: a.concat(), arrays)


def train_classifier(nets: PartyNetworks, optimizer_state, dataset, epochs: int,
                     extra_loss: Optional[ExtraLoss | FrozenNetworkLoss] = None,
                     extra_weight=1.0):
  """`epochs` passes of `CE(C(E(x)), y) + extra_weight * extra_loss` over E, C.

  The one supervised loop of every algorithm: FedCG adds its feature
  distance, FedProx its proximal term, FedGen the CE on generated features.
  A FrozenNetworkLoss is taken a chunk of the epoch at a time (same
  batches, same order: the dataset is iterated once per epoch either way),
  or in each step where `batches_per_chunk` gives 1.
  Returns the new optimizer state and the mean CE and extra loss.
  Call from inside a `tf.function` (the loops are AutoGraph loops).
  """
  config = nets.config
  variables = (nets.extractor.trainable_variables +
               nets.classifier.trainable_variables)
  optimizer = optimizer_steps(classification_optimizer(config), nets,
                              variables, config.weight_decay)

  def train_step(carry, x, y, extra_fn):
    with tf.GradientTape() as tape:
      features = nets.extractor(x, training=True)
      cls_loss = cross_entropy(y, nets.classifier(features, training=True))
      extra = tf.constant(0.0) if extra_fn is None else extra_fn(features, y)
      loss = cls_loss + extra_weight * extra
    carry = optimizer.step(carry, tape.gradient(loss, variables))
    return carry, cls_loss, extra

  carry = optimizer.begin(optimizer_state)
  cls_sum = tf.constant(0.0)
  extra_sum = tf.constant(0.0)
  steps = tf.constant(0, tf.int32)
  chunk_batches = 1
  if isinstance(extra_loss, FrozenNetworkLoss):
    chunk_batches = batches_per_chunk(dataset, config.batch_size)
    if chunk_batches == 1:
      extra_loss = _per_step(extra_loss)
  if chunk_batches > 1:
    chunks = dataset.ragged_batch(chunk_batches)
    for _ in tf.range(epochs):
      for x_chunk, y_chunk in iter(chunks):  # See ITERATE_NOTE.
        splits = tf.cast(y_chunk.row_splits, tf.int32)
        x_all, y_all = x_chunk.values, tf.cast(y_chunk.values, tf.int32)
        draws = _chunk_draws(extra_loss.draws, y_all, splits, steps)
        outputs = extra_loss.network(draws, y_all)
        for j in tf.range(tf.size(splits) - 1):
          lo, hi = splits[j], splits[j + 1]
          step_draws = tf.nest.map_structure(lambda t: t[lo:hi], draws)
          step_outputs = outputs[lo:hi]
          carry, cls_loss, extra = train_step(
              carry, x_all[lo:hi], y_all[lo:hi],
              lambda features, y: extra_loss.loss(features, y, step_draws,
                                                  step_outputs))
          cls_sum += cls_loss
          extra_sum += extra
          steps += 1
  else:
    for _ in tf.range(epochs):
      for x, y in iter(dataset):  # See ITERATE_NOTE.
        carry, cls_loss, extra = train_step(
            carry, x, tf.cast(y, tf.int32),
            None if extra_loss is None else
            lambda features, y: extra_loss(features, y, steps))
        cls_sum += cls_loss
        extra_sum += extra
        steps += 1
  return (optimizer.end(carry), mean_over_steps(cls_sum, steps),
          mean_over_steps(extra_sum, steps))


# PASS_ORDER_NOTE: every pass over a client dataset must be ordered after the
# previous one. Training datasets re-randomise their order, flips and noise
# on each pass (each new iterator), so which pass is which must not depend
# on scheduling. Passes inside one loop are ordered, and loops that touch the
# same variables are ordered by tf.function's automatic control
# dependencies; but `count_examples` touches no variable, so its pass could
# race the first training pass: callers put the training under
# `tf.control_dependencies([num_examples])`. Without that, runs with the
# same seed gave different results from one process to the next.


def count_examples(dataset):
  """n_i, the client's weight: examples in one pass over `dataset`.

  Later passes must depend on the result: see PASS_ORDER_NOTE."""
  count = tf.constant(0, tf.int32)
  for _, y in iter(dataset):  # See ITERATE_NOTE.
    count += tf.shape(y)[0]
  return count


@tf.function
def evaluate_classifier(nets: PartyNetworks, extractor, classifier, val_data,
                        test_data):
  """Accuracy of E followed by C on the validation and the test data."""
  model_weights.assign(nets.extractor, extractor)
  model_weights.assign(nets.classifier, classifier)

  def accuracy(dataset):
    correct = tf.constant(0, tf.int64)
    total = tf.constant(0, tf.int64)
    for x, y in iter(dataset):  # See ITERATE_NOTE.
      logits = nets.classifier(nets.extractor(x, training=False),
                               training=False)
      pred = tf.argmax(logits, axis=-1, output_type=tf.int64)
      correct += tf.reduce_sum(
          tf.cast(tf.equal(pred, tf.cast(y, tf.int64)), tf.int64))
      total += tf.cast(tf.shape(y)[0], tf.int64)
    return tf.cast(correct, tf.float32) / tf.maximum(
        tf.cast(total, tf.float32), 1.0)

  return EvalMetrics(val_accuracy=accuracy(val_data),
                     test_accuracy=accuracy(test_data))


# ---------------------------------------------------------------------------
# Server-side pieces.


def chunked_logits(logits_fn, inputs, num_classes: int, chunk: int = 2000):
  """`logits_fn(*inputs)` over the leading axis in chunks (bounded memory).

  `inputs` is a tuple of tensors with the same leading size.
  """
  count = tf.shape(inputs[0])[0]
  num_chunks = (count + chunk - 1) // chunk
  out = tf.TensorArray(tf.float32, size=num_chunks, infer_shape=False,
                       element_shape=tf.TensorShape([None, num_classes]))
  for i in tf.range(num_chunks):
    start = i * chunk
    out = out.write(i, logits_fn(*(t[start:start + chunk] for t in inputs)))
  logits = out.concat()
  logits.set_shape(inputs[0].shape[:1].concatenate([num_classes]))
  return logits


def distill(nets: PartyNetworks, optimizer_state, variables, student_fn, inputs,
            teacher_logits):
  """KL distillation of fixed teacher logits into a student, in order.

  Step i takes rows `[i * batch_size, (i + 1) * batch_size)` of every tensor
  of `inputs` and of `teacher_logits`; the student's logits are
  `student_fn(*rows)` and `variables` (the student's) take one server-Adam
  step on `KL(teacher || student)`. FedCG's student is C_g(G_g(z, y)),
  FedDF's C_g(E_g(x)). Returns the new optimizer state and per-step KLs.
  """
  optimizer = optimizer_steps(server_optimizer(nets.config), nets, variables)
  carry = optimizer.begin(optimizer_state)
  bs = nets.config.batch_size
  steps = tf.shape(teacher_logits)[0] // bs
  kls = tf.TensorArray(tf.float32, size=steps)
  for i in tf.range(steps):
    rows = tuple(t[i * bs:(i + 1) * bs] for t in inputs)
    teacher = teacher_logits[i * bs:(i + 1) * bs]
    with tf.GradientTape() as tape:
      kl = kl_divergence(teacher, student_fn(*rows))
    carry = optimizer.step(carry, tape.gradient(kl, variables))
    kls = kls.write(i, kl)
  return optimizer.end(carry), kls.stack()


@graph_code.plain
def loss_summary(values):
  """(mean, first, last) of a vector of per-step losses; zeros if empty."""
  has_steps = tf.size(values) > 0
  pick = lambda i: tf.cond(has_steps, lambda: values[i], lambda: 0.0)
  mean = tf.cond(has_steps, lambda: tf.reduce_mean(values), lambda: 0.0)
  return mean, pick(0), pick(-1)


@graph_code.plain
def normalized_weights(weights):
  """w_i / sum(w): the ensemble weights of the collected clients."""
  weights = tf.cast(weights, tf.float32)
  return weights / tf.maximum(tf.reduce_sum(weights), 1e-12)


@graph_code.plain
def member(stacked, i):
  """Client i's entry of a structure collected with leading client axis."""
  return tf.nest.map_structure(lambda t: t[i], stacked)
