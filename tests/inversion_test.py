"""Model inversion through the generator (privacy/inversion_tf.py). The
binary runs on run_fedcg_test.py's tiny FedCG run (one run for both)."""

import attrs
import numpy as np
import pytest
import tensorflow as tf

from fedcg_tff.algorithms import fedcg_tf
from fedcg_tff.algorithms import training_tf
from fedcg_tff.config import FedCGConfig
from fedcg_tff.models import model_weights
from fedcg_tff.privacy import dlg_tf
from fedcg_tff.privacy import inversion_tf as inv

CONFIG = FedCGConfig()
RANGE = (-1.0, 1.0)


def _smooth_images(count, seed):
  """Smooth random images in [-1, 1] (a TV prior suits them)."""
  rng = np.random.default_rng(seed)
  coarse = rng.uniform(-1, 1, (count, 8, 8, 1)).astype(np.float32)
  return tf.image.resize(coarse, (32, 32), 'bilinear').numpy()


def test_inversion_recovers_images_through_a_known_invertible_extractor():
  """A toy extractor that loses nothing (an over-complete linear conv): the
  inversion must give the images back; a random start alone scores low."""
  extractor = tf.keras.Sequential([
      tf.keras.Input((32, 32, 1)),
      tf.keras.layers.Conv2D(4, 3, padding='same',
                             kernel_initializer=tf.keras.initializers
                             .GlorotUniform(seed=1))])
  images = _smooth_images(3, 0)
  targets = extractor(images).numpy()
  options = inv.InversionOptions(iterations=300, tv_weight=1e-4, seed=0)
  result = inv.invert_features(extractor, targets, (32, 32, 1), RANGE,
                               options)
  to01 = lambda x: (np.asarray(x) + 1) / 2
  psnr = dlg_tf.psnr(to01(images), to01(result.images))
  assert np.all(psnr > 30), psnr
  assert np.all(result.mismatch < 1e-3)
  assert result.images.min() >= -1 and result.images.max() <= 1
  # The starting point (what the optimiser got for free) is far off.
  start = inv.invert_features(
      extractor, targets, (32, 32, 1), RANGE,
      inv.InversionOptions(iterations=1, tv_weight=1e-4, seed=0))
  assert np.all(dlg_tf.psnr(to01(images), to01(start.images)) < 15)


def test_one_inverter_serves_several_extractors_traced_once():
  """The attack assigns each extractor's weights to one inverter's network:
  each call gives what an inversion through that extractor alone gives,
  bit for bit, its objective is the feature mismatch plus the TV prior
  through the weights assigned (batch-norm statistics included), and it is
  traced once for all of them."""
  def extractor(seed):
    model = tf.keras.Sequential([
        tf.keras.Input((8, 8, 1)),
        tf.keras.layers.Conv2D(3, 3, kernel_initializer=tf.keras.initializers
                               .GlorotUniform(seed=seed)),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.Activation('sigmoid')])
    rng = np.random.default_rng(seed)
    bn = model.layers[1]
    bn.moving_mean.assign(rng.normal(size=3).astype(np.float32))
    bn.moving_variance.assign(rng.uniform(0.5, 2, 3).astype(np.float32))
    return model
  a, b = extractor(1), extractor(2)
  images = _smooth_images(2, 3)[:, :8, :8]
  options = inv.InversionOptions(iterations=15, tv_weight=1e-3, seed=4)
  inverter = inv.FeatureInverter(extractor(1), (8, 8, 1), RANGE, options)
  flat = tf.constant(np.random.default_rng(5).uniform(-1, 1, 128),
                     tf.float32)
  x = tf.reshape(flat, (2, 8, 8, 1))
  for model in (a, b, a):
    model_weights.assign(inverter.extractor, model_weights.values(model))
    for target in (model(images).numpy(), b(images[::-1]).numpy()):
      got = inverter(target)
      alone = inv.invert_features(model, target, (8, 8, 1), RANGE, options)
      np.testing.assert_array_equal(got.images, alone.images)
      np.testing.assert_array_equal(got.mismatch, alone.mismatch)
      value, _ = inverter._value_and_gradient(flat, tf.constant(target))
      expected = tf.reduce_sum(
          inv.feature_mismatch(model(x, training=False), target) +
          1e-3 * inv.total_variation(x))
      np.testing.assert_allclose(float(value), float(expected), rtol=1e-6)
  assert inverter._value_and_gradient.experimental_get_tracing_count() == 1


def test_inversion_keeps_each_channel_in_its_own_range():
  """Colour tasks' normalised ranges differ per channel (input_range): each
  channel's values start and stay within its own bounds."""
  extractor = tf.keras.Sequential([
      tf.keras.Input((8, 8, 3)),
      tf.keras.layers.Conv2D(4, 3, kernel_initializer=tf.keras.initializers
                             .GlorotUniform(seed=1))])
  targets = extractor(np.full((2, 8, 8, 3), 10.0, np.float32)).numpy()
  low, high = dlg_tf.input_range((0.2, 0.5, 0.8), (0.1, 0.3, 0.2))
  for iterations in (1, 20):  # The start, and where the optimiser went.
    images = inv.invert_features(
        extractor, targets, (8, 8, 3), (low, high),
        inv.InversionOptions(iterations=iterations, tv_weight=0.0,
                             seed=0)).images
    per_channel = images.reshape(-1, 3)
    assert np.all(per_channel >= low - 1e-6), per_channel.min(0)
    assert np.all(per_channel <= high + 1e-6), per_channel.max(0)
  # Pulled towards 10, above every high: channels sit at their own bound.
  np.testing.assert_allclose(per_channel.max(0), high, rtol=1e-5)


def test_inversion_starts_each_channel_uniform_in_its_own_range(
    monkeypatch):
  """The optimiser's start and box (what L-BFGS-B would otherwise clip
  silently): per value, its channel's low and high."""
  low, high = (-1.0, 0.0, 2.0), (-0.5, 3.0, 2.5)
  flat_low, flat_high = dlg_tf.pixel_bounds((low, high), (2, 4, 4, 3))
  np.testing.assert_array_equal(flat_low.reshape(-1, 3),
                                np.tile(low, (32, 1)))
  np.testing.assert_array_equal(flat_high.reshape(-1, 3),
                                np.tile(high, (32, 1)))
  seen = {}

  def lbfgs(value_and_gradient, start, iterations, bounds):
    seen.update(start=start, bounds=bounds)
    return start.astype(np.float32), 0.0

  monkeypatch.setattr(inv, '_lbfgs', lbfgs)
  extractor = tf.keras.Sequential([tf.keras.Input((4, 4, 3)),
                                   tf.keras.layers.Flatten()])
  inv.invert_features(extractor, np.zeros((2, 48), np.float32), (4, 4, 3),
                      (low, high), inv.InversionOptions(iterations=1, seed=0))
  start = seen['start'].reshape(-1, 3)
  assert np.all(start >= low) and np.all(start <= high)
  # Spread over each channel's range, not a shared or a scalar one.
  assert np.all(start.max(0) - start.min(0) > 0.5 * (np.array(high) -
                                                     np.array(low)))
  assert seen['bounds'] == list(zip(flat_low, flat_high))


def test_inversion_refuses_non_finite_targets():
  """A NaN target (a generator whose noised batch-norm variance went
  negative) gives no reconstruction: the optimiser would return its start."""
  extractor = tf.keras.Sequential([tf.keras.Input((8, 8, 1)),
                                   tf.keras.layers.Conv2D(2, 3)])
  targets = np.zeros((2, 6, 6, 2), np.float32)
  targets[1, 0, 0, 1] = np.nan
  with pytest.raises(ValueError, match='1 of the 144 target values'):
    inv.invert_features(extractor, targets, (8, 8, 1), (-1.0, 1.0),
                        inv.InversionOptions(iterations=1, seed=0))


def test_total_variation_is_zero_on_flat_images_and_grows_with_edges():
  flat = np.zeros((1, 8, 8, 1), np.float32)
  edge = flat.copy()
  edge[:, :, 4:] = 1.0
  assert float(inv.total_variation(flat)[0]) == 0.0
  assert float(inv.total_variation(edge)[0]) == pytest.approx(8 / 56)


def test_fitted_latent_matches_a_feature_the_generator_can_make():
  """z* fitted to G(z0, y) reproduces it far better than a random z."""
  generator = inv.generator_with(
      CONFIG, fedcg_tf.initial_server_state(CONFIG, ()).generator)
  labels = np.array([1, 7], np.int32)
  targets = inv.sample_features(generator, labels, seed=5)
  fitted, mismatch = inv.fit_latent(
      generator, targets, labels,
      inv.InversionOptions(latent_iterations=100, latent_restarts=2))
  random = inv.feature_mismatch(
      inv.sample_features(generator, labels, seed=6), targets).numpy()
  assert np.all(mismatch < 0.1 * random), (mismatch, random)
  np.testing.assert_allclose(
      inv.feature_mismatch(fitted, targets).numpy(), mismatch, rtol=1e-4)


def test_fitted_latent_keeps_each_targets_best_restart(monkeypatch):
  """Each target keeps the restart that fits it best, on its own: with the
  optimiser replaced by one that returns its (seeded) start, the result is
  the element-wise best of G at the starts."""
  generator = inv.generator_with(
      CONFIG, fedcg_tf.initial_server_state(CONFIG, ()).generator)
  labels = np.arange(8, dtype=np.int32)
  targets = inv.sample_features(generator, labels, seed=5)
  monkeypatch.setattr(inv, '_lbfgs', lambda fn, start, iterations: (start, 0))
  options = inv.InversionOptions(latent_restarts=3, seed=0)
  fitted, mismatch = inv.fit_latent(generator, targets, labels, options)
  rng = np.random.default_rng(options.seed + 1)
  per_start = []
  for _ in range(3):
    z = rng.standard_normal((8, 100)).astype(np.float32)
    features = generator([z, labels], training=False).numpy()
    per_start.append((inv.feature_mismatch(features, targets).numpy(),
                      features))
  errors = np.stack([m for m, _ in per_start])
  assert len(set(np.argmin(errors, axis=0).tolist())) > 1  # Mixed winners.
  np.testing.assert_allclose(mismatch, errors.min(axis=0), rtol=1e-5)
  for i, k in enumerate(np.argmin(errors, axis=0)):
    np.testing.assert_allclose(fitted[i], per_start[k][1][i], atol=1e-5)


def test_dp_server_view_clips_then_noises_the_update():
  """Under DP-FedCG the attack sees G_g plus the client's update clipped to
  the clip's global norm and noised with std sigma: the noise is measured
  without clipping, the clip without noise."""
  templates = training_tf.InitialNetworks(CONFIG, ('generator',))
  model = templates.model('generator')
  base = templates.initial_weights('generator')
  update = tuple(tf.random.stateless_normal(w.shape, [3, i]) * 0.01
                 for i, w in enumerate(base))
  variances = [i for i, w in enumerate(model.weights)
               if 'moving_variance' in w.name]
  tf.random.set_seed(0)
  noisy = inv.dp_server_view(model, base, update, 0.05, 1e9)
  noise = np.concatenate([(n - b - u).numpy().ravel() for i, (n, b, u) in
                          enumerate(zip(noisy, base, update))
                          if i not in variances])
  assert np.std(noise) == pytest.approx(0.05, rel=0.02)
  clipped = inv.dp_server_view(model, base, update, 1e-9, 0.1)
  moved = np.sqrt(sum(np.sum(np.square((c - b).numpy()))
                      for c, b in zip(clipped, base)))
  assert moved == pytest.approx(0.1, rel=1e-3)
  # A moving variance the noised update would make negative is raised to 0.
  down = tuple(tf.fill(w.shape, -2.0) if i in variances else tf.zeros_like(w)
               for i, w in enumerate(base))
  raised = inv.dp_server_view(model, base, down, 1e-9, 1e9)
  assert variances
  for i in variances:
    np.testing.assert_array_equal(raised[i].numpy(), 0.0)


def test_shadow_extractor_uses_only_the_shared_networks_and_its_own_draw():
  """The shadow rows' extractor: the attacker's own initial draw, trained
  with the client's G and C; no client extractor weight goes in or comes
  out (checked like the DLG threat models)."""
  config = FedCGConfig(seed=1)
  client = fedcg_tf.initial_client_state(config, 3)
  server = fedcg_tf.initial_server_state(config, ())
  images = _smooth_images(16, 1)
  labels = np.arange(16, dtype=np.int32) % 10
  attacker_seed = config.seed + dlg_tf.STAND_IN_SEED_OFFSET
  training = inv.ShadowTraining(epochs=1, batch_size=8, seed=attacker_seed)
  shadow = inv.train_shadow_extractor(config, server.generator,
                                      server.classifier, images, labels,
                                      training)
  own_draw = dlg_tf.stand_in_extractor(config, attacker_seed)
  # Under shared init the client's E_0 is the run seed's public draw; the
  # attacker starts from its own, so the shadow is neither.
  public = dlg_tf.stand_in_extractor(config, config.seed)
  assert all(np.array_equal(a, b) for a, b in zip(client.extractor, public))
  kernels = [i for i, w in enumerate(own_draw) if w.ndim >= 2]
  for i in kernels:
    assert not np.allclose(shadow[i], client.extractor[i], atol=1e-3)
    assert not np.array_equal(shadow[i], own_draw[i])  # It trained,
    # ... from its own draw (a few Adam steps move each weight <= 2 lr).
    assert np.max(np.abs(shadow[i] - own_draw[i])) < 2 * training.lr * 2 + 1e-6
  # The shared networks steer it: another G and C give another shadow.
  other = fedcg_tf.initial_server_state(FedCGConfig(seed=9), ())
  shadow_other = inv.train_shadow_extractor(config, other.generator,
                                            other.classifier, images,
                                            labels, training)
  assert not np.allclose(shadow[kernels[0]], shadow_other[kernels[0]])
  # G alone steers it through the distillation term, and only through it.
  other_g = lambda t: inv.train_shadow_extractor(
      config, other.generator, server.classifier, images, labels, t)
  assert not np.allclose(shadow[kernels[0]], other_g(training)[kernels[0]])
  plain = attrs.evolve(training, distill_weight=0.0)
  for a, b in zip(inv.train_shadow_extractor(config, server.generator,
                                             server.classifier, images,
                                             labels, plain), other_g(plain)):
    np.testing.assert_array_equal(a, b)
  # That second call reused the first's networks, optimizer and traced
  # step: it gives what a newly built trainer gives (a trainer that kept
  # the first call's Adam moments or E_s fails this).
  assert inv._shadow_trainer.cache_info().hits >= 1  # pylint: disable=protected-access
  inv._shadow_trainer.cache_clear()  # pylint: disable=protected-access
  fresh = inv.train_shadow_extractor(config, other.generator,
                                     other.classifier, images, labels,
                                     training)
  for a, b in zip(shadow_other, fresh):
    np.testing.assert_array_equal(a, b)


def test_class_references_score_against_the_class_mean_and_nearest():
  images01 = np.stack([np.full((4, 4, 1), v) for v in (0.0, 0.2, 1.0)])
  labels = np.array([0, 0, 1])
  recon = np.full((1, 4, 4, 1), 0.2)
  refs = inv.class_references(images01, labels, recon, np.array([0]))
  assert refs['psnr_nearest'][0] == dlg_tf.PSNR_CAP_DB  # Equals image 2.
  assert refs['psnr_class_mean'][0] == pytest.approx(
      10 * np.log10(1 / 0.1**2))
