"""Plain-TF privacy analysis: DLG gradient inversion under each algorithm's
threat model, and the PSNR / SSIM of what it recovers (FEDCG_SPEC.md,
Table 2 and the DLG paragraph).

Threat models. The attacker is an honest-but-curious server: it follows the
protocol and holds exactly what the algorithm shares with it in a round,
nothing more. What is attacked is one shared gradient: a client's gradient
of its round-1 loss for one batch (`batch_size` images, default 1) at the
networks of round 1 (the server's initial broadcast networks, and the
client's own initial extractor where E is private). One local step's
update is this gradient times the learning rate, so it is what a round with
one local step shares; a longer round shares a sum of such gradients, which
the original DLG attack does not address.

  fedavg    sees the gradient of E and C, and holds E and C.
  fedprox   as fedavg: at the broadcast weights the proximal term's gradient
            mu (w - w_global) is zero, so the first gradient is FedAvg's.
  fedavg_dp as fedavg, but the gradient reaches it through the Gaussian
            mechanism of `dp.gaussian_mechanism`: clipped to L2 norm
            `dp_clip` and noised with N(0, dp_sigma^2) per coordinate. The
            attacker knows the mechanism, so it clips its own dummy
            gradients the same way before matching.
  fedsplit  sees only C's gradient, and holds C. E never leaves the client.
  fedcg     sees only what FedCG shares: G and C and their updates. C's
            update carries C's gradient; G's update is trained on the
            private discriminator's verdict on G(z, y) with the client's
            own noise, a function of the data only through the private D and
            E, so the attack does not use it. The attacker holds G and C.

Where E is private (fedsplit, fedcg), what the attacker knows of it depends
on how the clients' networks were initialised (`FedCGConfig.client_init`):

  fedsplit, fedcg        shared init (the default, as the published code):
                         every client starts from the networks drawn from
                         the run's seed, which the server knows (it draws
                         its own G and C from it). At round 1 the attacker
                         therefore holds the client's E_i exactly, by
                         drawing it itself; it receives nothing more.
  fedsplit_private,      private init: E_i is drawn from the client's own
  fedcg_private          seed. The attacker stands in for it with a fresh
                         extractor, the same public architecture drawn from
                         the same initialisation distribution with a seed of
                         its own: at round 1 that is its best available
                         guess short of the client's seed (fitting a
                         stand-in to the shared generator would need images
                         of the client's classes, which it does not have).

(C's gradient gives the attacker the features E_i(x) of a single image
exactly either way, from the first dense layer's kernel and bias gradients;
what E_i hides is the map from features back to pixels, and under shared
init at round 1 it hides nothing.)

The DLG attack (Zhu et al., 2019). Dummy images x' (and, unless inferred,
dummy soft labels) start at random and are optimised so that the gradient
they produce on the attacker's networks matches the observed gradient:
minimise sum_k ||g'_k - g_k||^2 / sum_k ||g_k||^2 over the observed tensors
(the normalisation only rescales the objective, for the optimiser's
tolerances). L-BFGS (SciPy's L-BFGS-B, with TF's exact gradients of the
objective; the box bounds keep x' in the normalised input range, which the
attacker knows from the public preprocessing) as in the original attack, or
Adam. Labels are inferred as in iDLG (Zhao et al., 2020) when the batch is
one image: the true class is the only negative entry of the gradient of
C's output bias. Of several restarts the attacker keeps the one with the
lowest matching loss (it cannot see the true image).

Images. The networks' inputs are normalised ((x - mean) / std, FMNIST:
[-1, 1]); the attack works in that space. PSNR and SSIM compare images
mapped back to [0, 1] (peak 1): PSNR = 10 log10(1 / MSE), capped at
`PSNR_CAP_DB` (identical images, MSE 0); SSIM is `tf.image.ssim` with its
default 11x11 Gaussian window.
"""

import dataclasses
import math
import time
from typing import Optional, Sequence

import attrs
import numpy as np
import scipy.optimize
import tensorflow as tf

from fedcg_tff.algorithms import baselines_tf
from fedcg_tff.algorithms import fedcg_tf
from fedcg_tff.algorithms import training_tf
from fedcg_tff.config import FedCGConfig
from fedcg_tff.models import families
from fedcg_tff.models import model_weights
from fedcg_tff.privacy import dp

PSNR_CAP_DB = 100.0
ATTACK_OPTIMIZERS = ('lbfgs', 'adam')
LABEL_MODES = ('auto', 'infer', 'optimize')
# Offset between the run's seed and the attacker's stand-in extractor seed.
# The clients' seeds are seed * 1000 + i + 1 below client 1000 and above 2**62
# from there (program.driver.client_seeds), so this one is no client's (for
# seed >= 1, or fewer than 500 clients).
STAND_IN_SEED_OFFSET = 500

_EC = ('extractor', 'classifier')


@dataclasses.dataclass(frozen=True)
class ThreatModel:
  """What an honest-but-curious server sees of one client in a round."""
  name: str  # Row of the report: 'fedavg', 'fedavg_dp0.1', 'fedcg', ...
  algorithm: str  # The training algorithm (`run_fedcg --algorithm`).
  gradients: tuple[str, ...]  # PartyNetworks whose gradient it observes.
  holds: tuple[str, ...]  # PartyNetworks whose weights it holds.
  dp_sigma: float = 0.0  # Gaussian mechanism on the gradient (0: none).
  dp_clip: float = 0.0
  statement: str = ''
  # The training run's `client_init`: with 'shared', a private E_i starts as
  # the public draw from the run's seed, which the attacker can make itself.
  client_init: str = 'shared'

  @property
  def private_extractor(self) -> bool:
    """Whether E_i is never sent to the server."""
    return 'extractor' not in self.holds

  @property
  def knows_initial_extractor(self) -> bool:
    """Whether the attacker can draw E_i's round-1 weights itself."""
    return self.private_extractor and self.client_init == 'shared'

  @property
  def label(self) -> str:
    """A human name: 'FedAvg DP 0.1'."""
    base = {'fedavg': 'FedAvg', 'fedprox': 'FedProx', 'fedsplit': 'FedSplit',
            'fedcg': 'FedCG'}[self.algorithm]
    if self.dp_sigma:
      return f'{base} DP {self.dp_sigma:g}'
    if self.private_extractor:
      return f'{base} ({self.client_init} init)'
    return base


THREAT_MODEL_NAMES = ('fedavg', 'fedprox', 'fedavg_dp', 'fedsplit',
                      'fedsplit_private', 'fedcg', 'fedcg_private')
PRIVATE_INIT_SUFFIX = '_private'

_STATEMENTS = {
    'fedavg': 'the gradient of E and C for one batch; holds E and C',
    'fedprox': 'the gradient of E and C for one batch (the proximal term is '
               'zero at the broadcast weights); holds E and C',
    'fedavg_dp': 'the gradient of E and C for one batch, clipped to L2 norm '
                 '{clip:g} and noised with N(0, {sigma:g}^2) per coordinate '
                 '(TF Privacy GaussianSumQuery); holds E and C',
    'fedsplit': 'the gradient of C only; holds C; E is private but starts '
                'as the public draw from the run\'s seed (shared init), '
                'which the attacker makes itself',
    'fedsplit_private': 'the gradient of C only; holds C; E is private and '
                        'drawn from the client\'s own seed (private init; '
                        'stand-in: a fresh extractor)',
    'fedcg': 'the gradient of C and the weights of G and C only (G\'s update '
             'depends on the data only through the private D and E); E is '
             'private but starts as the public draw from the run\'s seed '
             '(shared init), which the attacker makes itself',
    'fedcg_private': 'the gradient of C and the weights of G and C only; E '
                     'is private and drawn from the client\'s own seed '
                     '(private init; stand-in: a fresh extractor)',
}


def threat_model(name: str, dp_sigma: float = 0.0,
                 dp_clip: float = 0.0) -> ThreatModel:
  """The threat model `name` (THREAT_MODEL_NAMES); `fedavg_dp` needs
  `dp_sigma` > 0 and `dp_clip` > 0."""
  if name not in THREAT_MODEL_NAMES:
    raise ValueError(f'algorithms: {name!r} is not one of '
                     f'{THREAT_MODEL_NAMES}')
  if name == 'fedavg_dp':
    dp.check_parameters(dp_sigma, dp_clip)
    if dp_sigma == 0:
      raise ValueError('dp_sigma must be > 0 for fedavg_dp')
    return ThreatModel(f'fedavg_dp{dp_sigma:g}', 'fedavg', _EC,
                       _uploaded('fedavg'),
                       dp_sigma, dp_clip,
                       _STATEMENTS[name].format(clip=dp_clip, sigma=dp_sigma))
  if name in ('fedavg', 'fedprox'):
    return ThreatModel(name, name, _EC, _uploaded(name),
                       statement=_STATEMENTS[name])
  algorithm, client_init = name, 'shared'
  if name.endswith(PRIVATE_INIT_SUFFIX):
    algorithm, client_init = name[:-len(PRIVATE_INIT_SUFFIX)], 'private'
  return ThreatModel(name, algorithm, ('classifier',), _uploaded(algorithm),
                     statement=_STATEMENTS[name], client_init=client_init)


def _uploaded(algorithm: str) -> tuple[str, ...]:
  """The networks `algorithm`'s clients upload, from the algorithm's own
  definition (FedCG's teacher logits are computed from G and C)."""
  if algorithm in baselines_tf.BASELINES:
    return baselines_tf.BASELINES[algorithm].shared
  return tuple(f.name for f in attrs.fields(fedcg_tf.ClientUpload)
               if f.name != 'teacher_logits')


# ---------------------------------------------------------------------------
# The victim's side: its networks in round 1 and what it shares.


@dataclasses.dataclass(frozen=True)
class ClientNetworks:
  """The attacked client's networks when it computes the gradient (numpy
  weight tuples in `model.weights` order)."""
  extractor: tuple
  classifier: tuple
  generator: tuple


def round_one_networks(config: FedCGConfig, threat: ThreatModel,
                       client_seed: int) -> ClientNetworks:
  """The networks a client trains in round 1 under `threat.algorithm`: the
  server's initial networks (drawn from `config.seed`, as every algorithm's
  `initial_server_state` draws them) for what is shared, and the client's
  own initial extractor where E is private: the same public draw under
  shared init, a draw from `client_seed` under private init. Drawn by
  `training_tf.InitialNetworks.initial_weights`, the draw of the clients'
  initial states, under the threat model's client init."""
  private = threat.private_extractor and threat.client_init == 'private'
  networks = training_tf.InitialNetworks(dataclasses.replace(
      config, client_init='private' if private else 'shared'))
  seed = tf.constant(client_seed, tf.int64)
  draw = lambda name: tuple(np.asarray(v) for v in
                            networks.initial_weights(name, seed))
  return ClientNetworks(extractor=draw('extractor'),
                        classifier=draw('classifier'),
                        generator=draw('generator'))


@dataclasses.dataclass(frozen=True)
class Observation:
  """Everything the attacker gets: the threat model, the weights of the
  networks it holds and the gradients it observes (numpy), and public
  facts (the batch size of the shared gradient, the architecture)."""
  threat: ThreatModel
  weights: dict  # name -> tuple of arrays (`model.weights` order).
  gradients: dict  # name -> tuple of arrays (`trainable_variables` order).
  batch_size: int


def _loss(labels, logits):
  """The clients' loss: mean softmax cross-entropy (integer or soft
  labels)."""
  if labels.dtype.is_integer:
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels, logits))
  return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
      labels, logits))


def observe(config: FedCGConfig, threat: ThreatModel, client: ClientNetworks,
            images: np.ndarray, labels: np.ndarray) -> Observation:
  """What the client shares for the batch (`images` normalised NHWC,
  `labels` int), as the attacker sees it under `threat`.

  Noise (fedavg_dp) comes from TF's global random state: seed it with
  `tf.random.set_seed` for a reproducible draw.
  """
  extractor = families.build_extractor(config.model, config.image_channels)
  classifier = families.build_classifier(config.model, config.num_classes)
  model_weights.assign(extractor, client.extractor)
  model_weights.assign(classifier, client.classifier)
  nets = {'extractor': extractor, 'classifier': classifier}
  variables = {name: nets[name].trainable_variables
               for name in threat.gradients}
  with tf.GradientTape() as tape:
    loss = _loss(tf.constant(labels, tf.int32),
                 classifier(extractor(tf.constant(images, tf.float32))))
  gradients = tape.gradient(loss, variables)
  if threat.dp_sigma:
    gradients = dp.gaussian_mechanism(gradients, threat.dp_sigma,
                                      threat.dp_clip)
  weights = {name: tuple(np.array(v) for v in getattr(client, name))
             for name in threat.holds}
  return Observation(
      threat=threat, weights=weights,
      gradients={name: tuple(np.asarray(g) for g in gradients[name])
                 for name in threat.gradients},
      batch_size=int(len(images)))


# ---------------------------------------------------------------------------
# The attack.


@dataclasses.dataclass(frozen=True)
class AttackOptions:
  iterations: int = 300  # Optimiser iterations per restart.
  restarts: int = 1
  optimizer: str = 'lbfgs'  # ATTACK_OPTIMIZERS
  adam_lr: float = 0.1
  labels: str = 'auto'  # 'infer' (iDLG, batch 1), 'optimize', 'auto'.
  seed: int = 0  # Dummy initialisations.

  def validate(self) -> 'AttackOptions':
    if self.iterations < 1:
      raise ValueError(f'iterations must be >= 1, got {self.iterations}')
    if self.restarts < 1:
      raise ValueError(f'restarts must be >= 1, got {self.restarts}')
    if self.optimizer not in ATTACK_OPTIMIZERS:
      raise ValueError(f'attack_optimizer must be one of {ATTACK_OPTIMIZERS},'
                       f' got {self.optimizer!r}')
    if not (math.isfinite(self.adam_lr) and self.adam_lr > 0):
      raise ValueError(f'adam_lr must be finite and > 0, got {self.adam_lr}')
    if self.labels not in LABEL_MODES:
      raise ValueError(f'labels must be one of {LABEL_MODES}, '
                       f'got {self.labels!r}')
    return self


@dataclasses.dataclass(frozen=True)
class AttackResult:
  images: np.ndarray  # Reconstructed batch, normalised NHWC.
  labels: np.ndarray  # Recovered labels (int).
  matching_loss: float  # Of the kept restart.
  restart_losses: tuple[float, ...]
  seconds: float


def infer_labels(observation: Observation) -> np.ndarray:
  """iDLG: the class whose entry of the gradient of C's output bias is the
  smallest (for one image with a softmax cross-entropy, the only negative
  one)."""
  if observation.batch_size != 1:
    raise ValueError('labels=infer needs attack_batch_size=1 (the bias '
                     f'gradient of a batch of {observation.batch_size} mixes '
                     'its labels); use labels=optimize')
  bias_gradient = observation.gradients['classifier'][-1]
  if bias_gradient.ndim != 1:
    raise ValueError('the last classifier variable is not the output bias')
  return np.array([int(np.argmin(bias_gradient))], np.int32)


def stand_in_extractor(config: FedCGConfig, seed: int) -> tuple:
  """An extractor drawn from the initialisation distribution with `seed`:
  the attacker's own seed gives its stand-in for a private E, the run's
  seed the public initial E of shared init."""
  model = families.build_extractor(config.model, config.image_channels)
  return tuple(np.asarray(v) for v in model_weights.sample_initial(
      model, tf.constant(seed, tf.int64)))


class _Matcher:
  """The gradient-matching objective on the attacker's networks.

  Built (and traced) once per kind of attack: what is observed, the clip,
  the batch size and whether labels are optimised; `load` then sets the
  networks, target gradient and labels of one observation.

  The attacker's networks and the objective run in float64. Once the
  observed gradient carries DP noise, the noise's squared norm dominates
  the objective and a line-search step changes it by about as much as
  float32 rounding of the dummy gradient does: in float32, L-BFGS stopped
  after 0 to 60 iterations ("abnormal termination in line search"), near
  its random start; in float64 it converges.
  """

  def __init__(self, config: FedCGConfig, gradients: tuple[str, ...],
               clip: Optional[float], batch_size: int,
               optimise_labels: bool):
    floatx = tf.keras.backend.floatx()
    tf.keras.backend.set_floatx('float64')
    try:
      self.extractor = families.build_extractor(config.model,
                                              config.image_channels)
      self.classifier = families.build_classifier(config.model,
                                                config.num_classes)
    finally:
      tf.keras.backend.set_floatx(floatx)
    nets = {'extractor': self.extractor, 'classifier': self.classifier}
    self.variables = [v for name in gradients
                      for v in nets[name].trainable_variables]
    self.target = [tf.Variable(tf.zeros_like(v), trainable=False)
                   for v in self.variables]
    self.scale = tf.Variable(1.0, trainable=False, dtype=tf.float64)
    self.clip = clip
    size = config.image_size
    self.image_shape = (batch_size, size, size, config.image_channels)
    self.num_pixels = int(np.prod(self.image_shape))
    self.num_classes = config.num_classes
    self.optimise_labels = optimise_labels
    self.labels = tf.Variable(tf.zeros([batch_size], tf.int32),
                              trainable=False)
    self.num_label_logits = (batch_size * config.num_classes
                             if optimise_labels else 0)
    spec = tf.TensorSpec([self.num_pixels + self.num_label_logits],
                         tf.float64)
    self.value_and_gradient = tf.function(self._value_and_gradient,
                                          input_signature=[spec])

  def load(self, observation: Observation, extractor_weights,
           labels: Optional[np.ndarray]):
    wide = lambda values: [np.asarray(v, np.float64) for v in values]
    model_weights.assign(self.extractor, wide(extractor_weights))
    model_weights.assign(self.classifier,
                            wide(observation.weights['classifier']))
    target = [g for name in observation.threat.gradients
              for g in observation.gradients[name]]
    for variable, value in zip(self.target, wide(target)):
      variable.assign(value)
    self.scale.assign(max(float(sum(np.sum(np.square(g)) for g in target)),
                          1e-30))
    if labels is not None:
      self.labels.assign(labels)

  def _value_and_gradient(self, flat):
    with tf.GradientTape() as outer:
      outer.watch(flat)
      images = tf.reshape(flat[:self.num_pixels], self.image_shape)
      if self.optimise_labels:
        labels = tf.nn.softmax(tf.reshape(
            flat[self.num_pixels:], [self.image_shape[0], self.num_classes]))
      else:
        labels = self.labels
      with tf.GradientTape() as inner:
        loss = _loss(labels, self.classifier(self.extractor(images)))
      dummy = inner.gradient(loss, self.variables)
      if self.clip is not None:
        dummy, _ = tf.clip_by_global_norm(dummy, self.clip)
      objective = tf.add_n([tf.reduce_sum(tf.square(d - t))
                            for d, t in zip(dummy, self.target)]) / self.scale
    return objective, outer.gradient(objective, flat)

  def labels_of(self, flat: np.ndarray) -> np.ndarray:
    if not self.optimise_labels:
      return self.labels.numpy()
    logits = flat[self.num_pixels:].reshape(self.image_shape[0],
                                            self.num_classes)
    return np.argmax(logits, axis=-1).astype(np.int32)


_MATCHERS: dict = {}


def _matcher(config: FedCGConfig, threat: ThreatModel, batch_size: int,
             optimise_labels: bool) -> _Matcher:
  """A `_Matcher` for this kind of attack, reused across observations (one
  trace of the objective instead of one per attacked batch)."""
  clip = threat.dp_clip if threat.dp_sigma else None
  key = (config, threat.gradients, clip, batch_size, optimise_labels)
  if key not in _MATCHERS:
    _MATCHERS[key] = _Matcher(config, threat.gradients, clip, batch_size,
                              optimise_labels)
  return _MATCHERS[key]


def input_range(mean: Sequence[float], std: Sequence[float]
                ) -> tuple[np.ndarray, np.ndarray]:
  """Per channel, the normalised values of pixel values 0 and 1."""
  mean, std = np.asarray(mean, np.float64), np.asarray(std, np.float64)
  return (0.0 - mean) / std, (1.0 - mean) / std


def pixel_bounds(value_range: tuple[Sequence[float], Sequence[float]],
                 shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
  """Flat lows and highs, one per value of images of `shape` (channels
  last), from `value_range`'s per-channel (or single) lows and highs: the
  box an optimiser over flattened images keeps each value in."""
  return tuple(np.broadcast_to(np.asarray(v, np.float64), shape).ravel()
               for v in value_range)


def dlg_attack(config: FedCGConfig, observation: Observation,
               options: AttackOptions,
               value_range: tuple[Sequence[float], Sequence[float]],
               stand_in_seed: Optional[int] = None) -> AttackResult:
  """Reconstructs the batch behind `observation` by gradient matching.

  The attacker's inputs are `observation`, the public architecture
  (`config`), the public range of the normalised inputs (`value_range`:
  per-channel lows and highs, from `input_range`) and its own choices
  (`options`; `stand_in_seed`, the seed of the stand-in extractor used when
  E is private and drawn from the client's seed, default the run's seed +
  STAND_IN_SEED_OFFSET). Where E is private but the clients' initial
  networks are shared, the attacker draws E from the run's seed itself.
  """
  options = options.validate()
  started = time.monotonic()
  threat = observation.threat
  if threat.knows_initial_extractor:  # The public draw: the true E_i.
    extractor_weights = stand_in_extractor(config, config.seed)
  elif threat.private_extractor:
    seed = (config.seed + STAND_IN_SEED_OFFSET if stand_in_seed is None
            else stand_in_seed)
    extractor_weights = stand_in_extractor(config, seed)
  else:
    extractor_weights = observation.weights['extractor']
  mode = options.labels
  if mode == 'auto':
    mode = 'infer' if observation.batch_size == 1 else 'optimize'
  labels = infer_labels(observation) if mode == 'infer' else None
  matcher = _matcher(config, threat, observation.batch_size, labels is None)
  matcher.load(observation, extractor_weights, labels)
  low, high = pixel_bounds(value_range, matcher.image_shape)
  best = None
  losses = []
  for restart in range(options.restarts):
    rng = np.random.default_rng([options.seed, restart])
    start = np.concatenate([
        rng.uniform(low, high, matcher.num_pixels),
        rng.normal(size=matcher.num_label_logits)]).astype(np.float64)
    if options.optimizer == 'lbfgs':
      flat, loss = _lbfgs(matcher, start, options.iterations, low, high)
    else:
      flat, loss = _adam(matcher, start, options.iterations, options.adam_lr,
                         low, high)
    losses.append(loss)
    if best is None or loss < best[1]:
      best = (flat, loss)
  flat, loss = best
  images = flat[:matcher.num_pixels].reshape(matcher.image_shape)
  return AttackResult(images=images.astype(np.float32),
                      labels=matcher.labels_of(flat), matching_loss=loss,
                      restart_losses=tuple(losses),
                      seconds=time.monotonic() - started)


def _lbfgs(matcher: _Matcher, start, iterations, low, high):
  bounds = (list(zip(low, high)) +
            [(None, None)] * matcher.num_label_logits)
  return minimize_lbfgs(matcher.value_and_gradient, start, iterations,
                        bounds)


def minimize_lbfgs(value_and_gradient, start: np.ndarray, iterations: int,
                   bounds=None, dtype=tf.float64) -> tuple[np.ndarray, float]:
  """SciPy's L-BFGS-B from `start`, driven by `value_and_gradient` (a TF
  function of a `dtype` vector): `iterations` iterations at most, with no
  tolerance to stop earlier, as the original DLG's fixed budget. Returns
  (the float64 minimiser, its value). The inversion attack uses it too."""
  def fun(flat):
    value, gradient = value_and_gradient(tf.constant(flat, dtype))
    return float(value), gradient.numpy().astype(np.float64)

  result = scipy.optimize.minimize(
      fun, np.asarray(start, np.float64), jac=True, method='L-BFGS-B',
      bounds=bounds, options={'maxiter': iterations,
                              'maxfun': 2 * iterations + 20,
                              'ftol': 0.0, 'gtol': 0.0})
  return result.x, float(result.fun)


def _adam(matcher: _Matcher, start, iterations, lr, low, high):
  flat = tf.Variable(tf.constant(start, tf.float64))
  optimizer = tf.keras.optimizers.Adam(lr)
  n = matcher.num_pixels
  low, high = tf.constant(low, tf.float64), tf.constant(high, tf.float64)
  best = (start, math.inf)
  for _ in range(iterations):
    value, gradient = matcher.value_and_gradient(tf.convert_to_tensor(flat))
    if float(value) < best[1]:
      best = (flat.numpy().astype(np.float64), float(value))
    optimizer.apply_gradients([(gradient, flat)])
    flat.assign(tf.concat([tf.clip_by_value(flat[:n], low, high), flat[n:]],
                          0))
  value, _ = matcher.value_and_gradient(tf.convert_to_tensor(flat))
  if float(value) < best[1]:
    best = (flat.numpy().astype(np.float64), float(value))
  return best


# ---------------------------------------------------------------------------
# Image quality.


def to_unit_range(images: np.ndarray, mean: Sequence[float],
                  std: Sequence[float]) -> np.ndarray:
  """Normalised NHWC images back to [0, 1] (clipped)."""
  images = np.asarray(images, np.float64)
  return np.clip(images * np.asarray(std) + np.asarray(mean), 0.0, 1.0)


def psnr(a: np.ndarray, b: np.ndarray, cap: float = PSNR_CAP_DB
         ) -> np.ndarray:
  """Per image PSNR (dB) of NHWC images in [0, 1], capped at `cap`."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape or a.ndim != 4:
    raise ValueError(f'psnr needs two NHWC batches of one shape, got '
                     f'{a.shape} and {b.shape}')
  mse = np.mean(np.square(a - b), axis=(1, 2, 3))
  with np.errstate(divide='ignore'):
    values = 10.0 * np.log10(1.0 / mse)
  return np.minimum(values, cap)


def ssim(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Per image SSIM of NHWC images in [0, 1] (`tf.image.ssim`)."""
  return tf.image.ssim(tf.constant(a, tf.float32), tf.constant(b, tf.float32),
                       max_val=1.0).numpy().astype(np.float64)


def match_order(true: np.ndarray, reconstructed: np.ndarray) -> np.ndarray:
  """The permutation of `reconstructed` that best matches `true` image by
  image (highest total PSNR): DLG recovers a batch in any order."""
  n = len(true)
  if n == 1:
    return np.zeros(1, np.int64)
  scores = np.array([[psnr(true[i:i + 1], reconstructed[j:j + 1])[0]
                      for j in range(n)] for i in range(n)])
  _, columns = scipy.optimize.linear_sum_assignment(-scores)
  return columns
