"""FedCG's model math and training loops in plain TensorFlow.

Nothing here knows about TFF: every function takes Keras models and tensors
and can be run eagerly in a test. `fedcg_tff.py` places and wires them.

Networks travel as tuples of tensors (`networks.weight_values`); each
function assigns the incoming values to its Keras models, trains, and reads
the results back, all inside one `tf.function` so that the assignments,
the batch-norm updates and the reads are ordered by automatic control
dependencies even inside the graph-mode context of a TFF computation.

Optimizers are `tff.learning.optimizers` Adam: functional, with a state that
is a plain structure of tensors, which is what lets the three client optimizer
states persist in the CLIENTS-placed client state across rounds.
"""

from typing import Any

import attrs
import tensorflow as tf
from tensorflow_federated.python.learning.optimizers import adam

from fedcg_tff import networks
from fedcg_tff.config import FedCGConfig

# ---------------------------------------------------------------------------
# State and message structures.


@attrs.define(frozen=True)
class ServerState:
  generator: Any  # G_g weights.
  classifier: Any  # C_g weights.
  optimizer_state: Any  # Adam state over the trainable weights of G_g, C_g.
  aggregator_state: Any  # State of the tff.aggregators process.
  round_num: Any  # int32 scalar: the round about to run (0-based).


@attrs.define(frozen=True)
class ClientState:
  """What a client keeps between rounds; it never leaves the client."""
  extractor: Any  # E_i: private.
  classifier: Any  # C_i after the last local update (personalised model).
  discriminator: Any  # D_i.
  classification_optimizer: Any  # Adam over E_i and C_i.
  discriminator_optimizer: Any  # Adam over D_i.
  generator_optimizer: Any  # Adam over G (G itself is replaced each round).
  seed: Any  # int64 scalar seeding the client's noise draws.


@attrs.define(frozen=True)
class ServerMessage:
  generator: Any
  classifier: Any
  round_num: Any
  distill_noise: Any  # [distill_samples, noise_dim]
  distill_labels: Any  # [distill_samples] int32


@attrs.define(frozen=True)
class ClientUpload:
  """The values a client shares: G_i, C_i and its teacher logits."""
  generator: Any
  classifier: Any
  teacher_logits: Any  # C_i(G_i(z, y)) on the broadcast distillation inputs.


@attrs.define(frozen=True)
class ClientMetrics:
  num_examples: Any
  gamma: Any  # The weight of L_dist this client used this round.
  cls_loss: Any
  dist_loss: Any
  d_loss: Any
  g_loss: Any


@attrs.define(frozen=True)
class ClientOutput:
  state: ClientState
  upload: ClientUpload
  weight: Any  # n_i, float32.
  metrics: ClientMetrics


@attrs.define(frozen=True)
class ServerMetrics:
  distill_kl: Any  # Mean KL over the distillation steps.
  distill_kl_first: Any
  distill_kl_last: Any


@attrs.define(frozen=True)
class EvalMetrics:
  val_accuracy: Any
  test_accuracy: Any


# ---------------------------------------------------------------------------
# Networks and optimizers.


class Networks:
  """The four Keras networks of one party, built once per graph."""

  def __init__(self, config: FedCGConfig):
    self.config = config
    self.extractor = networks.build_extractor(config.image_channels)
    self.classifier = networks.build_classifier(config.num_classes)
    self.generator = networks.build_generator(config.num_classes,
                                              config.noise_dim)
    self.discriminator = networks.build_discriminator(config.num_classes)


def classification_optimizer(config: FedCGConfig):
  return adam.build_adam(config.lr, config.beta1, config.beta2,
                         config.adam_epsilon)


def gan_optimizer(config: FedCGConfig):
  return adam.build_adam(config.lr, config.gan_beta1, config.gan_beta2,
                         config.adam_epsilon)


def distillation_optimizer(config: FedCGConfig):
  return adam.build_adam(config.lr, config.beta1, config.beta2,
                         config.adam_epsilon)


def _initial_optimizer_state(optimizer, variables):
  """`optimizer.initialize` for `variables`, with every leaf a tensor (so the
  state keeps one structure and dtype as an AutoGraph loop variable)."""
  specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in variables)
  return tf.nest.map_structure(tf.convert_to_tensor, optimizer.initialize(specs))


def _apply(optimizer, state, variables, gradients, weight_decay=0.0):
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


def initial_server_state(config: FedCGConfig, aggregator_state) -> ServerState:
  """G_g and C_g drawn from `config.seed`, a fresh server optimizer, round 0."""
  nets = Networks(config)
  seed = tf.constant(config.seed, tf.int64)
  trainable = (nets.generator.trainable_weights +
               nets.classifier.trainable_weights)
  return ServerState(
      generator=networks.sample_initial_weights(nets.generator, seed),
      classifier=networks.sample_initial_weights(nets.classifier, seed),
      optimizer_state=_initial_optimizer_state(
          distillation_optimizer(config), trainable),
      aggregator_state=aggregator_state,
      round_num=tf.constant(0, tf.int32),
  )


def initial_client_state(config: FedCGConfig, seed) -> ClientState:
  """A client's E, C, D and optimizer states, drawn from `seed` (int64)."""
  nets = Networks(config)
  seed = tf.cast(seed, tf.int64)
  ec = nets.extractor.trainable_weights + nets.classifier.trainable_weights
  return ClientState(
      extractor=networks.sample_initial_weights(nets.extractor, seed),
      classifier=networks.sample_initial_weights(nets.classifier, seed),
      discriminator=networks.sample_initial_weights(nets.discriminator, seed),
      classification_optimizer=_initial_optimizer_state(
          classification_optimizer(config), ec),
      discriminator_optimizer=_initial_optimizer_state(
          gan_optimizer(config), nets.discriminator.trainable_weights),
      generator_optimizer=_initial_optimizer_state(
          gan_optimizer(config), nets.generator.trainable_weights),
      seed=seed,
  )


# ---------------------------------------------------------------------------
# Client update.


def gamma_ramp(round_num, ramp_rounds: int = 50):
  """gamma = 2 / (1 + exp(-10 p)) - 1 with p = min(round / ramp_rounds, 1)."""
  p = tf.minimum(tf.cast(round_num, tf.float32) / float(ramp_rounds), 1.0)
  return 2.0 / (1.0 + tf.exp(-10.0 * p)) - 1.0


def feature_distance(kind: str, features, targets):
  """L_dist between extractor features and generated features."""
  if kind == 'mse':
    return tf.reduce_mean(tf.square(features - targets))
  if kind == 'cos':
    batch = tf.shape(features)[0]
    a = tf.math.l2_normalize(tf.reshape(features, [batch, -1]), axis=1)
    b = tf.math.l2_normalize(tf.reshape(targets, [batch, -1]), axis=1)
    return 1.0 - tf.reduce_mean(tf.reduce_sum(a * b, axis=1))
  if kind == 'none':
    return tf.constant(0.0)
  raise ValueError(f'Unknown distance {kind!r}')


def _noise(seed, stream, round_num, step, shape):
  """Stateless N(0, 1) noise keyed by (client seed, stream, round, step)."""
  key = (tf.cast(stream, tf.int64) * (1 << 40) +
         tf.cast(round_num, tf.int64) * (1 << 24) + tf.cast(step, tf.int64))
  return tf.random.stateless_normal(
      shape, tf.stack([tf.cast(seed, tf.int64), key]))


# _ITERATE_NOTE: the loops below iterate `iter(dataset)`, not `dataset`.
# AutoGraph turns `for x in dataset` into a `dataset.reduce`, whose body runs
# in tf.data's function runtime: a training step there took ~12 ms on 2 CPU
# cores against ~1.7 ms in the `tf.while_loop` that `for x in iter(dataset)`
# becomes (benchmarks/step_loop_benchmark.py).

_NOISE_STREAM_CLS = 1
_NOISE_STREAM_GAN = 2

_xent = tf.keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction=tf.keras.losses.Reduction.SUM_OVER_BATCH_SIZE)
_bce = tf.keras.losses.BinaryCrossentropy(
    from_logits=True, reduction=tf.keras.losses.Reduction.SUM_OVER_BATCH_SIZE)


def train_classification(nets: Networks, optimizer_state, dataset, gamma,
                         seed, round_num):
  """Stage 1: `local_epochs` passes of L_cls + gamma * L_dist over E and C.

  G is frozen (inference mode, output a constant). Returns the new optimizer
  state and the mean L_cls and L_dist.
  Call from inside a `tf.function` (the loops are AutoGraph loops).
  """
  config = nets.config
  optimizer = classification_optimizer(config)
  variables = (nets.extractor.trainable_variables +
               nets.classifier.trainable_variables)
  cls_sum = tf.constant(0.0)
  dist_sum = tf.constant(0.0)
  steps = tf.constant(0, tf.int32)
  for _ in tf.range(config.local_epochs):
    for x, y in iter(dataset):  # See _ITERATE_NOTE.
      y = tf.cast(y, tf.int32)
      batch = tf.shape(y)[0]
      with tf.GradientTape() as tape:
        features = nets.extractor(x, training=True)
        logits = nets.classifier(features, training=True)
        cls_loss = _xent(y, logits)
        if config.distance == 'none':
          dist_loss = tf.constant(0.0)
        else:
          z = _noise(seed, _NOISE_STREAM_CLS, round_num, steps,
                     [batch, config.noise_dim])
          targets = tf.stop_gradient(nets.generator([z, y], training=False))
          dist_loss = feature_distance(config.distance, features, targets)
        loss = cls_loss + gamma * dist_loss
      grads = tape.gradient(loss, variables)
      optimizer_state = _apply(optimizer, optimizer_state, variables, grads,
                               config.weight_decay)
      cls_sum += cls_loss
      dist_sum += dist_loss
      steps += 1
  mean = lambda s: s / tf.maximum(tf.cast(steps, tf.float32), 1.0)
  return optimizer_state, mean(cls_sum), mean(dist_sum)


def train_gan(nets: Networks, d_optimizer_state, g_optimizer_state, dataset,
              seed, round_num):
  """Stage 2: `gan_epochs` passes of alternating D and G steps (BCE).

  E is frozen; D sees E(x) as real and G(z, y) (detached) as fake, then G is
  trained to make the updated D call its output real. Returns both optimizer
  states and the mean D and G losses. Call from inside a `tf.function`.
  """
  config = nets.config
  optimizer = gan_optimizer(config)
  d_vars = nets.discriminator.trainable_variables
  g_vars = nets.generator.trainable_variables
  d_sum = tf.constant(0.0)
  g_sum = tf.constant(0.0)
  steps = tf.constant(0, tf.int32)
  for _ in tf.range(config.gan_epochs):
    for x, y in iter(dataset):  # See _ITERATE_NOTE.
      y = tf.cast(y, tf.int32)
      batch = tf.shape(y)[0]
      real = nets.extractor(x, training=False)
      z = _noise(seed, _NOISE_STREAM_GAN, round_num, steps,
                 [batch, config.noise_dim])
      with tf.GradientTape() as g_tape:
        fake = nets.generator([z, y], training=True)
      with tf.GradientTape() as d_tape:
        d_real = nets.discriminator([real, y], training=True)
        d_fake = nets.discriminator([tf.stop_gradient(fake), y], training=True)
        d_loss = (_bce(tf.ones_like(d_real), d_real) +
                  _bce(tf.zeros_like(d_fake), d_fake))
      d_optimizer_state = _apply(optimizer, d_optimizer_state, d_vars,
                                 d_tape.gradient(d_loss, d_vars))
      with g_tape:
        d_on_fake = nets.discriminator([fake, y], training=True)
        g_loss = _bce(tf.ones_like(d_on_fake), d_on_fake)
      g_optimizer_state = _apply(optimizer, g_optimizer_state, g_vars,
                                 g_tape.gradient(g_loss, g_vars))
      d_sum += d_loss
      g_sum += g_loss
      steps += 1
  mean = lambda s: s / tf.maximum(tf.cast(steps, tf.float32), 1.0)
  return d_optimizer_state, g_optimizer_state, mean(d_sum), mean(g_sum)


def count_examples(dataset):
  """n_i, the client's weight: examples in one pass over `dataset`."""
  count = tf.constant(0, tf.int32)
  for _, y in iter(dataset):  # See _ITERATE_NOTE.
    count += tf.shape(y)[0]
  return count


def ensemble_logits(generator, classifier, noise, labels, chunk: int = 2000):
  """C(G(z, y)) in inference mode, computed in chunks to bound memory."""
  count = tf.shape(labels)[0]
  num_chunks = (count + chunk - 1) // chunk
  num_classes = classifier.output_shape[-1]
  out = tf.TensorArray(tf.float32, size=num_chunks, infer_shape=False,
                       element_shape=tf.TensorShape([None, num_classes]))
  for i in tf.range(num_chunks):
    start = i * chunk
    z = noise[start:start + chunk]
    y = labels[start:start + chunk]
    out = out.write(i, classifier(generator([z, y], training=False),
                                  training=False))
  logits = out.concat()
  logits.set_shape(labels.shape.concatenate([num_classes]))
  return logits


@tf.function
def client_update(nets: Networks, message: ServerMessage, state: ClientState,
                  dataset) -> ClientOutput:
  """One FedCG client round: load G_g/C_g, stage 1, stage 2, teacher logits."""
  config = nets.config
  networks.assign_weights(nets.generator, message.generator)
  networks.assign_weights(nets.classifier, message.classifier)
  networks.assign_weights(nets.extractor, state.extractor)
  networks.assign_weights(nets.discriminator, state.discriminator)
  gamma = gamma_ramp(message.round_num, config.gamma_ramp_rounds)

  num_examples = count_examples(dataset)
  cls_opt, cls_loss, dist_loss = train_classification(
      nets, state.classification_optimizer, dataset, gamma, state.seed,
      message.round_num)
  d_opt, g_opt, d_loss, g_loss = train_gan(
      nets, state.discriminator_optimizer, state.generator_optimizer, dataset,
      state.seed, message.round_num)
  teacher = ensemble_logits(nets.generator, nets.classifier,
                            message.distill_noise, message.distill_labels)

  classifier = networks.weight_values(nets.classifier)
  new_state = ClientState(
      extractor=networks.weight_values(nets.extractor),
      classifier=classifier,
      discriminator=networks.weight_values(nets.discriminator),
      classification_optimizer=cls_opt,
      discriminator_optimizer=d_opt,
      generator_optimizer=g_opt,
      seed=state.seed,
  )
  upload = ClientUpload(
      generator=networks.weight_values(nets.generator),
      classifier=classifier,
      teacher_logits=teacher,
  )
  metrics = ClientMetrics(num_examples=num_examples, gamma=gamma,
                          cls_loss=cls_loss,
                          dist_loss=dist_loss, d_loss=d_loss, g_loss=g_loss)
  return ClientOutput(state=new_state, upload=upload,
                      weight=tf.cast(num_examples, tf.float32),
                      metrics=metrics)


@tf.function
def evaluate_client(nets: Networks, state: ClientState, val_data, test_data):
  """Accuracy of E_i followed by the client's C_i on its val and test data."""
  networks.assign_weights(nets.extractor, state.extractor)
  networks.assign_weights(nets.classifier, state.classifier)

  def accuracy(dataset):
    correct = tf.constant(0, tf.int64)
    total = tf.constant(0, tf.int64)
    for x, y in iter(dataset):  # See _ITERATE_NOTE.
      logits = nets.classifier(nets.extractor(x, training=False),
                               training=False)
      pred = tf.argmax(logits, axis=-1, output_type=tf.int64)
      correct += tf.reduce_sum(tf.cast(tf.equal(pred, tf.cast(y, tf.int64)), tf.int64))
      total += tf.cast(tf.shape(y)[0], tf.int64)
    return tf.cast(correct, tf.float32) / tf.maximum(
        tf.cast(total, tf.float32), 1.0)

  return EvalMetrics(val_accuracy=accuracy(val_data),
                     test_accuracy=accuracy(test_data))


# ---------------------------------------------------------------------------
# Server update.


def distillation_inputs(config: FedCGConfig, round_num):
  """The server's (z, y) for one round's distillation, keyed by round."""
  seed = tf.stack([tf.constant(config.seed, tf.int64),
                   tf.cast(round_num, tf.int64)])
  noise = tf.random.stateless_normal(
      [config.distill_samples, config.noise_dim], seed)
  labels = tf.random.stateless_uniform(
      [config.distill_samples], seed + [0, 1 << 32], minval=0,
      maxval=config.num_classes, dtype=tf.int32)
  return noise, labels


def kl_divergence(teacher_logits, student_logits):
  """KL(softmax(teacher) || softmax(student)), mean over the batch."""
  p = tf.nn.softmax(teacher_logits)
  return tf.reduce_mean(tf.reduce_sum(
      p * (tf.nn.log_softmax(teacher_logits) -
           tf.nn.log_softmax(student_logits)), axis=-1))


def distill(nets: Networks, optimizer_state, noise, labels, teacher_logits):
  """KL distillation of the teacher logits into (G, C) = (nets.generator,
  nets.classifier), `batch_size` rows of (z, y, teacher) per step, in order.

  The student runs in training mode (its batch-norm statistics follow the
  distillation batches), while the clients computed the teacher logits with
  their G_i in inference mode (`ensemble_logits`).

  Returns the new optimizer state and the per-step KL values.
  """
  config = nets.config
  optimizer = distillation_optimizer(config)
  variables = (nets.generator.trainable_variables +
               nets.classifier.trainable_variables)
  bs = config.batch_size
  steps = tf.shape(labels)[0] // bs
  kls = tf.TensorArray(tf.float32, size=steps)
  for i in tf.range(steps):
    z = noise[i * bs:(i + 1) * bs]
    y = labels[i * bs:(i + 1) * bs]
    t = teacher_logits[i * bs:(i + 1) * bs]
    with tf.GradientTape() as tape:
      student = nets.classifier(nets.generator([z, y], training=True),
                                training=True)
      kl = kl_divergence(t, student)
    optimizer_state = _apply(optimizer, optimizer_state, variables,
                             tape.gradient(kl, variables))
    kls = kls.write(i, kl)
  return optimizer_state, kls.stack()


@tf.function
def server_update(nets: Networks, state: ServerState, aggregator_state,
                  averaged: ClientUpload, noise, labels):
  """Weighted-average (G, C) from the aggregator, then distil the ensemble."""
  networks.assign_weights(nets.generator, averaged.generator)
  networks.assign_weights(nets.classifier, averaged.classifier)
  optimizer_state, kls = distill(nets, state.optimizer_state, noise, labels,
                                 averaged.teacher_logits)
  new_state = ServerState(
      generator=networks.weight_values(nets.generator),
      classifier=networks.weight_values(nets.classifier),
      optimizer_state=optimizer_state,
      aggregator_state=aggregator_state,
      round_num=state.round_num + 1,
  )
  has_steps = tf.size(kls) > 0
  pick = lambda i: tf.cond(has_steps, lambda: kls[i], lambda: 0.0)
  metrics = ServerMetrics(
      distill_kl=tf.cond(has_steps, lambda: tf.reduce_mean(kls), lambda: 0.0),
      distill_kl_first=pick(0),
      distill_kl_last=pick(-1),
  )
  return new_state, metrics
