"""FedCG's model math and training loops in plain TensorFlow.

Nothing here knows about TFF: every function takes Keras models and tensors
and can be run eagerly in a test. `fedcg_process_tff.py` places and wires
them.

The shared pieces (networks, optimizers, the supervised loop, distillation,
evaluation) live in `training_tf.py`; this module holds what only FedCG does:
its states, the feature distance and gamma ramp, the GAN stage, the teacher
logits on server noise and the data-free server step.
"""

from typing import Any

import attrs
import tensorflow as tf

from fedcg_tff import graph_code
from fedcg_tff.algorithms import training_tf
from fedcg_tff.algorithms.training_tf import PartyNetworks
from fedcg_tff.config import FedCGConfig
from fedcg_tff.models import layers
from fedcg_tff.models import model_weights

# The networks of the server's step and state: the shared G_g and C_g.
SERVER_NETWORKS = ('classifier', 'generator')

# ---------------------------------------------------------------------------
# State and message structures.


@attrs.define(frozen=True)
class ServerState:
  generator: Any  # G_g weights.
  classifier: Any  # C_g weights.
  optimizer_state: Any  # Adam state over the trainable weights of G_g, C_g.
  aggregator_state: Any  # State of the tff.aggregators process.
  round_num: Any  # int32: the round about to run, 0-based (ROUND_NUMBERING).


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
  # With `timed`: wall-clock stamps (float64 seconds since the epoch) at the
  # start, after stage 1, after stage 2 and after the teacher logits, for
  # binaries/benchmark.py; () otherwise.
  times: Any = ()


@attrs.define(frozen=True)
class ServerMetrics:
  distill_kl: Any  # Mean KL over the distillation steps.
  distill_kl_first: Any
  distill_kl_last: Any
  # With `timed`: wall-clock stamps before and after the distillation (for
  # binaries/benchmark.py); () otherwise. Not a scalar metric.
  times: Any = ()


# ---------------------------------------------------------------------------
# Initial states.


def initial_server_state(config: FedCGConfig, aggregator_state) -> ServerState:
  """G_g and C_g drawn from `config.seed`, a fresh server optimizer, round 0
  (`round_num` is 0-based: program.round_loop.ROUND_NUMBERING)."""
  nets = training_tf.InitialNetworks(config, SERVER_NETWORKS)
  trainable = (nets.model('generator').trainable_weights +
               nets.model('classifier').trainable_weights)
  return ServerState(
      generator=nets.initial_weights('generator'),
      classifier=nets.initial_weights('classifier'),
      optimizer_state=training_tf.initial_optimizer_state(
          training_tf.server_optimizer(config), trainable),
      aggregator_state=aggregator_state,
      round_num=tf.constant(0, tf.int32),
  )


def initial_client_state(config: FedCGConfig, seed) -> ClientState:
  """A client's E, C, D and optimizer states; `seed` (int64) is the
  client's private seed (noise, and E and D under `client_init='private'`:
  `InitialNetworks.initial_weights`)."""
  nets = training_tf.InitialNetworks(config)
  seed = tf.cast(seed, tf.int64)
  trainable = lambda name: nets.model(name).trainable_weights
  init = training_tf.initial_optimizer_state
  return ClientState(
      extractor=nets.initial_weights('extractor', seed),
      classifier=nets.initial_weights('classifier', seed),
      discriminator=nets.initial_weights('discriminator', seed),
      classification_optimizer=training_tf.initial_classification_state(
          config, nets),
      discriminator_optimizer=init(
          training_tf.gan_optimizer(config),
          trainable('discriminator')),
      generator_optimizer=init(
          training_tf.gan_optimizer(config), trainable('generator')),
      seed=seed,
  )


# ---------------------------------------------------------------------------
# Client update.


@graph_code.plain
def gamma_ramp(round_num, ramp_rounds: int = 50):
  """gamma = 2 / (1 + exp(-10 p)) - 1 with p = min(round_num / ramp_rounds,
  1), `round_num` the 0-based round index (program.round_loop.ROUND_NUMBERING): 0 in
  the first round."""
  p = tf.minimum(tf.cast(round_num, tf.float32) / float(ramp_rounds), 1.0)
  return 2.0 / (1.0 + tf.exp(-10.0 * p)) - 1.0


@graph_code.plain
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


_bce = tf.keras.losses.BinaryCrossentropy(
    from_logits=True, reduction=tf.keras.losses.Reduction.SUM_OVER_BATCH_SIZE)


def train_classification(nets: PartyNetworks, optimizer_state, dataset, gamma,
                         seed, round_num):
  """Stage 1: `local_epochs` passes of L_cls + gamma * L_dist over E and C.

  G is frozen (inference mode, output a constant). Returns the new optimizer
  state and the mean L_cls and L_dist.
  Call from inside a `tf.function` (the loops are AutoGraph loops).
  """
  config = nets.config
  dist_loss = training_tf.FrozenNetworkLoss(
      draws=lambda labels, step: training_tf.noise(
          seed, training_tf.NOISE_STREAM_CLS, round_num, step,
          [tf.shape(labels)[0], config.noise_dim]),
      network=lambda z, labels: nets.generator([z, labels], training=False),
      loss=lambda features, labels, z, targets: feature_distance(
          config.distance, features, targets))
  return training_tf.train_classifier(
      nets, optimizer_state, dataset, config.local_epochs,
      extra_loss=None if config.distance == 'none' else dist_loss,
      extra_weight=gamma)


# Whether D's real and fake passes run as one stacked call
# (`layers.paired_passes`: the same function, one product per convolution
# over both passes); False only to compare the two (tests, benchmarks).
PAIRED_D_PASSES = True


@graph_code.plain
def discriminate(discriminator, real, fake, labels):
  """D(real, y) then D(fake, y), both in training mode, as two passes: the
  per-pass batch-norm statistics, moving averages and spectral-norm power
  iterations of two calls in that order."""
  if not PAIRED_D_PASSES:
    return (discriminator([real, labels], training=True),
            discriminator([fake, labels], training=True))
  with layers.paired_passes():
    both = discriminator([tf.concat([real, fake], 0),
                          tf.concat([labels, labels], 0)], training=True)
  return tf.split(both, 2)


def train_gan(nets: PartyNetworks, d_optimizer_state, g_optimizer_state, dataset,
              seed, round_num):
  """Stage 2: `gan_epochs` passes of alternating D and G steps (BCE).

  E is frozen; D sees E(x) as real and G(z, y) (detached) as fake, then G is
  trained to make the updated D call its output real. Returns both optimizer
  states and the mean D and G losses. Call from inside a `tf.function`.
  """
  config = nets.config
  d_vars = nets.discriminator.trainable_variables
  g_vars = nets.generator.trainable_variables
  d_optimizer = training_tf.optimizer_steps(
      training_tf.gan_optimizer(config), nets, d_vars)
  g_optimizer = training_tf.optimizer_steps(
      training_tf.gan_optimizer(config), nets, g_vars)
  d_carry = d_optimizer.begin(d_optimizer_state)
  g_carry = g_optimizer.begin(g_optimizer_state)
  d_sum = tf.constant(0.0)
  g_sum = tf.constant(0.0)
  steps = tf.constant(0, tf.int32)
  for _ in tf.range(config.gan_epochs):
    for x, y in iter(dataset):  # See training_tf.ITERATE_NOTE.
      y = tf.cast(y, tf.int32)
      batch = tf.shape(y)[0]
      real = nets.extractor(x, training=False)
      z = training_tf.noise(seed, training_tf.NOISE_STREAM_GAN, round_num,
                            steps, [batch, config.noise_dim])
      # The original runs G twice here, for D's step and for G's (same z,
      # y and weights, so the same output): two moving-average updates.
      with tf.GradientTape() as g_tape, layers.repeated_moving_average_updates(
          nets.generator, 2):
        fake = nets.generator([z, y], training=True)
      with tf.GradientTape() as d_tape:
        d_real, d_fake = discriminate(nets.discriminator, real,
                                      tf.stop_gradient(fake), y)
        d_loss = (_bce(tf.ones_like(d_real), d_real) +
                  _bce(tf.zeros_like(d_fake), d_fake))
      d_carry = d_optimizer.step(d_carry, d_tape.gradient(d_loss, d_vars))
      with g_tape:
        d_on_fake = nets.discriminator([fake, y], training=True)
        g_loss = _bce(tf.ones_like(d_on_fake), d_on_fake)
      g_carry = g_optimizer.step(g_carry, g_tape.gradient(g_loss, g_vars))
      d_sum += d_loss
      g_sum += g_loss
      steps += 1
  mean = lambda total: training_tf.mean_over_steps(total, steps)
  return (d_optimizer.end(d_carry), g_optimizer.end(g_carry), mean(d_sum),
          mean(g_sum))


def generated_logits(generator, classifier, noise, labels):
  """C(G(z, y)) in inference mode, in chunks to bound memory."""
  return training_tf.chunked_logits(
      lambda z, y: classifier(generator([z, y], training=False),
                              training=False),
      (noise, labels), classifier.output_shape[-1])


@tf.function
def client_update(nets: PartyNetworks, message: ServerMessage, state: ClientState,
                  dataset, timed: bool = False,
                  upload_updates: bool = False) -> ClientOutput:
  """One FedCG client round: load G_g/C_g, stage 1, stage 2, teacher logits.

  `upload_updates` (DP-FedCG): G and C are uploaded as the round's updates
  (G_i - G_g, C_i - C_g), so that a DP aggregator clips and noises what the
  round changed; the server adds the mean update back (`server_update`).

  `timed` adds `ClientOutput.times`; each stamp waits for the phase before
  it and the next phase waits for the stamp, so the stamps bracket the
  phases (the values computed are the same either way).
  """
  config = nets.config
  model_weights.assign(nets.generator, message.generator)
  model_weights.assign(nets.classifier, message.classifier)
  model_weights.assign(nets.extractor, state.extractor)
  model_weights.assign(nets.discriminator, state.discriminator)
  gamma = gamma_ramp(message.round_num, config.gamma_ramp_rounds)
  draw_seed, draw_round = training_tf.draw_key(config, state.seed,
                                               message.round_num)
  stamps = training_tf.Stamps(timed)

  num_examples = training_tf.count_examples(dataset)
  # Passes over `dataset` in order: see training_tf.PASS_ORDER_NOTE. Stage 2
  # follows stage 1 through the extractor's variables.
  with tf.control_dependencies([num_examples]):
    with tf.control_dependencies(stamps.after(num_examples)):
      cls_opt, cls_loss, dist_loss = train_classification(
          nets, state.classification_optimizer, dataset, gamma, draw_seed,
          draw_round)
  with tf.control_dependencies(stamps.after((cls_opt, cls_loss, dist_loss))):
    d_opt, g_opt, d_loss, g_loss = train_gan(
        nets, state.discriminator_optimizer, state.generator_optimizer,
        dataset, draw_seed, draw_round)
  with tf.control_dependencies(stamps.after((d_opt, g_opt, d_loss, g_loss))):
    teacher = generated_logits(nets.generator, nets.classifier,
                               message.distill_noise, message.distill_labels)
  stamps.after(teacher)

  classifier = model_weights.values(nets.classifier)
  new_state = ClientState(
      extractor=model_weights.values(nets.extractor),
      classifier=classifier,
      discriminator=model_weights.values(nets.discriminator),
      classification_optimizer=cls_opt,
      discriminator_optimizer=d_opt,
      generator_optimizer=g_opt,
      seed=state.seed,
  )
  upload = ClientUpload(
      generator=model_weights.values(nets.generator),
      classifier=classifier,
      teacher_logits=teacher,
  )
  if upload_updates:
    upload = attrs.evolve(
        upload,
        generator=model_weights.update(upload.generator, message.generator),
        classifier=model_weights.update(upload.classifier,
                                        message.classifier))
  metrics = ClientMetrics(num_examples=num_examples, gamma=gamma,
                          cls_loss=cls_loss,
                          dist_loss=dist_loss, d_loss=d_loss, g_loss=g_loss)
  return ClientOutput(state=new_state, upload=upload,
                      weight=tf.cast(num_examples, tf.float32),
                      metrics=metrics, times=tuple(stamps.values))


# ---------------------------------------------------------------------------
# Server update.


def server_message(state: ServerState, distill_inputs) -> ServerMessage:
  """What the server broadcasts: G_g, C_g, the round and its (z, y)."""
  noise, labels = distill_inputs
  return ServerMessage(generator=state.generator, classifier=state.classifier,
                       round_num=state.round_num, distill_noise=noise,
                       distill_labels=labels)


def upload_example(config: FedCGConfig) -> ClientUpload:
  """Tensors shaped as one client's upload (G, C, teacher logits)."""
  nets = training_tf.InitialNetworks(config, SERVER_NETWORKS)
  return ClientUpload(
      generator=nets.zeros('generator'),
      classifier=nets.zeros('classifier'),
      teacher_logits=tf.zeros([config.distill_samples, config.num_classes]))


def distillation_inputs(config: FedCGConfig, round_num):
  """The server's (z, y) for one round's distillation, keyed by round."""
  seed = tf.stack([tf.cast(k, tf.int64) for k in
                   training_tf.server_draw_key(config, round_num)])
  noise = tf.random.stateless_normal(
      [config.distill_samples, config.noise_dim], seed)
  labels = tf.random.stateless_uniform(
      [config.distill_samples], seed + [0, 1 << 32], minval=0,
      maxval=config.num_classes, dtype=tf.int32)
  return noise, labels


def distill(nets: PartyNetworks, optimizer_state, noise, labels, teacher_logits):
  """KL distillation of the teacher logits into (G, C) = (nets.generator,
  nets.classifier), `batch_size` rows of (z, y, teacher) per step, in order.

  The student runs in training mode (its batch-norm statistics follow the
  distillation batches), while the clients computed the teacher logits with
  their G_i in inference mode (`generated_logits`).

  Returns the new optimizer state and the per-step KL values.
  """
  variables = (nets.generator.trainable_variables +
               nets.classifier.trainable_variables)
  student = lambda z, y: nets.classifier(nets.generator([z, y], training=True),
                                         training=True)
  return training_tf.distill(nets, optimizer_state, variables, student,
                             (noise, labels), teacher_logits)


@tf.function
def server_update(nets: PartyNetworks, state: ServerState, aggregator_state,
                  averaged: ClientUpload, noise, labels, timed: bool = False,
                  upload_updates: bool = False):
  """Weighted-average (G, C) from the aggregator, then distil the ensemble.
  `timed` stamps the distillation (`ServerMetrics.times`);
  `upload_updates`: `averaged` holds the mean update of G and C, added to
  the server's (which it broadcast this round; batch-norm variances kept
  valid under DP's noise)."""
  if upload_updates:
    averaged = attrs.evolve(
        averaged,
        generator=model_weights.apply_update(
            nets.generator, state.generator, averaged.generator),
        classifier=model_weights.apply_update(
            nets.classifier, state.classifier, averaged.classifier))
  stamps = training_tf.Stamps(timed)
  assigned = (model_weights.assign(nets.generator, averaged.generator) +
              model_weights.assign(nets.classifier, averaged.classifier))
  with tf.control_dependencies(stamps.after(assigned)):
    optimizer_state, kls = distill(nets, state.optimizer_state, noise, labels,
                                   averaged.teacher_logits)
  stamps.after((optimizer_state, kls))
  new_state = ServerState(
      generator=model_weights.values(nets.generator),
      classifier=model_weights.values(nets.classifier),
      optimizer_state=optimizer_state,
      aggregator_state=aggregator_state,
      round_num=state.round_num + 1,
  )
  mean, first, last = training_tf.loss_summary(kls)
  metrics = ServerMetrics(distill_kl=mean, distill_kl_first=first,
                          distill_kl_last=last, times=tuple(stamps.values))
  return new_state, metrics
