"""The plain-TensorFlow FedCG pieces, eagerly, without TFF."""

import dataclasses
import functools

import attrs

import numpy as np
import pytest
import tensorflow as tf

from fedcg_tff.algorithms import fedcg_tf
from fedcg_tff.algorithms import training_tf
from fedcg_tff.config import FedCGConfig
from fedcg_tff.models import layers
from fedcg_tff.models import model_weights
from tasks import image_task

TINY = FedCGConfig(batch_size=8, local_epochs=1, gan_epochs=1,
                   server_epochs=1, server_steps_per_epoch=4)


def _batch(n=16, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 32, 32, 1)).astype(np.float32)
  y = rng.integers(0, 10, n).astype(np.int32)
  return x, y


def _dataset(n=16, batch=8, seed=0):
  return tf.data.Dataset.from_tensor_slices(_batch(n, seed)).batch(batch)


def _nets(config, seed=3):
  nets = fedcg_tf.PartyNetworks(config)
  s = tf.constant(seed, tf.int64)
  for m in (nets.extractor, nets.classifier, nets.generator,
            nets.discriminator):
    model_weights.assign(m, model_weights.sample_initial(m, s))
  return nets


@pytest.mark.parametrize('round_num,p', [
    (0, 0.0), (5, 0.1), (25, 0.5), (50, 1.0), (80, 1.0)])  # p capped at 1.
def test_gamma_ramp(round_num, p):
  # float32's rounding is far below the 9e-5 an uncapped p = 1.6 would add.
  assert float(fedcg_tf.gamma_ramp(round_num, 50)) == pytest.approx(
      2 / (1 + np.exp(-10 * p)) - 1, rel=1e-6, abs=1e-7)


def test_feature_distances():
  f = tf.random.stateless_uniform([4, 5, 5, 16], [8, 0])
  assert float(fedcg_tf.feature_distance('mse', f, f)) == 0.0
  assert float(fedcg_tf.feature_distance('cos', f, f)) == pytest.approx(
      0.0, abs=1e-6)
  assert float(fedcg_tf.feature_distance('cos', f, 3.0 * f)) == pytest.approx(
      0.0, abs=1e-6)  # Scale-invariant.
  g = f + 0.5
  assert float(fedcg_tf.feature_distance('mse', f, g)) == pytest.approx(0.25)
  assert float(fedcg_tf.feature_distance('cos', f, -f)) == pytest.approx(2.0)
  assert float(fedcg_tf.feature_distance('none', f, g)) == 0.0
  with pytest.raises(ValueError):
    fedcg_tf.feature_distance('l1', f, g)


def _classification_loss(nets, x, y):
  logits = nets.classifier(nets.extractor(x, training=False), training=False)
  return float(tf.reduce_mean(
      tf.keras.losses.sparse_categorical_crossentropy(y, logits,
                                                      from_logits=True)))


@pytest.mark.parametrize('distance', ['mse', 'cos', 'none'])
def test_stage1_lowers_classification_loss(distance):
  config = dataclasses.replace(TINY, local_epochs=40, lr=3e-3,
                               distance=distance)
  nets = _nets(config)
  x, y = _batch(16)
  ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
  state = fedcg_tf.initial_client_state(config, 1)
  g_before = [v.numpy().copy() for v in nets.generator.weights]
  before = _classification_loss(nets, x, y)

  @tf.function
  def run():
    return fedcg_tf.train_classification(
        nets, state.classification_optimizer, ds, tf.constant(0.5),
        tf.constant(1, tf.int64), tf.constant(3))

  opt_state, cls_loss, dist_loss = run()
  after = _classification_loss(nets, x, y)
  assert after < 0.85 * before, (before, after)
  assert int(opt_state['step']) == 40 * 2
  assert float(cls_loss) > 0
  assert (float(dist_loss) == 0.0) == (distance == 'none')
  for a, b in zip(g_before, nets.generator.weights):  # G stays frozen.
    np.testing.assert_array_equal(a, b.numpy())


def _client_task():
  """One client of 52 random 28x28 images on the real client pipeline
  (reshuffled and flipped each pass): batches of 8 end with a short one."""
  rng = np.random.default_rng(4)
  images = rng.integers(0, 256, (52, 28, 28, 1)).astype(np.uint8)
  split = image_task.ClientSplit((images, rng.integers(0, 10, 52)),
                                 (images[:4], np.zeros(4, np.int64)),
                                 (images[:4], np.zeros(4, np.int64)))
  return image_task.FederatedImageTask('t', (split,), 10, 1, seed=5,
                                       mean=(0.5,), std=(0.5,))


def _unknown_image_size(dataset):
  return dataset.map(lambda x, y: (tf.ensure_shape(
      tf.py_function(tf.identity, [x], tf.float32), [None, None, None, 1]), y))


@pytest.mark.parametrize('kind,chunk_examples,bitwise', [
    ('pipeline', 8, True), ('pipeline', 16, False),
    ('pipeline', training_tf.FROZEN_CHUNK_EXAMPLES, False),
    ('unknown image size', training_tf.FROZEN_CHUNK_EXAMPLES, True),
    ('fixed batch size', training_tf.FROZEN_CHUNK_EXAMPLES, True)])
def test_stage1_runs_g_in_chunks_with_each_steps_numbers(
    kind, chunk_examples, bitwise, monkeypatch):
  """Stage 1 runs G once for a chunk of steps (training_tf.
  FrozenNetworkLoss): E and C end as with G run in each step, bit for bit
  at one batch a call, to float rounding otherwise; on the real client
  pipeline (reshuffled and flipped each pass), 52 images in batches of 8,
  so that the last batch and the last chunk are short. Batches whose image
  size or batch size is not `[None, known]` run G in each step."""
  config = dataclasses.replace(TINY, local_epochs=3, lr=3e-3)
  task = _client_task()
  state = fedcg_tf.initial_client_state(config, 1)
  seed, round_num = tf.constant(7, tf.int64), tf.constant(3)

  def data():
    dataset = task.train_datasets(0, 8)[0]
    if kind == 'unknown image size':
      return _unknown_image_size(dataset)
    if kind == 'fixed batch size':
      return dataset.unbatch().batch(8, drop_remainder=True)
    return dataset

  def per_step(nets):
    def dist_loss(features, labels, step):
      z = training_tf.noise(seed, training_tf.NOISE_STREAM_CLS, round_num,
                            step, [tf.shape(labels)[0], config.noise_dim])
      targets = tf.stop_gradient(nets.generator([z, labels], training=False))
      return fedcg_tf.feature_distance(config.distance, features, targets)
    return training_tf.train_classifier(
        nets, state.classification_optimizer, data(), config.local_epochs,
        dist_loss, tf.constant(0.5))

  def chunked(nets):
    return fedcg_tf.train_classification(
        nets, state.classification_optimizer, data(), tf.constant(0.5), seed,
        round_num)

  monkeypatch.setattr(training_tf, 'FROZEN_CHUNK_EXAMPLES', chunk_examples)
  results = []
  for train in (per_step, chunked):
    nets = _nets(config)
    optimizer, cls_loss, dist_loss = tf.function(lambda: train(nets))()
    results.append([float(cls_loss), float(dist_loss),
                    int(optimizer['step'])] +
                   [w.numpy() for w in nets.extractor.weights +
                    nets.classifier.weights])
  assert results[0][2] == results[1][2] == 3 * (
      6 if kind == 'fixed batch size' else 7)
  assert float(results[0][1]) > 0
  for a, b in zip(*results):
    if bitwise:
      np.testing.assert_array_equal(a, b)
    else:
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('distance', ['mse', 'cos'])
def test_stage1_dist_term_pulls_features_to_generator(distance):
  # With a huge gamma, stage 1 must reduce the distance between E(x) and
  # G(z, y): the L_dist term has the right gradient.
  config = dataclasses.replace(TINY, local_epochs=30, lr=3e-3,
                               distance=distance)
  nets = _nets(config)
  x, y = _batch(16)
  ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
  state = fedcg_tf.initial_client_state(config, 1)
  z = tf.random.stateless_normal([16, 100], [1, 0])

  def dist():
    return float(fedcg_tf.feature_distance(
        distance, nets.extractor(x), nets.generator([z, y], training=False)))

  before = dist()
  tf.function(lambda: fedcg_tf.train_classification(
      nets, state.classification_optimizer, ds, tf.constant(100.0),
      tf.constant(1, tf.int64), tf.constant(0)))()
  assert dist() < 0.5 * before


def _one_gan_step(**config_changes):
  """One stage-2 step (one epoch over one batch of 8) from `_nets`' weights.

  Returns the networks after it, the batch (x, y), the step's noise z, the
  weights of E, G and D before it (lists of arrays, by network name) and
  train_gan's outputs.
  """
  config = dataclasses.replace(TINY, gan_epochs=1, **config_changes)
  nets = _nets(config)
  x, y = _batch(8)
  ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
  state = fedcg_tf.initial_client_state(config, 1)
  seed, round_num = tf.constant(1, tf.int64), tf.constant(0)
  before = {name: [v.numpy().copy() for v in getattr(nets, name).weights]
            for name in ('extractor', 'generator', 'discriminator')}
  outputs = tf.function(lambda: fedcg_tf.train_gan(
      nets, state.discriminator_optimizer, state.generator_optimizer, ds,
      seed, round_num))()
  z = training_tf.noise(seed, training_tf.NOISE_STREAM_GAN, round_num, 0,
                        [8, config.noise_dim])
  return nets, (x, tf.constant(y)), z, before, outputs


def test_stage2_discriminator_step_lowers_its_loss():
  # One stage-2 step: D is updated on E(x) as real and G(z) as fake. On
  # those same inputs the new D's loss must be lower than the old D's: D's
  # loss has the right sign. (One step, not the gap after 60 adversarial
  # epochs that this test used to check: that gap depends on the
  # trajectory, hence on the host's float rounding; it was +0.1 on an AVX2
  # host and -0.01 on an AVX-512 one.)
  nets, (x, y), z, before, (d_opt, g_opt, d_loss, g_loss) = _one_gan_step(
      lr=1e-4)
  d_after = [v.numpy().copy() for v in nets.discriminator.weights]
  bce = tf.keras.losses.BinaryCrossentropy(from_logits=True)

  def loss_of(d_weights):
    nets.generator.set_weights(before['generator'])
    nets.discriminator.set_weights(d_weights)
    real = nets.extractor(tf.constant(x), training=False)
    fake = nets.generator([z, y], training=True)
    d_real, d_fake = fedcg_tf.discriminate(nets.discriminator, real, fake, y)
    return float(bce(tf.ones_like(d_real), d_real) +
                 bce(tf.zeros_like(d_fake), d_fake))

  loss_before = loss_of(before['discriminator'])
  # The loss recomputed here is the one the step reported (same inputs).
  np.testing.assert_allclose(loss_before, float(d_loss), rtol=1e-5)
  # 1.46 -> 1.26 here. (At lr 3e-4 or 1e-3 Adam's first step, about lr
  # on every weight whatever its gradient, overshoots: the loss rises.)
  loss_after = loss_of(d_after)
  assert loss_after < loss_before - 0.05, (loss_before, loss_after)
  assert int(d_opt['step']) == 1 and int(g_opt['step']) == 1
  assert float(g_loss) > 0
  for a, b in zip(before['extractor'], nets.extractor.weights):  # Frozen.
    np.testing.assert_array_equal(a, b.numpy())


def test_stage2_generator_step_raises_discriminator_score():
  # One stage-2 step: D is updated, then G takes one step against the updated
  # D. Judged by that D (held fixed), the new G's output must look more real
  # than the old G's on the same noise: G's loss has the right sign.
  nets, (_, y), z, before, _ = _one_gan_step(lr=1e-3)
  g_after = [v.numpy().copy() for v in nets.generator.weights]
  d_after = [v.numpy().copy() for v in nets.discriminator.weights]

  def score(g_weights):
    nets.generator.set_weights(g_weights)
    nets.discriminator.set_weights(d_after)
    fake = nets.generator([z, y], training=True)
    return float(tf.reduce_mean(tf.sigmoid(
        nets.discriminator([fake, y], training=True))))

  assert score(g_after) > score(before['generator']) + 1e-3


def test_stage2_generator_moving_averages_as_the_original_two_passes():
  # The published code runs G in training mode twice per GAN step, for D's
  # step and again for G's, on the same (z, y) with unchanged weights: G's
  # batch-norm moving averages take two updates from one batch's
  # statistics. train_gan runs G once; its moving averages must still be
  # the two calls'.
  nets, (_, y), z, before, _ = _one_gan_step()
  moving = lambda: [v.numpy().copy() for v in nets.generator.weights
                    if 'moving' in v.name]
  after_step = moving()
  assert len(after_step) == 6  # Mean and variance of G's 3 batch norms.
  norms = [m for m in nets.generator.submodules
           if isinstance(m, tf.keras.layers.BatchNormalization)]
  assert [n.momentum for n in norms] == [layers.BN_MOMENTUM] * 3  # Restored.
  nets.generator.set_weights(before['generator'])
  nets.generator([z, y], training=True)
  once = moving()
  nets.generator([z, y], training=True)
  for got, twice, one in zip(after_step, moving(), once):
    np.testing.assert_allclose(got, twice, rtol=1e-5, atol=1e-7)
    assert np.abs(twice - one).max() > 1e-3  # The two differ: a real check.


def test_distillation_lowers_kl_on_fixed_noise():
  config = dataclasses.replace(TINY, batch_size=16, lr=1e-3)
  nets = _nets(config)
  z = tf.random.stateless_normal([16, 100], [4, 0])
  y = tf.constant(np.arange(16) % 10, tf.int32)
  teacher = tf.random.stateless_normal([16, 10], [5, 0]) * 3.0

  def kl():
    student = nets.classifier(nets.generator([z, y], training=False))
    return float(training_tf.kl_divergence(teacher, student))

  state = fedcg_tf.initial_server_state(config, ())
  before = kl()
  reps = 60  # the same batch, 60 steps
  opt_state, kls = tf.function(lambda: fedcg_tf.distill(
      nets, state.optimizer_state, tf.tile(z, [reps, 1]),
      tf.tile(y, [reps]), tf.tile(teacher, [reps, 1])))()
  assert kls.shape == (reps,)
  assert int(opt_state['step']) == reps
  assert kl() < 0.5 * before, (before, kl())
  assert float(kls[-1]) < float(kls[0])


def test_kl_divergence_matches_definition():
  t = tf.constant([[1.0, 2.0, 0.5]])
  s = tf.constant([[0.0, 1.0, 1.0]])
  p = tf.nn.softmax(t).numpy()[0]
  q = tf.nn.softmax(s).numpy()[0]
  assert float(training_tf.kl_divergence(t, s)) == pytest.approx(
      float(np.sum(p * np.log(p / q))), rel=1e-5)
  assert float(training_tf.kl_divergence(t, t)) == pytest.approx(0.0, abs=1e-6)


def test_distillation_inputs_seeded_by_round():
  z0, y0 = fedcg_tf.distillation_inputs(TINY, 0)
  z0b, _ = fedcg_tf.distillation_inputs(TINY, 0)
  z1, y1 = fedcg_tf.distillation_inputs(TINY, 1)
  assert z0.shape == (TINY.distill_samples, 100)
  assert y0.dtype == tf.int32
  np.testing.assert_array_equal(z0.numpy(), z0b.numpy())
  assert not np.allclose(z0.numpy(), z1.numpy())
  # Under replay_draws (the published code's reseeding) every round is
  # round 0's.
  replay = dataclasses.replace(TINY, replay_draws=True)
  np.testing.assert_array_equal(
      fedcg_tf.distillation_inputs(replay, 1)[0].numpy(), z0.numpy())
  big = dataclasses.replace(TINY, server_steps_per_epoch=500)
  _, labels = fedcg_tf.distillation_inputs(big, 0)
  assert set(np.unique(labels.numpy())) == set(range(10))


def test_chunked_logits_match_one_pass():
  nets = _nets(TINY)
  z = tf.random.stateless_normal([10, 100], [6, 0])
  y = tf.constant(np.arange(10), tf.int32)
  full = nets.classifier(nets.generator([z, y], training=False))
  chunked = training_tf.chunked_logits(
      lambda z, y: nets.classifier(nets.generator([z, y], training=False)),
      (z, y), 10, chunk=3)
  np.testing.assert_allclose(chunked.numpy(), full.numpy(), atol=1e-5)


def test_client_update_changes_state_and_keeps_seed():
  nets = fedcg_tf.PartyNetworks(TINY)
  server = fedcg_tf.initial_server_state(TINY, ())
  state = fedcg_tf.initial_client_state(TINY, 11)
  z, y = fedcg_tf.distillation_inputs(TINY, 0)
  message = fedcg_tf.ServerMessage(server.generator, server.classifier,
                                   tf.constant(0), z, y)
  message = attrs.evolve(message, round_num=tf.constant(5))
  out = fedcg_tf.client_update(nets, message, state, _dataset(24))
  assert int(out.metrics.num_examples) == 24 and float(out.weight) == 24.0
  assert float(out.metrics.gamma) == pytest.approx(0.4621, abs=1e-4)
  assert out.upload.teacher_logits.shape == (TINY.distill_samples, 10)
  for name in ('extractor', 'discriminator'):
    before, after = getattr(state, name), getattr(out.state, name)
    assert any(not np.allclose(a.numpy(), b.numpy())
               for a, b in zip(before, after)), name
  assert int(out.state.seed) == 11
  # The uploaded classifier is the client's trained C_i, kept for evaluation.
  for a, b in zip(out.upload.classifier, out.state.classifier):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  assert not np.allclose(out.upload.classifier[0].numpy(),
                         server.classifier[0].numpy())


def test_client_update_reads_the_same_passes_with_g_in_chunks(monkeypatch):
  """A client's round counts its examples in one pass over its data, then
  trains: with stage 1 read in chunks (a `ragged_batch` over the same
  dataset) each epoch must still get the pass it got before, not replay
  the counting pass's order. The round's E and C with G on 8 examples a
  call (one batch: as before the chunks) and on 512 agree to float
  rounding, on the real client pipeline (reshuffled each pass)."""
  config = dataclasses.replace(TINY, local_epochs=2)
  task = _client_task()
  server = fedcg_tf.initial_server_state(config, ())
  z, y = fedcg_tf.distillation_inputs(config, 0)
  message = fedcg_tf.ServerMessage(server.generator, server.classifier,
                                   tf.constant(30), z, y)
  state = fedcg_tf.initial_client_state(config, 11)
  weights = []
  for chunk in (8, 512):
    monkeypatch.setattr(training_tf, 'FROZEN_CHUNK_EXAMPLES', chunk)
    out = fedcg_tf.client_update(fedcg_tf.PartyNetworks(config), message,
                                 state, task.train_datasets(3, 8)[0])
    weights.append([w.numpy() for w in out.state.extractor +
                    out.state.classifier])
  for a, b in zip(*weights):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize('distance,rounds,replay', [
    ('none', (2, 5), True),  # Stage 2's noise: other seed, other round.
    ('mse', (3, 3), True),  # Stage 1's noise too (the same gamma).
    ('none', (2, 5), False),  # Fresh draws: the two rounds differ.
])
def test_replay_draws_gives_every_client_and_round_the_same_noise(
    distance, rounds, replay):
  # Clients with seeds 11 and 12 start from the same networks (shared init)
  # on the same data. Under replay_draws their noise is the run's, round
  # 0's: they compute the same G. With fresh draws they do not.
  config = dataclasses.replace(TINY, distance=distance, replay_draws=replay)
  server = fedcg_tf.initial_server_state(config, ())
  generators = []
  # One trace for both clients (the second call runs the first's graph, on
  # the same networks, as TFF runs one client computation for every
  # client): client_update loads every weight and Adam moment it reads from
  # its arguments. The second client's G, computed so, is bit for bit what
  # fresh networks give (checked when this was written); the first
  # client's again after the second's, checked below, shows that nothing
  # carries over from one call to the next.
  update = tf.function(functools.partial(fedcg_tf.client_update,
                                         fedcg_tf.PartyNetworks(config)))
  for seed, round_num in zip((11, 12, 11), (*rounds, rounds[0])):
    z, y = fedcg_tf.distillation_inputs(TINY, 0)
    message = fedcg_tf.ServerMessage(server.generator, server.classifier,
                                     tf.constant(round_num), z, y)
    out = update(message, fedcg_tf.initial_client_state(config, seed),
                 _dataset(16))
    generators.append([w.numpy() for w in out.upload.generator])
  same = all(np.array_equal(a, b) for a, b in zip(*generators[:2]))
  assert same == replay
  for a, b in zip(generators[0], generators[2]):
    np.testing.assert_array_equal(a, b)


def test_server_update_advances_round():
  nets = fedcg_tf.PartyNetworks(TINY)
  state = fedcg_tf.initial_server_state(TINY, ())
  state = fedcg_tf.ServerState(state.generator, state.classifier,
                               state.optimizer_state, (), tf.constant(5))
  z, y = fedcg_tf.distillation_inputs(TINY, 5)
  teacher = tf.random.stateless_normal([TINY.distill_samples, 10], [7, 0])
  upload = fedcg_tf.ClientUpload(state.generator, state.classifier, teacher)
  new, metrics = fedcg_tf.server_update(nets, state, (), upload, z, y)
  assert int(new.round_num) == 6
  assert float(metrics.distill_kl) > 0
  assert int(new.optimizer_state['step']) == TINY.distill_steps
  # Distilling moves the student towards the teacher: the first step's KL
  # is above the last's, the mean between them (3 steps).
  first, last = float(metrics.distill_kl_first), float(metrics.distill_kl_last)
  assert first > float(metrics.distill_kl) > last


def _draw(config, model, seed):
  """Initial weights of `model` ('generator', ...) from another `seed`."""
  nets = fedcg_tf.PartyNetworks(config, (model,))
  return model_weights.sample_initial(nets.model(model),
                                      tf.constant(seed, tf.int64))


def test_server_distils_from_the_aggregate_not_its_old_state():
  """The server's new (G_g, C_g) is the distillation started from the
  aggregated upload: exactly `distill` run from it. A server step that
  distilled from its previous state, or ignored the aggregate, fails."""
  config = dataclasses.replace(TINY, server_steps_per_epoch=2)
  state = fedcg_tf.initial_server_state(config, ())
  z, y = fedcg_tf.distillation_inputs(config, 0)
  teacher = tf.random.stateless_normal([config.distill_samples, 10], [1, 2])
  averaged = fedcg_tf.ClientUpload(_draw(config, 'generator', 77),
                                   _draw(config, 'classifier', 78), teacher)
  new, _ = fedcg_tf.server_update(fedcg_tf.PartyNetworks(config), state, (),
                                  averaged, z, y)
  nets = fedcg_tf.PartyNetworks(config, fedcg_tf.SERVER_NETWORKS)
  model_weights.assign(nets.generator, averaged.generator)
  model_weights.assign(nets.classifier, averaged.classifier)
  tf.function(lambda: fedcg_tf.distill(nets, state.optimizer_state, z, y,
                                       teacher))()
  for name in ('generator', 'classifier'):
    expected = model_weights.values(nets.model(name))
    for got, want in zip(getattr(new, name), expected):
      np.testing.assert_array_equal(got.numpy(), want.numpy())
  # Two steps of lr 3e-4 stay near the aggregate, far from the old state.
  assert np.allclose(new.classifier[0], averaged.classifier[0], atol=1e-2)
  assert not np.allclose(new.classifier[0], state.classifier[0], atol=1e-2)


def test_client_starts_its_round_from_the_broadcast_g_and_c():
  """With a learning rate too small to move them, a client's uploaded G and
  C equal the broadcast G_g and C_g (not its state's C nor a fresh G), and
  its teacher logits are C_g(G_g(z, y)). A client that ignored the message
  fails."""
  config = dataclasses.replace(TINY, lr=1e-12, weight_decay=0.0)
  state = fedcg_tf.initial_client_state(config, 11)
  z, y = fedcg_tf.distillation_inputs(config, 0)
  message = fedcg_tf.ServerMessage(_draw(config, 'generator', 55),
                                   _draw(config, 'classifier', 56),
                                   tf.constant(0), z, y)
  out = fedcg_tf.client_update(fedcg_tf.PartyNetworks(config), message, state,
                               _dataset(16))
  nets = fedcg_tf.PartyNetworks(config, fedcg_tf.SERVER_NETWORKS)
  for name in ('generator', 'classifier'):
    # Trainable weights only: stage 2 moves G's batch-norm statistics.
    trainable = [v.trainable for v in nets.model(name).weights]
    sent = getattr(message, name)
    for got, want, t in zip(getattr(out.upload, name), sent, trainable):
      if t:
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)
  assert not np.allclose(out.upload.classifier[0], state.classifier[0])
  model_weights.assign(nets.generator, out.upload.generator)
  model_weights.assign(nets.classifier, out.upload.classifier)
  np.testing.assert_allclose(
      out.upload.teacher_logits.numpy(),
      fedcg_tf.generated_logits(nets.generator, nets.classifier, z,
                                y).numpy(), atol=1e-5)



def _moving_variances(model: tf.keras.Model) -> list[bool]:
  """Per weight of `model` (as `model_weights.values` orders them): is it a
  batch-norm moving variance? (By name, not as the library finds them.)"""
  return ['moving_variance' in w.name for w in model.weights]


def test_server_update_keeps_noised_batch_norm_variances_valid():
  """DP noise in the mean update can push a moving variance below 0, and
  inference then divides by the square root of a negative number (NaN):
  the server clamps every moving variance at 0 and nothing else, then
  distils as from any aggregate."""
  config = dataclasses.replace(TINY, server_steps_per_epoch=1)
  state = fedcg_tf.initial_server_state(config, ())
  z, y = fedcg_tf.distillation_inputs(config, 0)
  teacher = tf.random.stateless_normal([config.distill_samples, 10], [1, 2])
  # An update of -2 everywhere: every moving variance (1 at the start)
  # would be -1, every moving mean -2, every gamma -1.
  down = lambda weights: tuple(tf.fill(tf.shape(w), -2.0) for w in weights)
  update = fedcg_tf.ClientUpload(down(state.generator),
                                 down(state.classifier), teacher)
  new, _ = fedcg_tf.server_update(fedcg_tf.PartyNetworks(config), state, (),
                                  update, z, y, upload_updates=True)
  # The oracle: old + update, variances (found by name) set to 0, distilled.
  nets = fedcg_tf.PartyNetworks(config, fedcg_tf.SERVER_NETWORKS)
  for name in ('generator', 'classifier'):
    is_variance = _moving_variances(nets.model(name))
    # The check looks at something: G has batch norm (C has none).
    assert any(is_variance) == (name == 'generator'), name
    model_weights.assign(nets.model(name), [
        tf.zeros_like(w) if variance else w - 2.0
        for w, variance in zip(getattr(state, name), is_variance)])
  tf.function(lambda: fedcg_tf.distill(nets, state.optimizer_state, z, y,
                                       teacher))()
  for name in ('generator', 'classifier'):
    for got, want in zip(getattr(new, name),
                         model_weights.values(nets.model(name))):
      np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5,
                                 atol=1e-5, err_msg=name)
  model_weights.assign(nets.generator, new.generator)
  assert np.all(np.isfinite(nets.generator([z, y], training=False).numpy()))


def test_variance_clamp_finds_the_variances_of_networks_built_in_a_graph():
  """TFF builds the server's networks inside its own `tf.Graph`, where
  Keras 2.14 builds its layers from other base classes: the clamp must
  still find G's moving variances there (and nothing else)."""
  with tf.Graph().as_default():
    generator = fedcg_tf.PartyNetworks(TINY).model('generator')
    is_variance = _moving_variances(generator)
    assert sum(is_variance) >= 3
    old = [tf.ones_like(w) for w in generator.weights]
    delta = [tf.fill(tf.shape(w), -2.0) for w in generator.weights]
    applied = model_weights.apply_update(generator, old, delta)
    with tf.compat.v1.Session() as session:
      values = session.run(applied)
  for value, variance in zip(values, is_variance, strict=True):
    np.testing.assert_array_equal(value, 0.0 if variance else -1.0)


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
