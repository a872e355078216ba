"""Model inversion through FedCG's generator: from a feature to an image.

FedCG keeps E_i private but shares G_i, which client i trains so that
G_i(z, y) looks like E_i(x) for images x of class y. An honest-but-curious
server that wants client i's images can therefore try to
  1. get a feature: E_i(x) itself would be best (an upper bound: FedCG never
     sends it), or the generator's closest feature G_i(z*, y), z* fitted to
     E_i(x) (an upper bound on what G_i alone gives away), or a plain
     class-conditional G_i(z, y) (what the server can really compute);
  2. invert it with an extractor: the true E_i (an upper bound: private in
     FedCG, but what FedAvg shares), or a shadow extractor it trains itself
     on auxiliary images so that its features land where G_i's and C_i's
     do (`train_shadow_extractor`).
`invert_features` optimises images so that an extractor's features match a
target, with a total-variation prior (L-BFGS-B within the images' value
range, as the DLG attack in `dlg_tf`).

Everything here is plain TF on Keras networks (`training_tf.PartyNetworks`)
and numpy; `binaries/run_inversion_attack.py` wires it to a run's
checkpoints.
"""

import functools
import time

import attrs
import numpy as np
import tensorflow as tf

from fedcg_tff.algorithms import fedcg_tf
from fedcg_tff.algorithms import training_tf
from fedcg_tff.config import FedCGConfig
from fedcg_tff.models import model_weights
from fedcg_tff.privacy import dlg_tf
from fedcg_tff.privacy import dp


@attrs.define(frozen=True)
class InversionOptions:
  iterations: int = 300  # L-BFGS iterations of the image inversion.
  tv_weight: float = 0.01  # Weight of the total-variation prior.
  latent_iterations: int = 200  # L-BFGS iterations fitting z*.
  latent_restarts: int = 4  # Starting draws of z; the best fit is kept.
  seed: int = 0

  def validate(self) -> 'InversionOptions':
    for name in ('iterations', 'latent_iterations', 'latent_restarts'):
      if getattr(self, name) < 1:
        raise ValueError(f'{name} must be >= 1, got {getattr(self, name)}')
    if not (np.isfinite(self.tv_weight) and self.tv_weight >= 0):
      raise ValueError(f'tv_weight must be finite and >= 0, got '
                       f'{self.tv_weight}')
    return self


def total_variation(images):
  """Mean absolute difference of neighbouring pixels, per image."""
  dy = tf.abs(images[:, 1:, :, :] - images[:, :-1, :, :])
  dx = tf.abs(images[:, :, 1:, :] - images[:, :, :-1, :])
  return tf.reduce_mean(dy, [1, 2, 3]) + tf.reduce_mean(dx, [1, 2, 3])


def feature_mismatch(features, targets):
  """Per image ||f - t||^2 / ||t||^2: scale-free, so one prior weight fits
  every extractor and round."""
  features = tf.reshape(features, [tf.shape(features)[0], -1])
  targets = tf.reshape(targets, [tf.shape(targets)[0], -1])
  return (tf.reduce_sum(tf.square(features - targets), 1) /
          (tf.reduce_sum(tf.square(targets), 1) + 1e-12))


def _lbfgs(value_and_gradient, start: np.ndarray, iterations: int,
           bounds=None) -> tuple[np.ndarray, float]:
  flat, value = dlg_tf.minimize_lbfgs(value_and_gradient, start, iterations,
                                      bounds, tf.float32)
  return flat.astype(np.float32), value


@attrs.define(frozen=True)
class Inversion:
  images: np.ndarray  # Normalised NHWC, within the value range.
  mismatch: np.ndarray  # Per image feature mismatch of the result.
  seconds: float


class FeatureInverter:
  """Images x minimising feature_mismatch(E(x), target) + tv_weight *
  TV(x), one per target, from a seeded uniform start within `value_range`
  (the normalised images' bounds: per-channel lows and highs, as
  dlg_tf.input_range gives, or one low and high); E in inference mode.

  One traced objective per inverter, for every call: the attack inverts
  three targets through each extractor and assigns each round's extractors
  to one network in turn (`model_weights.assign(inverter.extractor, w)`),
  and tracing the objective anew for each call took most of its inversion
  time. The targets are an argument of the traced function, the weights
  the network's variables (read when the function runs)."""

  def __init__(self, extractor: tf.keras.Model, image_shape, value_range,
               options: InversionOptions):
    self.extractor = extractor
    self._image_shape = tuple(image_shape)
    self._value_range = value_range
    self._options = options
    tv_weight = options.tv_weight

    @tf.function
    def value_and_gradient(flat, targets):
      with tf.GradientTape() as tape:
        tape.watch(flat)
        images = tf.reshape(flat, [tf.shape(targets)[0], *image_shape])
        loss = tf.reduce_sum(
            feature_mismatch(extractor(images, training=False), targets) +
            tv_weight * total_variation(images))
      return loss, tape.gradient(loss, flat)

    self._value_and_gradient = value_and_gradient

  def __call__(self, targets) -> Inversion:
    started = time.monotonic()
    targets = np.asarray(targets, np.float32)
    if not np.all(np.isfinite(targets)):
      # L-BFGS would stop at its start and report that as a reconstruction.
      raise ValueError(
          f'invert_features: {np.sum(~np.isfinite(targets))} of the '
          f'{targets.size} target values are NaN or infinite (a network with '
          'non-finite weights, or a batch-norm variance below 0?)')
    targets = tf.constant(targets)
    shape = (int(targets.shape[0]), *self._image_shape)
    low, high = dlg_tf.pixel_bounds(self._value_range, shape)
    start = np.random.default_rng(self._options.seed).uniform(low, high)
    flat, _ = _lbfgs(lambda flat: self._value_and_gradient(flat, targets),
                     start, self._options.iterations, list(zip(low, high)))
    images = flat.reshape(shape)
    mismatch = feature_mismatch(self.extractor(images, training=False),
                                targets).numpy()
    return Inversion(images=images, mismatch=mismatch,
                     seconds=time.monotonic() - started)


def invert_features(extractor: tf.keras.Model, targets, image_shape,
                    value_range, options: InversionOptions) -> Inversion:
  """One inversion (`FeatureInverter`, traced for this call alone)."""
  return FeatureInverter(extractor, image_shape, value_range, options)(
      targets)


def fit_latent(generator: tf.keras.Model, targets, labels,
               options: InversionOptions) -> tuple[np.ndarray, np.ndarray]:
  """Per target feature t with label y, the z* minimising
  feature_mismatch(G(z, y), t) (best of `latent_restarts` seeded starts;
  G in inference mode). Returns (G(z*, y), its mismatch)."""
  targets = np.asarray(targets, np.float32)
  labels = np.asarray(labels, np.int32)
  noise_dim = int(generator.inputs[0].shape[-1])
  count = len(labels)
  rng = np.random.default_rng(options.seed + 1)
  best_features = np.zeros_like(targets)
  best = np.full(count, np.inf)
  labels_t, targets_t = tf.constant(labels), tf.constant(targets)

  @tf.function
  def value_and_gradient(flat):
    with tf.GradientTape() as tape:
      tape.watch(flat)
      z = tf.reshape(flat, [count, noise_dim])
      loss = tf.reduce_sum(feature_mismatch(
          generator([z, labels_t], training=False), targets_t))
    return loss, tape.gradient(loss, flat)

  for _ in range(options.latent_restarts):
    start = rng.standard_normal(count * noise_dim)
    flat, _ = _lbfgs(value_and_gradient, start, options.latent_iterations)
    features = generator([flat.reshape(count, noise_dim), labels],
                         training=False).numpy()
    mismatch = feature_mismatch(features, targets).numpy()
    better = mismatch < best
    best[better] = mismatch[better]
    best_features[better] = features[better]
  return best_features, best


def dp_server_view(model: tf.keras.Model, base, update, sigma: float,
                   clip: float) -> tuple:
  """What the server sees of one client's DP upload of `model`'s weights
  (DP-FedCG uploads updates): the broadcast `base` plus the update clipped
  to global norm `clip` and noised with std `sigma` (`dp.gaussian_mechanism`,
  TF's global random state), negative moving variances raised to 0 so the
  network runs (as the server does to the mean of the uploads)."""
  return model_weights.apply_update(
      model, base, dp.gaussian_mechanism(tuple(update), sigma, clip))


def sample_features(generator: tf.keras.Model, labels, seed: int
                    ) -> np.ndarray:
  """G(z, y) for seeded z ~ N(0, 1): what the server computes without any
  real feature."""
  labels = np.asarray(labels, np.int32)
  noise_dim = int(generator.inputs[0].shape[-1])
  z = np.random.default_rng(seed).standard_normal(
      (len(labels), noise_dim)).astype(np.float32)
  return generator([z, labels], training=False).numpy()


@attrs.define(frozen=True)
class ShadowTraining:
  epochs: int = 5
  batch_size: int = 32
  lr: float = 1e-3
  distill_weight: float = 1.0  # Weight of ||E_s(x) - G(z, y)||^2.
  seed: int = 0


def train_shadow_extractor(config: FedCGConfig, generator_weights,
                           classifier_weights, images: np.ndarray,
                           labels: np.ndarray, training: ShadowTraining
                           ) -> tuple:
  """The attacker's own extractor E_s: a fresh draw (its own seed, nothing
  of the client's) trained on labelled auxiliary images with the client's
  shared G and C frozen, by FedCG's stage-1 loss: cross-entropy of C(E_s(x))
  plus `distill_weight` * MSE(E_s(x), G(z, y)). That puts E_s's features
  where C reads them and where G draws them, i.e. in E_i's feature space as
  far as the shared networks reveal it. Returns E_s's weights."""
  return _shadow_trainer(config, training.lr, training.distill_weight,
                         tf.keras.backend.floatx())(
                             generator_weights, classifier_weights, images,
                             labels, training)


@functools.lru_cache(maxsize=4)
def _shadow_trainer(config: FedCGConfig, lr: float, distill_weight: float,
                    floatx: str) -> '_ShadowTrainer':
  """One trainer per setting (`floatx`: Keras' float type, part of what the
  networks are built with): an attack trains a shadow extractor for every
  round and auxiliary set (six calls in a two-round attack), and each call
  used to build its networks and trace its step anew (the tiny attack test
  took 55.0 s before, 52.1 s with the trainer reused; AMD EPYC)."""
  del floatx  # Only a cache key.
  return _ShadowTrainer(config, lr, distill_weight)


class _ShadowTrainer:
  """E, G and C, an Adam optimizer and the traced step, reused across calls:
  each call assigns its own starting weights and zeroes Adam's state (its
  step count and moments, which is what a fresh Adam starts from), so a
  call gives what a newly built trainer gives."""

  def __init__(self, config: FedCGConfig, lr: float, distill_weight: float):
    self.nets = nets = training_tf.PartyNetworks(
        config, ('extractor', 'classifier', 'generator'))
    self.config = config
    self.optimizer = optimizer = tf.keras.optimizers.Adam(lr)
    variables = nets.extractor.trainable_variables
    noise_dim = config.noise_dim

    @tf.function
    def step(x, y, step_seed):
      # Stateless draws: nothing here touches TF's global random state,
      # which would change the shuffles of datasets made later in the
      # process (binaries/run_inversion_attack.py replays the run's rounds).
      z = tf.random.stateless_normal([tf.shape(y)[0], noise_dim], step_seed)
      fake = nets.generator([z, y], training=False)
      with tf.GradientTape() as tape:
        features = nets.extractor(x, training=True)
        logits = nets.classifier(features, training=False)
        loss = (training_tf.cross_entropy(y, logits) + distill_weight *
                fedcg_tf.feature_distance('mse', features, fake))
      optimizer.apply_gradients(zip(tape.gradient(loss, variables),
                                    variables))
      return loss

    self.step = step

  def __call__(self, generator_weights, classifier_weights, images, labels,
               training: ShadowTraining) -> tuple:
    nets = self.nets
    model_weights.assign(nets.extractor, dlg_tf.stand_in_extractor(
        self.config, training.seed))
    model_weights.assign(nets.generator, generator_weights)
    model_weights.assign(nets.classifier, classifier_weights)
    # Empty before the first step: Adam makes its variables then.
    for v in self.optimizer.variables:
      v.assign(tf.zeros_like(v))
    images = np.asarray(images, np.float32)
    labels = np.asarray(labels, np.int32)
    rng = np.random.default_rng(training.seed)
    count = 0
    for _ in range(training.epochs):
      order = rng.permutation(len(labels))
      for start in range(0, len(labels), training.batch_size):
        batch = order[start:start + training.batch_size]
        self.step(tf.constant(images[batch]), tf.constant(labels[batch]),
                  tf.constant([training.seed, count], tf.int64))
        count += 1
    return tuple(np.asarray(v) for v in model_weights.values(nets.extractor))


def extractor_with(config: FedCGConfig, weights) -> tf.keras.Model:
  """A Keras extractor holding `weights`."""
  nets = training_tf.PartyNetworks(config, ('extractor',))
  model_weights.assign(nets.extractor, weights)
  return nets.extractor


def generator_with(config: FedCGConfig, weights) -> tf.keras.Model:
  nets = training_tf.PartyNetworks(config, ('generator',))
  model_weights.assign(nets.generator, weights)
  return nets.generator


def class_references(images01: np.ndarray, labels: np.ndarray,
                     reconstructions01: np.ndarray, wanted: np.ndarray
                     ) -> dict[str, np.ndarray]:
  """For reconstructions of classes `wanted` (images in [0, 1]): PSNR
  against the mean of the client's images of that class, and against the
  client's image of that class nearest to it (the best any of them
  matches)."""
  to_mean, to_nearest = [], []
  for recon, y in zip(reconstructions01, wanted):
    members = images01[labels == y]
    to_mean.append(dlg_tf.psnr(members.mean(0, keepdims=True),
                               recon[None])[0])
    to_nearest.append(float(np.max(dlg_tf.psnr(
        members, np.repeat(recon[None], len(members), 0)))))
  return {'psnr_class_mean': np.array(to_mean),
          'psnr_nearest': np.array(to_nearest)}
