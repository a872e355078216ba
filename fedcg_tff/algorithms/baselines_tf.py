"""The paper's baselines in plain TensorFlow (FEDCG_SPEC.md, Baselines).

Every baseline trains the same split networks with the same supervised loop
(`training_tf.train_classifier`); they differ in what is shared and in a few
terms, which one `Baseline` value describes at trace time:

  local     nothing is shared.
  fedavg    E and C: the server takes their weighted mean.
  fedprox   as fedavg, plus (mu/2)·||w − w_global||² in the local loss.
  fedsplit  C only; E stays in the client state.
  feddf     as fedavg, then the server distils the weighted ensemble of the
            clients' (E_i, C_i) into the mean model on unlabeled server data.
  fedgen    C only (E stays private), plus a server generator G(z, y) of
            features: the server trains G so that the weighted ensemble of the
            clients' C_i labels G(z, y) as y (CE) with a diversity term; the
            clients add CE(C(G(z, y)), y) to their loss.

Each client keeps (E_i, C_i) after its local training: that personalised pair
is what the evaluation scores, as for FedCG.
"""

import dataclasses
import os
from typing import Any

import attrs
import numpy as np
import tensorflow as tf

from fedcg_tff.algorithms import training_tf
from fedcg_tff.algorithms.training_tf import PartyNetworks
from fedcg_tff.config import FedCGConfig
from fedcg_tff.models import model_weights


@dataclasses.dataclass(frozen=True)
class Baseline:
  """What makes an algorithm this baseline; fixed when the graph is traced.

  (A dataclass, not attrs: `tf.function` would flatten an attrs instance as a
  structure of values, while this must stay one hashable Python constant.)
  """
  name: str
  shared: tuple[str, ...]  # PartyNetworks the server averages and broadcasts.
  proximal: bool = False  # FedProx's term towards the broadcast weights.
  server_distillation: bool = False  # FedDF: distil on server data.
  server_generator: bool = False  # FedGen: server-trained feature generator.
  # Upload the round's update (trained minus broadcast weights) instead of
  # the weights; the server adds the aggregate to its weights. Same mean,
  # but a clip or noise in the aggregator then acts on the update, as DP
  # needs (`run_fedcg --dp_sigma`, privacy/dp.py). Averaging-only
  # baselines (fedavg, fedprox, fedsplit).
  upload_update: bool = False

  @property
  def client_networks(self) -> tuple[str, ...]:
    """The networks a client's step builds (`training_tf.PartyNetworks`)."""
    return ('extractor', 'classifier') + (
        ('generator',) if self.server_generator else ())

  @property
  def server_networks(self) -> tuple[str, ...]:
    """The networks the server's step and initial state build."""
    names = set(self.shared)
    if self.server_distillation:
      names |= {'extractor', 'classifier'}
    if self.server_generator:
      names |= {'generator', 'classifier'}
    return tuple(n for n in training_tf.NETWORK_NAMES if n in names)

  @property
  def communicates(self) -> bool:
    return bool(self.shared)

  @property
  def collects_client_models(self) -> bool:
    """Whether the server needs each client's shared networks, not only
    their mean (to form the ensemble of FedDF and FedGen)."""
    return self.server_distillation or self.server_generator


_EC = ('extractor', 'classifier')
BASELINES = {
    'local': Baseline('local', ()),
    'fedavg': Baseline('fedavg', _EC),
    'fedprox': Baseline('fedprox', _EC, proximal=True),
    'fedsplit': Baseline('fedsplit', ('classifier',)),
    'feddf': Baseline('feddf', _EC, server_distillation=True),
    'fedgen': Baseline('fedgen', ('classifier',), server_generator=True),
}


# ---------------------------------------------------------------------------
# Structures.


@attrs.define(frozen=True)
class ServerState:
  shared: Any  # dict: name -> global weights of each shared network.
  generator: Any  # FedGen's G; () otherwise.
  optimizer_state: Any  # Server Adam (FedDF: over E, C; FedGen: G); or ().
  aggregator_state: Any
  round_num: Any  # int32: the round about to run (0-based).


@attrs.define(frozen=True)
class ClientState:
  """What a client keeps between rounds."""
  extractor: Any  # E_i after local training (private unless shared).
  classifier: Any  # C_i after local training.
  optimizer: Any  # State of the E+C optimizer (persists, as in FedCG).
  seed: Any  # int64: keys the client's noise draws (FedGen).


@attrs.define(frozen=True)
class ServerMessage:
  shared: Any  # dict: name -> global weights.
  generator: Any  # FedGen's G; () otherwise.
  round_num: Any


@attrs.define(frozen=True)
class ClientMetrics:
  num_examples: Any
  cls_loss: Any
  extra_loss: Any  # FedProx: the proximal term; FedGen: CE on G's features.


@attrs.define(frozen=True)
class ClientOutput:
  state: ClientState
  upload: Any  # dict: name -> the client's weights of each shared network.
  weight: Any  # n_i, float32.
  metrics: ClientMetrics


@attrs.define(frozen=True)
class ServerMetrics:
  """FedDF: KL of its distillation; FedGen: ensemble CE of its generator
  training (and the diversity term); zeros for the other baselines."""
  server_loss: Any
  server_loss_first: Any
  server_loss_last: Any
  diversity: Any


def _zero_server_metrics():
  return ServerMetrics(*([tf.constant(0.0)] * 4))


# ---------------------------------------------------------------------------
# Initial states.


def _server_trainables(nets, baseline: Baseline):
  """The trainable weights of what the server trains (None: nothing), of
  `nets`' networks: PartyNetworks (variables) or InitialNetworks (their
  templates' weights: shapes and dtypes only)."""
  if baseline.server_distillation:
    return (nets.model('extractor').trainable_weights +
            nets.model('classifier').trainable_weights)
  if baseline.server_generator:
    return nets.model('generator').trainable_weights
  return None


def initial_server_state(config: FedCGConfig, baseline: Baseline,
                         aggregator_state) -> ServerState:
  """Global networks drawn from `config.seed`, round 0."""
  nets = training_tf.InitialNetworks(config, baseline.server_networks)
  trainables = _server_trainables(nets, baseline)
  return ServerState(
      shared={name: nets.initial_weights(name) for name in baseline.shared},
      generator=(nets.initial_weights('generator')
                 if baseline.server_generator else ()),
      optimizer_state=(() if trainables is None else
                       training_tf.initial_optimizer_state(
                           training_tf.server_optimizer(config), trainables)),
      aggregator_state=aggregator_state,
      round_num=tf.constant(0, tf.int32),
  )


def initial_client_state(config: FedCGConfig, seed) -> ClientState:
  """A client's E, C and optimizer state; `seed` (int64) is the client's
  private seed (`InitialNetworks.initial_weights`)."""
  nets = training_tf.InitialNetworks(config, ('extractor', 'classifier'))
  seed = tf.cast(seed, tf.int64)
  return ClientState(
      extractor=nets.initial_weights('extractor', seed),
      classifier=nets.initial_weights('classifier', seed),
      optimizer=training_tf.initial_classification_state(config, nets),
      seed=seed,
  )


def upload_example(config: FedCGConfig, baseline: Baseline) -> dict:
  """Tensors shaped as one client's upload: its weights (or update) of each
  shared network."""
  nets = training_tf.InitialNetworks(config, baseline.shared)
  return {name: nets.zeros(name) for name in baseline.shared}


def server_message(state: ServerState) -> ServerMessage:
  """What the server broadcasts: its shared networks (FedGen: and G)."""
  return ServerMessage(shared=state.shared, generator=state.generator,
                       round_num=state.round_num)


def advance_round(state: ServerState) -> ServerState:
  """Local's server step: nothing to aggregate, only the round advances."""
  return ServerState(shared=state.shared, generator=state.generator,
                     optimizer_state=state.optimizer_state,
                     aggregator_state=state.aggregator_state,
                     round_num=state.round_num + 1)


def write_server_images(images: np.ndarray, path: str,
                        image_size: int = 32) -> str:
  """Writes FedDF's server images (float32 NHWC, preprocessed as the
  clients' inputs) where its server update reads them
  (`tf.io.serialize_tensor` format, through a temporary file renamed over
  `path`); returns `path`. Only the path is in the server's computation, so
  the images are not re-serialised into it each round."""
  images = np.asarray(images, np.float32)
  if images.ndim != 4 or images.shape[1:3] != (image_size, image_size):
    raise ValueError(f'server images must be [n, {image_size}, {image_size}, '
                     f'channels], got shape {images.shape}')
  if not len(images):
    raise ValueError('FedDF needs at least one server image')
  tmp = path + '.tmp'
  tf.io.write_file(tmp, tf.io.serialize_tensor(images))
  os.replace(tmp, path)
  return path


def read_server_images(path: str, config: FedCGConfig):
  """FedDF's server images from `write_server_images`'s file."""
  images = tf.io.parse_tensor(tf.io.read_file(path), tf.float32)
  images.set_shape([None, config.image_size, config.image_size,
                    config.image_channels])
  return images


# ---------------------------------------------------------------------------
# Client update.


def proximal_term(variables, reference):
  """(1/2)·||w − w_global||² over `variables`; its gradient is w − w_global,
  the FedProx paper's term. (TFF 0.87's FedProx adds mu·(w_global − w)
  instead: README, "Oracle tests against tff.learning".)"""
  return 0.5 * tf.add_n([tf.reduce_sum(tf.square(v - r))
                         for v, r in zip(variables, reference)])


@tf.function
def client_update(nets: PartyNetworks, baseline: Baseline, message: ServerMessage,
                  state: ClientState, dataset) -> ClientOutput:
  """One local round: take the broadcast networks, train E and C, upload.

  `message` is None for Local (nothing is broadcast).
  """
  config = nets.config
  model_weights.assign(nets.extractor, state.extractor)
  model_weights.assign(nets.classifier, state.classifier)
  round_num = tf.constant(0, tf.int32)
  if message is not None:
    round_num = message.round_num
    for name in baseline.shared:
      model_weights.assign(nets.model(name), message.shared[name])
    if baseline.server_generator:
      model_weights.assign(nets.generator, message.generator)

  extra_loss, extra_weight = None, 1.0
  if baseline.proximal:
    shared_vars = [v for name in baseline.shared
                   for v in nets.model(name).trainable_variables]
    reference = [tf.identity(v) for v in shared_vars]
    extra_loss = lambda *_: proximal_term(shared_vars, reference)
    extra_weight = config.prox_mu
  elif baseline.server_generator:
    draw_seed, draw_round = training_tf.draw_key(config, state.seed, round_num)

    def draws(labels, step):
      batch = tf.shape(labels)[0]
      key = (draw_seed, training_tf.NOISE_STREAM_GENERATED, draw_round, step)
      return (training_tf.noise(*key, [batch, config.noise_dim]),
              training_tf.uniform_labels(*key, batch, config.num_classes))

    # CE(C(G(z, y)), y) on generated features; G is frozen. From the second
    # round on, as FedGen's published code (its `regularization = glob_iter
    # > 0`): in the first, G is the server's initial draw, untrained, whose
    # near-constant features would only teach C to guess. In round 1 C does
    # not even see them (a `tf.cond`: no batch-norm statistics of
    # generated features either), so E and C train as FedSplit's, and the
    # term reads 0.
    def generated_ce(features, labels, zy, generated):
      del features, labels
      return tf.cond(
          round_num > 0,
          lambda: training_tf.cross_entropy(
              zy[1], nets.classifier(generated, training=True)),
          lambda: tf.constant(0.0))

    extra_loss = training_tf.FrozenNetworkLoss(
        draws=draws,
        network=lambda zy, labels: nets.generator(list(zy), training=False),
        loss=generated_ce)

  num_examples = training_tf.count_examples(dataset)
  # Passes over `dataset` in order: see training_tf.PASS_ORDER_NOTE.
  with tf.control_dependencies([num_examples]):
    optimizer, cls_loss, extra = training_tf.train_classifier(
        nets, state.optimizer, dataset, config.local_epochs, extra_loss,
        extra_weight)
  new_state = ClientState(
      extractor=model_weights.values(nets.extractor),
      classifier=model_weights.values(nets.classifier),
      optimizer=optimizer,
      seed=state.seed)
  upload = {name: getattr(new_state, name) for name in baseline.shared}
  if baseline.upload_update:
    upload = {name: model_weights.update(upload[name], message.shared[name])
              for name in baseline.shared}
  weight = tf.cast(num_examples, tf.float32)
  if message is None:
    # Nothing is uploaded: the round keeps the common shape with an empty
    # upload and a zero weight that the server's step ignores.
    upload, weight = (), tf.constant(0.0)
  return ClientOutput(
      state=new_state, upload=upload, weight=weight,
      metrics=ClientMetrics(num_examples=num_examples, cls_loss=cls_loss,
                            extra_loss=extra))


# ---------------------------------------------------------------------------
# Server update.


def server_data_indices(config: FedCGConfig, round_num, num_images):
  """Which server images FedDF distils on this round, in step order:
  `distill_samples` indices from seeded permutations of the server data
  (a fresh permutation per pass when the server data is smaller)."""
  num_images = tf.cast(num_images, tf.int32)
  passes = (config.distill_samples + num_images - 1) // num_images
  seed, round_num = training_tf.server_draw_key(config, round_num)
  seed = tf.stack([seed, tf.cast(round_num, tf.int64) + (1 << 32)])
  keys = tf.random.stateless_uniform(tf.stack([passes, num_images]), seed)
  order = tf.reshape(tf.argsort(keys, axis=1), [-1])
  return order[:config.distill_samples]


def feddf_teacher(nets: PartyNetworks, collected, weights, images):
  """Σ_i w_i C_i(E_i(x)) on `images`, w_i = n_i / Σ n (inference mode)."""
  num_classes = nets.config.num_classes
  logits_fn = lambda x: nets.classifier(nets.extractor(x, training=False),
                                        training=False)

  def member_logits(i):
    member = training_tf.member(collected, i)
    model_weights.assign(nets.extractor, member['extractor'])
    model_weights.assign(nets.classifier, member['classifier'])
    return training_tf.chunked_logits(logits_fn, (images,), num_classes)

  return _weighted_ensemble(training_tf.normalized_weights(weights),
                            member_logits,
                            [tf.shape(images)[0], num_classes])


def _weighted_ensemble(weights, member_logits, shape):
  """Σ_i weights[i] · member_logits(i), the clients' networks loaded in
  turn (FedDF's teacher, FedGen's ensemble)."""
  total = tf.zeros(shape)
  for i in tf.range(tf.shape(weights)[0]):
    total += weights[i] * member_logits(i)
  return total


def diversity_loss(features, noise):
  """FedGen's diversity term for two halves of a batch drawn with the same
  labels: 1 / (mean|G(z1) − G(z2)| / mean|z1 − z2| + 1e-5)."""
  f1, f2 = tf.split(features, 2)
  z1, z2 = tf.split(noise, 2)
  ratio = (tf.reduce_mean(tf.abs(f1 - f2)) /
           tf.reduce_mean(tf.abs(z1 - z2)))
  return 1.0 / (ratio + 1e-5)


def ensemble_logits(nets: PartyNetworks, classifiers, weights, features):
  """Σ_i w_i C_i(features): the clients' classifiers loaded in turn into
  `nets.classifier` (differentiable in `features`)."""
  def member_logits(i):
    model_weights.assign(nets.classifier, training_tf.member(classifiers, i))
    return nets.classifier(features, training=False)

  return _weighted_ensemble(weights, member_logits,
                            [tf.shape(features)[0], nets.config.num_classes])


def train_generator(nets: PartyNetworks, optimizer_state, classifiers, weights,
                    round_num):
  """FedGen's server step: `distill_steps` Adam steps of G on
  CE(Σ_i w_i C_i(G(z, y)), y) + diversity_weight · diversity.

  Returns the new optimizer state, the per-step CE and the mean diversity.
  """
  config = nets.config
  w = training_tf.normalized_weights(weights)
  variables = nets.generator.trainable_variables
  optimizer = training_tf.optimizer_steps(
      training_tf.server_optimizer(config), nets, variables)
  carry = optimizer.begin(optimizer_state)
  bs = config.batch_size
  seed, round_num = training_tf.server_draw_key(config, round_num)
  stream = (training_tf.NOISE_STREAM_FEDGEN_SERVER if config.replay_draws
            else training_tf.NOISE_STREAM_GENERATED)
  ces = tf.TensorArray(tf.float32, size=config.distill_steps)
  diversity_sum = tf.constant(0.0)
  for step in tf.range(config.distill_steps):
    key = (seed, stream, round_num, step)
    y = training_tf.uniform_labels(*key, bs, config.num_classes)
    z = training_tf.noise(*key, [2 * bs, config.noise_dim])
    with tf.GradientTape() as tape:
      features = nets.generator([z, tf.concat([y, y], 0)], training=True)
      ce = training_tf.cross_entropy(
          y, ensemble_logits(nets, classifiers, w, features[:bs]))
      diversity = diversity_loss(features, z)
      loss = ce + config.diversity_weight * diversity
    carry = optimizer.step(carry, tape.gradient(loss, variables))
    ces = ces.write(step, ce)
    diversity_sum += diversity
  mean_diversity = diversity_sum / tf.maximum(
      tf.cast(config.distill_steps, tf.float32), 1.0)
  return optimizer.end(carry), ces.stack(), mean_diversity


@tf.function
def server_update(nets: PartyNetworks, baseline: Baseline, state: ServerState,
                  aggregator_state, averaged, collected=None, weights=None,
                  server_images=None):
  """The new global networks: the weighted mean `averaged`, then FedDF's
  distillation or FedGen's generator training when the baseline has one.

  `collected` / `weights`: each client's upload stacked on a leading client
  axis, and the clients' n_i (FedDF, FedGen). `server_images`: FedDF's
  unlabeled server data.
  """
  config = nets.config
  shared = averaged
  if baseline.upload_update:  # `averaged` is the mean update (DP: noised).
    shared = {name: model_weights.apply_update(
        nets.model(name), state.shared[name], averaged[name])
              for name in baseline.shared}
  generator = state.generator
  optimizer_state = state.optimizer_state
  metrics = _zero_server_metrics()
  if baseline.server_distillation:
    indices = server_data_indices(config, state.round_num,
                                  tf.shape(server_images)[0])
    images = tf.gather(server_images, indices)
    teacher = feddf_teacher(nets, collected, weights, images)
    model_weights.assign(nets.extractor, averaged['extractor'])
    model_weights.assign(nets.classifier, averaged['classifier'])
    student = lambda x: nets.classifier(nets.extractor(x, training=True),
                                        training=True)
    optimizer_state, kls = training_tf.distill(
        nets, optimizer_state, _server_trainables(nets, baseline), student,
        (images,), teacher)
    shared = {'extractor': model_weights.values(nets.extractor),
              'classifier': model_weights.values(nets.classifier)}
    metrics = ServerMetrics(*training_tf.loss_summary(kls),
                            diversity=tf.constant(0.0))
  elif baseline.server_generator:
    model_weights.assign(nets.generator, state.generator)
    optimizer_state, ces, diversity = train_generator(
        nets, optimizer_state, collected['classifier'], weights,
        state.round_num)
    generator = model_weights.values(nets.generator)
    metrics = ServerMetrics(*training_tf.loss_summary(ces),
                            diversity=diversity)
  new_state = ServerState(shared=shared, generator=generator,
                          optimizer_state=optimizer_state,
                          aggregator_state=aggregator_state,
                          round_num=state.round_num + 1)
  return new_state, metrics
