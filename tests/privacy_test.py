"""Privacy analysis: the DLG attack, PSNR / SSIM, the threat models, the
Gaussian mechanism on both sides (attack and DP training) and its epsilon,
and the Table-2 binary end to end."""

import csv
import json
import math
import os

import numpy as np
import pytest
import tensorflow as tf

from fedcg_tff import names
from fedcg_tff.algorithms import baselines_process_tff
from fedcg_tff.algorithms import catalog
from fedcg_tff.config import FedCGConfig
from fedcg_tff.models import lenet
from fedcg_tff.models import model_weights
from fedcg_tff.privacy import dlg_tf
from fedcg_tff.privacy import dp
from fedcg_tff.privacy import secure_aggregation
from tests import binary_runs
from tests import fake_data
from tests.placement import tf_ops_by_placement

CONFIG = FedCGConfig()
CLIENT_SEED = 1001
RANGE = dlg_tf.input_range((0.5,), (0.5,))  # FMNIST's: [-1, 1].
OPTIONS = dlg_tf.AttackOptions(iterations=200, restarts=1, seed=0)


def _test_image():
  """A fixed synthetic image like an FMNIST item: a shaded, textured
  ellipse on a black background, normalised to [-1, 1]."""
  yy, xx = np.mgrid[0:32, 0:32] / 31.0
  inside = ((xx - 0.5) / 0.3)**2 + ((yy - 0.5) / 0.4)**2 < 1
  image = np.where(inside, 0.9 - 1.2 * yy + 0.3 * np.sin(8 * xx), -1.0)
  return np.clip(image, -1, 1)[None, :, :, None].astype(np.float32)


def _attack(name, sigma=0.0, clip=10.0, image=None, label=3):
  threat = dlg_tf.threat_model(name, sigma, clip)
  image = _test_image() if image is None else image
  client = dlg_tf.round_one_networks(CONFIG, threat, CLIENT_SEED)
  tf.random.set_seed(0)
  observation = dlg_tf.observe(CONFIG, threat, client, image,
                                   np.array([label], np.int32))
  result = dlg_tf.dlg_attack(CONFIG, observation, OPTIONS, RANGE)
  to01 = lambda x: dlg_tf.to_unit_range(x, (0.5,), (0.5,))
  return (float(dlg_tf.psnr(to01(image), to01(result.images))[0]),
          result, observation)


@pytest.fixture(scope='module')
def unprotected():
  return _attack('fedavg')


# ---------------------------------------------------------------------------
# The attack.


def test_dlg_recovers_the_image_from_an_unprotected_lenet_gradient(
    unprotected):
  psnr, result, _ = unprotected
  assert psnr > 20.0, psnr
  assert result.labels.tolist() == [3]  # iDLG's label.
  assert result.matching_loss < 1e-6


def test_dp_noise_of_std_0_1_drops_the_recovery(unprotected):
  psnr, _, _ = unprotected
  noisy, result, observation = _attack('fedavg_dp', sigma=0.1)
  assert noisy < psnr - 10.0 and noisy < 12.0, (noisy, psnr)
  # The attacker saw a noised gradient: far from the clean one.
  clean = unprotected[2].gradients['extractor'][0]
  seen = observation.gradients['extractor'][0]
  assert np.std(seen - clean) == pytest.approx(0.1, rel=0.3)
  assert result.matching_loss > 0.1


def test_dp_clips_the_shared_gradient_and_the_attacker_clips_alike():
  """Under DP the client's gradient (E and C together) is clipped to the
  clip's global norm before the noise, and the attacker clips its dummy
  gradients the same way: with negligible noise, the true image and label
  then match the observation exactly; unclipped they would not."""
  threat = dlg_tf.threat_model('fedavg_dp', 1e-9, 1.0)
  client = dlg_tf.round_one_networks(CONFIG, threat, CLIENT_SEED)
  image, label = _test_image(), np.array([3], np.int32)
  norm = lambda observation: float(np.sqrt(sum(
      np.sum(np.square(g)) for part in observation.gradients.values()
      for g in part)))
  clean = dlg_tf.observe(CONFIG, dlg_tf.threat_model('fedavg'), client,
                         image, label)
  seen = dlg_tf.observe(CONFIG, threat, client, image, label)
  assert norm(clean) > 2.0 and norm(seen) == pytest.approx(1.0, rel=1e-4)
  matcher = dlg_tf._matcher(CONFIG, threat, 1, False)  # pylint: disable=protected-access
  matcher.load(seen, seen.weights['extractor'], label)
  objective, _ = matcher.value_and_gradient(
      tf.constant(image.ravel(), tf.float64))
  assert float(objective) < 1e-6, float(objective)


def test_fedcg_attacker_recovers_little_through_a_stand_in_extractor(
    unprotected):
  psnr, _, _ = _attack('fedcg_private')
  assert psnr < unprotected[0] - 10.0


def test_shared_init_gives_the_fedcg_attacker_the_true_extractor():
  """Under shared init the round-1 E_i is the public draw, so C's gradient
  alone leads back to the image."""
  psnr, _, _ = _attack('fedcg')
  stand_in, _, _ = _attack('fedcg_private')
  assert psnr > 20.0 and psnr > stand_in + 10.0, (psnr, stand_in)


def test_adam_option_runs_and_keeps_the_input_range():
  threat = dlg_tf.threat_model('fedavg')
  client = dlg_tf.round_one_networks(CONFIG, threat, CLIENT_SEED)
  images = np.concatenate([_test_image(), -_test_image()])
  observation = dlg_tf.observe(CONFIG, threat, client, images,
                                   np.array([3, 5], np.int32))
  options = dlg_tf.AttackOptions(iterations=30, optimizer='adam',
                                     labels='optimize')
  result = dlg_tf.dlg_attack(CONFIG, observation, options, RANGE)
  assert result.images.shape == images.shape
  assert result.images.min() >= -1.0 and result.images.max() <= 1.0
  assert result.labels.shape == (2,)
  with pytest.raises(ValueError, match='labels=infer needs'):
    dlg_tf.infer_labels(observation)


def test_adam_attack_reconstructs_from_an_unprotected_gradient():
  """Adam's path really attacks: from the same random start, 400 steps
  match the gradient 10x better than 1 and gain several dB of PSNR (about
  5.7 -> 10.2 dB here; L-BFGS reaches > 20 dB on the same gradient)."""
  threat = dlg_tf.threat_model('fedavg')
  client = dlg_tf.round_one_networks(CONFIG, threat, CLIENT_SEED)
  image = _test_image()
  observation = dlg_tf.observe(CONFIG, threat, client, image,
                               np.array([3], np.int32))
  to01 = lambda x: dlg_tf.to_unit_range(x, (0.5,), (0.5,))
  runs = {n: dlg_tf.dlg_attack(CONFIG, observation, dlg_tf.AttackOptions(
      iterations=n, optimizer='adam', adam_lr=0.3), RANGE) for n in (1, 400)}
  psnr = {n: float(dlg_tf.psnr(to01(image), to01(r.images))[0])
          for n, r in runs.items()}
  assert runs[400].matching_loss < 0.1 * runs[1].matching_loss
  assert psnr[400] > psnr[1] + 3.0, psnr


def test_the_best_restart_is_kept(unprotected, monkeypatch):
  """With several restarts the attack keeps the one that matched best:
  each restart starts from its own seeded draw, and L-BFGS is replaced
  here by one that returns its start with a scripted loss."""
  observation = unprotected[2]
  losses = iter([3.0, 1.0, 2.0])
  starts = []

  def scripted(matcher, start, iterations, low, high):
    del matcher, iterations, low, high
    starts.append(start)
    return start, next(losses)

  monkeypatch.setattr(dlg_tf, '_lbfgs', scripted)
  options = dlg_tf.AttackOptions(iterations=1, restarts=3, seed=0)
  result = dlg_tf.dlg_attack(CONFIG, observation, options, RANGE)
  assert result.restart_losses == (3.0, 1.0, 2.0)
  assert result.matching_loss == 1.0
  np.testing.assert_array_equal(result.images.ravel(),
                                starts[1].astype(np.float32))
  assert not np.array_equal(starts[0], starts[1])


def test_attack_options_are_checked():
  for bad, match in ((dict(iterations=0), 'iterations'),
                     (dict(restarts=0), 'restarts'),
                     (dict(optimizer='sgd'), 'attack_optimizer'),
                     (dict(labels='guess'), 'labels')):
    with pytest.raises(ValueError, match=match):
      dlg_tf.AttackOptions(**bad).validate()
  with pytest.raises(ValueError, match='algorithms'):
    dlg_tf.threat_model('feddf')
  with pytest.raises(ValueError, match='dp_sigma'):
    dlg_tf.threat_model('fedavg_dp', 0.0, 1.0)


# ---------------------------------------------------------------------------
# Threat models: what reaches the attacker.


def _arrays(observation):
  return [a for group in (observation.weights, observation.gradients)
          for values in group.values() for a in values]


def _holds_any(arrays, weights):
  return any(a.shape == w.shape and np.array_equal(a, w)
             for a in arrays for w in weights)


@pytest.mark.parametrize('name', ['fedcg', 'fedsplit', 'fedcg_private',
                                  'fedsplit_private'])
def test_private_extractor_threat_models_see_no_extractor_weights(name):
  threat = dlg_tf.threat_model(name)
  client = dlg_tf.round_one_networks(CONFIG, threat, CLIENT_SEED)
  observation = dlg_tf.observe(CONFIG, threat, client, _test_image(),
                                   np.array([3], np.int32))
  assert set(observation.gradients) == {'classifier'}
  assert 'extractor' not in observation.weights
  extractor_shapes = {w.shape for w in client.extractor}
  assert not any(a.shape in extractor_shapes for a in _arrays(observation))
  assert not _holds_any(_arrays(observation), client.extractor)
  public = dlg_tf.round_one_networks(
      CONFIG, dlg_tf.threat_model('fedavg'), CLIENT_SEED)
  stand_in = dlg_tf.stand_in_extractor(
      CONFIG, CONFIG.seed + dlg_tf.STAND_IN_SEED_OFFSET)
  assert not np.array_equal(stand_in[0], client.extractor[0])
  if name.endswith('_private'):
    # The client's own E, not the server's (what fedavg would share).
    assert not threat.knows_initial_extractor
    assert not np.array_equal(client.extractor[0], public.extractor[0])
  else:
    # Shared init: E_i starts as the public draw, which the attacker makes
    # itself (the run's seed), not something it receives.
    assert threat.knows_initial_extractor
    assert all(np.array_equal(a, b)
               for a, b in zip(client.extractor, public.extractor))
    assert all(np.array_equal(a, b) for a, b in zip(
        client.extractor, dlg_tf.stand_in_extractor(CONFIG, CONFIG.seed)))
  if name.startswith('fedcg'):
    assert set(observation.weights) == {'generator', 'classifier'}


def test_c_gradient_of_one_image_gives_its_features_exactly():
  """What FedCG's attacker does learn: E(x), from C's first dense layer
  (kernel gradient = features (x) bias gradient)."""
  threat = dlg_tf.threat_model('fedcg')
  client = dlg_tf.round_one_networks(CONFIG, threat, CLIENT_SEED)
  observation = dlg_tf.observe(CONFIG, threat, client, _test_image(),
                                   np.array([3], np.int32))
  kernel, bias = observation.gradients['classifier'][:2]
  j = int(np.argmax(np.abs(bias)))
  features = kernel[:, j] / bias[j]
  extractor = lenet.build_extractor(1)
  model_weights.assign(extractor, client.extractor)
  np.testing.assert_allclose(features, np.ravel(extractor(_test_image())),
                             rtol=1e-3, atol=1e-5)


def test_fedavg_threat_model_sees_the_extractor(unprotected):
  """The check above can fail: FedAvg's attacker holds E and its gradient."""
  observation = unprotected[2]
  client = dlg_tf.round_one_networks(
      CONFIG, dlg_tf.threat_model('fedavg'), CLIENT_SEED)
  assert _holds_any(_arrays(observation), client.extractor)
  assert set(observation.gradients) == {'extractor', 'classifier'}


# ---------------------------------------------------------------------------
# PSNR and SSIM.


def test_psnr_of_identical_images_is_capped_and_of_unrelated_ones_low():
  rng = np.random.default_rng(0)
  a = rng.uniform(size=(3, 32, 32, 1))
  assert dlg_tf.psnr(a, a).tolist() == [dlg_tf.PSNR_CAP_DB] * 3
  assert np.all(dlg_tf.psnr(a, rng.uniform(size=a.shape)) < 10.0)
  # Known value: a uniform error of 0.1 is an MSE of 0.01, 20 dB.
  assert dlg_tf.psnr(a[:1] * 0.5, a[:1] * 0.5 + 0.1)[0] == (
      pytest.approx(20.0))
  with pytest.raises(ValueError, match='psnr'):
    dlg_tf.psnr(a, a[:2])


def test_ssim_of_identical_and_unrelated_images():
  rng = np.random.default_rng(1)
  a = rng.uniform(size=(2, 32, 32, 1))
  np.testing.assert_allclose(dlg_tf.ssim(a, a), 1.0, atol=1e-6)
  assert np.all(dlg_tf.ssim(a, rng.uniform(size=a.shape)) < 0.2)


def test_match_order_pairs_a_shuffled_batch():
  rng = np.random.default_rng(2)
  a = rng.uniform(size=(3, 8, 8, 1))
  order = dlg_tf.match_order(a, a[[2, 0, 1]])
  np.testing.assert_array_equal(a[[2, 0, 1]][order], a)


# ---------------------------------------------------------------------------
# The Gaussian mechanism and epsilon.


def test_gaussian_mechanism_clips_then_adds_noise_of_std_sigma():
  tf.random.set_seed(3)
  zeros = {'a': tf.zeros([200, 200]), 'b': (tf.zeros([1000]),)}
  noised = dp.gaussian_mechanism(zeros, 0.1, 1.0)
  assert float(tf.math.reduce_std(noised['a'])) == pytest.approx(0.1, rel=0.02)
  big = (tf.fill([100], 10.0),)
  clipped = dp.gaussian_mechanism(big, 0.0, 2.5)
  assert float(tf.norm(clipped[0])) == pytest.approx(2.5, rel=1e-5)
  small = (tf.fill([4], 0.1),)
  np.testing.assert_allclose(dp.gaussian_mechanism(small, 0.0, 2.5)[0], 0.1)
  # Every tensor is noised, and the clip is on the record's global norm:
  # parts of norms 3 and 4 (5 together) clipped to 1 keep their ratio.
  assert float(tf.math.reduce_std(noised['b'][0])) == pytest.approx(
      0.1, rel=0.1)
  parts = dp.gaussian_mechanism((tf.fill([9], 1.0), tf.fill([16], 1.0)),
                                0.0, 1.0)
  np.testing.assert_allclose([float(tf.norm(p)) for p in parts], [0.6, 0.8],
                             rtol=1e-5)


def test_epsilon_follows_noise_rounds_and_the_rdp_bound():
  assert dp.epsilon(0.0, 1.0, 1) == math.inf
  e = {s: dp.epsilon(s, 1.0, 10) for s in (0.5, 1.0, 2.0)}
  assert e[0.5] > e[1.0] > e[2.0] > 0
  assert dp.epsilon(1.0, 1.0, 20) > e[1.0]
  # Only the ratio sigma / clip matters.
  assert dp.epsilon(0.1, 10.0, 3) == pytest.approx(dp.epsilon(0.01, 1.0, 3))
  # At most the classic RDP conversion of T Gaussian mechanisms
  # (eps = min_a T a / (2 z^2) + log(1 / delta) / (a - 1)).
  z, rounds, delta = 1.0, 10, 1e-5
  orders = np.linspace(1.01, 200, 20000)
  classic = np.min(rounds * orders / (2 * z**2) +
                   np.log(1 / delta) / (orders - 1))
  assert e[1.0] <= classic + 1e-6
  assert e[1.0] > 0.5 * classic

  # Exactly the improved conversion (Balle et al. 2020, dp-accounting's)
  # of the Gaussian's RDP, T a / (2 z^2), over the accountant's orders:
  # eps = min_a RDP(a) + log1p(-1/a) - (log(delta) + log(a)) / (a - 1).
  def by_hand(rdp_per_round, rounds, delta):
    a = np.asarray(dp.RDP_ORDERS)
    return float(np.min(rounds * rdp_per_round(a) + np.log1p(-1 / a) -
                        (np.log(delta) + np.log(a)) / (a - 1)))

  gaussian = lambda z: (lambda a: a / (2 * z**2))
  for sigma, clip, rounds, delta in ((1.0, 1.0, 10, 1e-5),
                                     (1.0, 1.0, 10, 1e-3),
                                     (0.3, 0.5, 3, 1e-6)):
    assert dp.epsilon(sigma, clip, rounds, delta) == pytest.approx(
        by_hand(gaussian(sigma / clip), rounds, delta), rel=1e-9)
  # DP-FedCG: three mechanisms a round, G's and C's updates (z = sigma /
  # clip) and the teacher logits (z = sigma / teacher_clip).
  three = lambda a: 2 * gaussian(2.0)(a) + gaussian(0.5)(a)
  assert dp.fedcg_epsilon(1.0, 0.5, 2.0, 7, delta=1e-3) == pytest.approx(
      by_hand(three, 7, 1e-3), rel=1e-9)
  # Replacement adjacency: a record may change by twice the clip, which is
  # the mechanism with half the noise.
  assert dp.epsilon(1.0, 1.0, 10, adjacency='replace') == pytest.approx(
      dp.epsilon(0.5, 1.0, 10), rel=1e-12)
  assert dp.epsilon(1.0, 1.0, 10, adjacency='replace') > e[1.0]
  assert dp.describe(1.0, 2.0, 10)['epsilon_replace'] == pytest.approx(
      dp.epsilon(0.5, 2.0, 10), rel=1e-12)
  with pytest.raises(ValueError, match="adjacency must be one of"):
    dp.epsilon(1.0, 1.0, 1, adjacency='add_remove')
  with pytest.raises(ValueError, match='dp_clip'):
    dp.epsilon(0.1, 0.0, 1)
  with pytest.raises(ValueError, match='dp_delta'):
    dp.epsilon(0.1, 1.0, 1, delta=1.0)


def test_dp_mean_factory_clips_and_noises_each_client_then_averages():
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  value_type = tff.types.to_type(
      ((np.float32, [2000]), (np.float32, [3])))
  weight_type = tff.TensorType(np.float32)

  def mean(sigma, clip, values):
    process = dp.mean_factory(sigma, clip, len(values)).create(value_type,
                                                               weight_type)
    return process.next(process.initialize(), values,
                        [7.0, 1.0, 2.0][:len(values)]).result

  # No noise: the uniform mean of the clipped values (weights ignored).
  values = [(np.full(2000, 1.0, np.float32), np.zeros(3, np.float32)),
            (np.full(2000, 0.01, np.float32), np.full(3, 2.0, np.float32))]
  got = mean(0.0, 1e6, values)
  np.testing.assert_allclose(got[0], 0.505, rtol=1e-6)
  np.testing.assert_allclose(got[1], 1.0, rtol=1e-6)
  # Each client's record clipped to global L2 norm 1 first, both parts
  # together (clipping each part to 1 on its own gives another mean).
  got = mean(0.0, 1.0, values)
  clipped = [np.concatenate(v) / np.linalg.norm(np.concatenate(v))
             for v in values]
  np.testing.assert_allclose(np.concatenate(got), np.mean(clipped, axis=0),
                             rtol=1e-4, atol=1e-6)
  # Noise: each of n clients adds std sigma, so the mean has sigma/sqrt(n)
  # (2000 coordinates: the std is known to ~2%, far from sigma/sqrt(2) or
  # sigma/n).
  zeros = [(np.zeros(2000, np.float32), np.zeros(3, np.float32))] * 3
  got = mean(0.3, 1.0, zeros)
  assert np.std(got[0]) == pytest.approx(0.3 / math.sqrt(3), rel=0.05)
  # ... drawn on each client: the aggregation's only random op runs in a
  # computation mapped at CLIENTS, none at the server (noise added to the
  # sum at the server would give the same std).
  process = dp.mean_factory(0.3, 1.0, 3).create(value_type, weight_type)
  random = lambda ops: {op for op in ops if 'Random' in op}
  ops = tf_ops_by_placement(process.next)
  assert random(ops[tff.CLIENTS]) and not random(ops.get(tff.SERVER, ()))
  central = tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
      noise_multiplier=0.3, clients_per_round=3, clip=1.0)
  ops = tf_ops_by_placement(central.create(value_type).next)
  assert random(ops[tff.SERVER])  # The check tells the two apart.
  with pytest.raises(ValueError, match='dp_sigma'):
    dp.mean_factory(-1.0, 1.0, 3)


def test_each_record_carries_its_own_noise_of_std_sigma():
  """What every client runs on its own record (`preprocess_record`, which
  TFF's DP factory maps at CLIENTS): each record, taken alone, is clipped
  and carries noise of std sigma, drawn afresh; the server's sum adds
  nothing. So no client can carry the round's noise for the others (one
  client with sigma * sqrt(n) and the rest with none gives the mean's std
  too)."""
  query = dp.LocalGaussianSumQuery(l2_norm_clip=1.0, stddev=0.3)
  state = query.initial_global_state()
  params = query.derive_sample_params(state)
  tf.random.set_seed(5)
  zeros = (tf.zeros(2000), tf.zeros(3))
  draws = [query.preprocess_record(params, zeros)[0].numpy()
           for _ in range(3)]
  for noise in draws:  # 2000 coordinates: the std is known to ~2%.
    assert np.std(noise) == pytest.approx(0.3, rel=0.05)
  assert not np.allclose(draws[0], draws[1])
  # Clipped before the noise: a record of norm 20 comes back at norm 1
  # (its coordinates' mean, seen through noise of std 0.01).
  small = dp.LocalGaussianSumQuery(l2_norm_clip=1.0, stddev=0.01)
  big = (tf.fill([2000], 20.0 / math.sqrt(2000)), tf.zeros(3))
  noised = small.preprocess_record(
      small.derive_sample_params(small.initial_global_state()), big)
  assert np.mean(noised[0]) == pytest.approx(1.0 / math.sqrt(2000),
                                             rel=0.05)
  summed = (tf.fill([2000], 2.0), tf.ones(3))
  result, _, _ = query.get_noised_result(summed, state)
  np.testing.assert_array_equal(result[0].numpy(), summed[0].numpy())


def test_fedavg_with_dp_uploads_noised_updates():
  """One round of FedAvg with the DP aggregator: the server's new weights
  are the mean of the clients' trained weights plus noise of std
  sigma / sqrt(n) (each client's update carried std sigma)."""
  config = FedCGConfig(batch_size=8, local_epochs=1, client_optimizer='sgd',
                       lr=0.05, weight_decay=0.0)
  rng = np.random.default_rng(4)
  data = [tf.data.Dataset.from_tensor_slices(
      (rng.normal(size=(16, 32, 32, 1)).astype(np.float32),
       rng.integers(0, 10, 16).astype(np.int32))).batch(8)
          for _ in range(3)]
  sigma = 0.05
  # As run_fedcg builds it: the DP mean and uploads of updates together.
  driver = catalog.build('fedavg', config, 3,
                         **dp.aggregation('fedavg', sigma, 1e6, 1e6, 3))
  before = driver.server_state.shared
  driver.run_round(0, data)
  flat = lambda groups: np.concatenate(
      [np.ravel(w) for name in ('extractor', 'classifier')
       for w in groups[name]])
  clients = np.mean([flat({'extractor': s.extractor,
                           'classifier': s.classifier})
                     for s in driver.client_states], axis=0)
  assert not np.allclose(clients, flat(before), atol=1e-4)  # They trained.
  residual = flat(driver.server_state.shared) - clients
  assert np.std(residual) == pytest.approx(sigma / math.sqrt(3), rel=0.05)
  assert abs(np.mean(residual)) < 1e-3
  with pytest.raises(ValueError, match='upload_updates'):
    catalog.build('fedgen', config, 3, upload_updates=True)
  with pytest.raises(ValueError, match="DP training applies to .* not "
                     "'fedgen'"):
    dp.aggregation('fedgen', sigma, 1.0, 1.0, 3)
  # Nor does the library let a DP or secure mean seem to protect the single
  # models FedGen's and FedDF's servers gather (refused before any trace).
  for algorithm in ('fedgen', 'feddf'):
    with pytest.raises(ValueError, match='gathers every client'):
      catalog.build_process(algorithm, config,
                            aggregation_factory=dp.mean_factory(sigma, 1.0, 3),
                            server_images=np.zeros((4, 32, 32, 1),
                                                   np.float32))


def test_names_match_the_registries():
  assert names.DP_ALGORITHMS == (baselines_process_tff.UPDATE_ALGORITHMS +
                                 ('fedcg',))
  assert names.SECURE_ALGORITHMS == secure_aggregation.ALGORITHMS
  assert names.PRIVACY_ALGORITHMS == dlg_tf.THREAT_MODEL_NAMES


# ---------------------------------------------------------------------------
# The binary.


def _binary(*args):
  return binary_runs.run_binary('run_privacy_attack', args, timeout=300)


def test_binary_writes_table_2_grid_and_tensorboard(tmp_path):
  data_dir = tmp_path / 'data'
  data_dir.mkdir()
  fake_data.write_fake_fmnist(str(data_dir), n_train=80, n_test=40)
  results = tmp_path / 'fedavg_results.json'
  results.write_text(json.dumps({
      'algorithm': 'fedavg', 'mean_test_accuracy_at_best_val': 0.625,
      'rounds_run': 3}))
  dp_results = tmp_path / 'fedavg_dp_results.json'
  dp_results.write_text(json.dumps({
      'algorithm': 'fedavg', 'mean_test_accuracy_at_best_val': 0.5,
      'rounds_run': 2,
      'dp': {'dp_sigma': 0.1, 'dp_clip': 10.0, 'dp_delta': 1e-5}}))
  out = tmp_path / 'out'
  # FedCG's row is trained (one tiny round), the others are given.
  proc = _binary(
      f'--output_dir={out}', f'--data_dir={data_dir}', '--num_clients=2',
      '--train_per_client=20', '--num_images=2', '--iterations=5',
      '--algorithms=fedavg,fedavg_dp,fedcg', '--dp_sigma=0.1',
      f'--results=fedavg={results},fedavg_dp0.1={dp_results}',
      f'--train_dir={tmp_path / "train"}',
      '--train_flags=--rounds=1 --local_epochs=1 --gan_epochs=1 '
      '--server_epochs=1 --server_steps_per_epoch=2')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert '[fedcg 2/2] PSNR' in proc.stdout
  trained = json.loads(
      (tmp_path / 'train' / 'fedcg' / 'results.json').read_text())
  table = (out / 'privacy.md').read_text()
  assert '| FedAvg | 62.50 (3 rounds) |' in table
  assert '| FedAvg DP 0.1 | 50.00 (2 rounds) |' in table
  accuracy = 100 * trained['mean_test_accuracy_at_best_val']
  assert f'| FedCG (shared init) | {accuracy:.2f} (1 rounds) |' in table
  assert 'For scale, constant images score: black' in table
  with open(out / 'privacy.csv') as f:
    rows = list(csv.DictReader(f))
  assert [r['algorithm'] for r in rows] == ['fedavg', 'fedavg_dp0.1', 'fedcg']
  assert rows[1]['epsilon_gradient'] == f'{dp.epsilon(0.1, 10.0, 1):.6g}'
  summary = json.loads((out / 'privacy.json').read_text())
  assert len(summary['rows']['fedcg']['psnr']) == 2
  assert summary['training']['fedcg']['results'] == str(
      tmp_path / 'train' / 'fedcg' / 'results.json')
  assert (out / 'reconstructions.png').stat().st_size > 1000
  events = os.listdir(out / 'tensorboard')
  assert events and events[0].startswith('events.out.tfevents')


def test_binary_names_the_bad_flag(tmp_path):
  shared_run = tmp_path / 'results.json'
  shared_run.write_text(json.dumps({
      'algorithm': 'fedcg', 'client_init': 'shared', 'rounds_run': 1,
      'mean_test_accuracy_at_best_val': 0.5}))
  other_run = tmp_path / 'other' / 'results.json'
  other_run.parent.mkdir()
  other_run.write_text(json.dumps({
      'algorithm': 'fedavg', 'task': 'fmnist', 'rounds_run': 1,
      'mean_test_accuracy_at_best_val': 0.5,
      'dp': {'dp_sigma': 0.1, 'dp_clip': 3.0, 'dp_delta': 1e-3}}))
  (other_run.parent / 'run.json').write_text(json.dumps(
      {'config': {'seed': 2, 'model': 'lenet'}, 'run': {'num_clients': 10}}))
  tfds_run = tmp_path / 'tfds' / 'results.json'
  tfds_run.parent.mkdir()
  tfds_run.write_text(json.dumps({
      'algorithm': 'fedavg', 'task': 'fmnist', 'rounds_run': 1,
      'mean_test_accuracy_at_best_val': 0.5}))
  (tfds_run.parent / 'run.json').write_text(json.dumps(
      {'config': {'seed': 1}, 'run': {'data_source': 'tfds'}}))
  bf16_run = tmp_path / 'bf16' / 'results.json'
  bf16_run.parent.mkdir()
  bf16_run.write_text(tfds_run.read_text())
  (bf16_run.parent / 'run.json').write_text(json.dumps(
      {'config': {'seed': 1, 'matmul_precision': 'bfloat16'}, 'run': {}}))
  # A run of three clients, attacked on a task of two: only the loaded
  # task knows its clients (the default number is the task's).
  three_clients = tmp_path / 'three' / 'results.json'
  three_clients.parent.mkdir()
  three_clients.write_text(json.dumps({
      'algorithm': 'fedavg', 'task': 'fmnist', 'rounds_run': 1,
      'mean_test_accuracy_at_best_val': 0.5,
      'client_names': ['c0', 'c1', 'c2']}))
  data_dir = tmp_path / 'data'
  data_dir.mkdir()
  fake_data.write_fake_fmnist(str(data_dir), n_train=80, n_test=40)
  not_json = tmp_path / 'metrics.csv'
  not_json.write_text('round,val_accuracy\n1,0.5\n')
  no_accuracy = tmp_path / 'run.json'
  no_accuracy.write_text(json.dumps({'config': {}, 'run': {}}))
  earlier = tmp_path / 'earlier'
  earlier.mkdir()
  (earlier / 'privacy.json').write_text('{}')
  train = f'--train_dir={tmp_path / "train"}'
  cases = [
      (['--num_images=3', '--attack_batch_size=2'], '--num_images=3'),
      # Output directories found unusable before any row trains: under a
      # file, or holding an earlier report a rerun would replace.
      (['--algorithms=fedavg', train, f'--output_dir={not_json}/x'],
       f'--output_dir={not_json}/x: {not_json} is a file, not a directory'),
      (['--algorithms=fedavg', train, f'--output_dir={earlier}'],
       f'--output_dir={earlier} holds an earlier report (privacy.json)'),
      # Inside a run this binary would train (its resume replaces its
      # tensorboard/); refused before the data (absent here) is read.
      (['--algorithms=fedavg', train, f'--data_dir={tmp_path / "absent"}',
        f'--output_dir={tmp_path / "train" / "fedavg" / "tensorboard"}'],
       f'--output_dir is in {tmp_path / "train" / "fedavg"} (row fedavg\'s '
       'run under --train_dir): write the report outside the runs it reads'),
      (['--algorithms=fedavg', train, "--train_flags=--data_dir=/o'brien"],
       "--train_flags=--data_dir=/o'brien: No closing quotation"),
      # The client attacked is checked on the task before any row trains.
      (['--algorithms=fedavg', train, f'--data_dir={data_dir}',
        '--num_clients=2', '--train_per_client=20', '--client=2'],
       '--client=2: the task has 2 clients'),
      (['--results=fedsplit=/nonexistent.json'], '--results'),
      # A file that is not a run's results.json (here metrics-like text),
      # refused before the other rows would train.
      (['--algorithms=fedavg,fedcg', f'--train_dir={tmp_path / "train"}',
        f'--data_dir={tmp_path / "absent"}', f'--results=fedavg={not_json}'],
       f'--results: {not_json} (fedavg) is not the results.json of a '
       'finished run_fedcg run'),
      (['--algorithms=fedavg', f'--results=fedavg={no_accuracy}'],
       "(fedavg) is not the results.json of a finished run_fedcg run (no "
       "'mean_test_accuracy_at_best_val')"),
      (['--algorithms=fedavg', '--dp_sigma=0.1'],
       '--dp_sigma is only used with fedavg_dp in --algorithms'),
      (['--task=office_caltech10', '--train_per_client=500'],
       '--train_per_client is not used by --task=office_caltech10'),
      (['--algorithms=fedavg,fedcg', f'--train_dir={tmp_path / "train"}',
        f'--data_dir={tmp_path / "absent"}', '--train_flags=--prox_mu=0.5'],
       '--train_flags sets --prox_mu, which only --algorithm=fedprox uses, '
       'and no run is one of them'),
      (['--algorithms=fedavg,fedcg', '--dp_clip=3'],
       '--dp_clip is only used with fedavg_dp in --algorithms'),
      # A shared-init FedCG run cannot stand for the private-init row.
      (['--algorithms=fedcg_private', f'--results=fedcg_private={shared_run}'],
       "trained with client_init 'shared', row fedcg_private needs 'private'"),
      # A run of another clip or seed is not the row's either.
      (['--algorithms=fedavg_dp', '--dp_sigma=0.1', '--seed=2',
        f'--results=fedavg_dp0.1={other_run}'],
       "trained with dp_clip 3.0, row fedavg_dp0.1 needs 10.0"),
      (['--algorithms=fedavg_dp', '--dp_sigma=0.1', '--dp_clip=3',
        f'--results=fedavg_dp0.1={other_run}'],
       "trained with seed 2, row fedavg_dp0.1 needs 1"),
      (['--algorithms=fedavg_dp', '--dp_sigma=0.1', '--dp_clip=3', '--seed=2',
        '--num_clients=4', f'--results=fedavg_dp0.1={other_run}'],
       "trained with num_clients 10, row fedavg_dp0.1 needs 4"),
      # Its epsilon is at delta 1e-3, not the report's 1e-5.
      (['--algorithms=fedavg_dp', '--dp_sigma=0.1', '--dp_clip=3', '--seed=2',
        f'--results=fedavg_dp0.1={other_run}'],
       "trained with dp_delta 0.001, row fedavg_dp0.1 needs 1e-05"),
      # An unset --data_source is FMNIST's default, the IDX files.
      (['--algorithms=fedavg', f'--results=fedavg={tfds_run}'],
       "trained with data_source 'tfds', row fedavg needs 'idx'"),
      (['--algorithms=fedavg', f'--results=fedavg={bf16_run}'],
       "trained with matmul_precision 'bfloat16', row fedavg needs "
       "'float32'"),
      (['--algorithms=fedavg', f'--results=fedavg={three_clients}',
        f'--data_dir={data_dir}', '--num_clients=2', '--train_per_client=20'],
       'was trained on clients c0, c1, c2; row fedavg attacks'),
      ([f'--train_dir={tmp_path / "train"}', '--train_flags=--model=resnet18'],
       '--train_flags must not set --model'),
      (['--algorithms=fedavg_dp', '--dp_sigma=0.1,0.1'],
       '--dp_sigma must be distinct numbers'),
      (['--algorithms=fedavg_dp', '--dp_sigma=0.1,-1'],
       '--dp_sigma values must be finite and > 0, got -1'),
  ]
  # One interpreter for them all (each would import TensorFlow).
  stops, done = binary_runs.main_calls('run_privacy_attack', [
      [f'--output_dir={tmp_path / "out"}', *args] for args, _ in cases],
      timeout=300)
  assert len(stops) == len(cases), done.stderr[-3000:]
  for (args, message), stopped in zip(cases, stops):
    assert stopped is not None and message in stopped, (args, stopped)
  assert not (tmp_path / 'out').exists()
  assert os.listdir(earlier) == ['privacy.json']
  assert not (tmp_path / 'train').exists()  # No row trained.
  assert (earlier / 'privacy.json').read_text() == '{}'


def test_run_fedcg_refuses_dp_for_other_algorithms(tmp_path):
  """Flag checks only: run in this process (no interpreter to start)."""
  for args, message in (
      (['--algorithm=local', '--dp_sigma=0.1'], '--dp_sigma applies to'),
      (['--algorithm=fedavg', '--dp_clip=3'], '--dp_clip is only used'),
      (['--algorithm=fedavg', '--dp_sigma=0.1', '--dp_clip=0'],
       '--dp_clip must be')):
    stopped = binary_runs.run_fedcg_in_process(
        [f'--output_dir={tmp_path / "run"}', *args])
    assert stopped is not None and message in stopped, (args, stopped)
  assert not (tmp_path / 'run').exists()
