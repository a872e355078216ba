"""The baselines: oracles against tff.learning, and what makes each one itself."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fedcg_tff.algorithms import aggregators_tff
from fedcg_tff.algorithms import baselines_process_tff
from fedcg_tff.algorithms import baselines_tf
from fedcg_tff.algorithms import catalog
from fedcg_tff.algorithms import training_tf
from fedcg_tff.execution import devices
from fedcg_tff.models import lenet
from fedcg_tff.models import model_weights
from fedcg_tff.program import driver
from tests import built
from tests.placement import EXTRACTOR_KERNEL_SHAPES
from tests.placement import crossings
from tests.placement import leaks
from tests.placement import shared_fractions
from tests.placement import tensor_shapes

TINY = built.TINY
SIZES = (16, 24, 8)  # Unequal client weights.


def _arrays(n, seed):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(n, 32, 32, 1)).astype(np.float32),
          rng.integers(0, 10, n).astype(np.int32))


def _client_data(n, seed):
  return tf.data.Dataset.from_tensor_slices(_arrays(n, seed)).batch(8)


def _round_data(round_num):
  return [_client_data(n, 100 * round_num + i) for i, n in enumerate(SIZES)]


def _weighted_mean(weight_lists, sizes=SIZES):
  w = np.asarray(sizes, np.float64) / sum(sizes)
  return [sum(wi * np.asarray(ws[k]) for wi, ws in zip(w, weight_lists))
          for k in range(len(weight_lists[0]))]


def _assert_all_close(a, b, atol=1e-5):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol,
                               rtol=1e-4)


def _run(algorithm, config=TINY, rounds=1, **kwargs):
  driver = (catalog.build(algorithm, config, len(SIZES), **kwargs) if kwargs
            else built.built_driver(algorithm, config, len(SIZES)))
  initial_server, initial_clients = driver.server_state, driver.client_states
  for r in range(rounds):
    metrics = driver.run_round(r, _round_data(r))
  return driver, initial_server, initial_clients, metrics


# ---------------------------------------------------------------------------
# Oracles: tff.learning's FedAvg and FedProx.


def _keras_model_fn():
  model = tf.keras.Sequential([lenet.build_extractor(1),
                               lenet.build_classifier(10)])
  spec = (tf.TensorSpec([None, 32, 32, 1], tf.float32),
          tf.TensorSpec([None], tf.int32))
  return tff.learning.models.from_keras_model(
      model, loss=tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True), input_spec=spec)


def _ours_and_oracle(algorithm, mu=0.0, traced_anew=False):
  """Global E+C weights after two rounds: ours, then tff.learning's, from
  the same initial weights, data, client SGD (lr 0.1) and server SGD (1.0).
  `traced_anew`: our process is traced again, not taken from
  `catalog.build_process`'s (for a test that patches code it traces)."""
  config = dataclasses.replace(TINY, client_optimizer='sgd', lr=0.1,
                               weight_decay=0.0, prox_mu=mu)
  ours = (driver.Driver(config, len(SIZES),
                        baselines_process_tff.build_baseline_process(
                            config, algorithm))
          if traced_anew else catalog.build(algorithm, config, len(SIZES)))
  initial = ours.server_state.shared
  sgd = tff.learning.optimizers.build_sgdm
  if algorithm == 'fedavg':
    oracle = tff.learning.algorithms.build_weighted_fed_avg(
        _keras_model_fn, client_optimizer_fn=sgd(0.1),
        server_optimizer_fn=sgd(1.0))
  else:
    oracle = tff.learning.algorithms.build_weighted_fed_prox(
        _keras_model_fn, proximal_strength=mu, client_optimizer_fn=sgd(0.1),
        server_optimizer_fn=sgd(1.0))
  state = oracle.initialize()
  state = oracle.set_model_weights(state, tff.learning.models.ModelWeights(
      trainable=list(initial['extractor']) + list(initial['classifier']),
      non_trainable=[]))
  for r in range(2):
    data = _round_data(r)
    ours.run_round(r, data)
    state = oracle.next(state, data).state
  got = (list(ours.server_state.shared['extractor']) +
         list(ours.server_state.shared['classifier']))
  assert not np.allclose(got[0], initial['extractor'][0])  # It trained.
  return got, oracle.get_model_weights(state).trainable


@pytest.mark.parametrize('name,client,server', [
    ('local', ('extractor', 'classifier'), ()),
    ('fedavg', ('extractor', 'classifier'), ('extractor', 'classifier')),
    ('fedprox', ('extractor', 'classifier'), ('extractor', 'classifier')),
    ('fedsplit', ('extractor', 'classifier'), ('classifier',)),
    ('feddf', ('extractor', 'classifier'), ('extractor', 'classifier')),
    ('fedgen', ('extractor', 'classifier', 'generator'),
     ('classifier', 'generator')),
])
def test_the_networks_each_side_uses(name, client, server):
  """The table of each baseline's client and server networks, which
  `baselines_process_tff` builds from (what crosses a placement is checked
  on the processes' types elsewhere: the table sets only what is built)."""
  baseline = baselines_tf.BASELINES[name]
  assert baseline.client_networks == client
  assert baseline.server_networks == server
  # With updates uploaded (DP) the server still holds the shared networks:
  # privacy_test.test_fedavg_with_dp_uploads_noised_updates, on the state.

def test_fedavg_matches_tff_learning():
  ours, oracle = _ours_and_oracle('fedavg')
  _assert_all_close(ours, oracle, atol=1e-5)


def test_fedprox_matches_tff_learning_up_to_its_proximal_sign(monkeypatch):
  # TFF 0.87's FedProx adds mu * (w_global - w) to the gradient
  # (proximal_client_work.py: `delta_l2_regularizer * (y - x)` with x the
  # current and y the initial weights), which pushes w *away* from the
  # global model; the FedProx paper's (mu/2)||w - w_global||^2 has gradient
  # mu * (w - w_global), which is ours (test_fedprox_pulls_towards_global).
  # With our term's sign flipped, everything else must agree exactly.
  mu = 2.0
  ours, oracle = _ours_and_oracle('fedprox', mu)
  assert max(float(np.max(np.abs(a - b))) for a, b in zip(ours, oracle)) > 1e-4
  term = baselines_tf.proximal_term
  monkeypatch.setattr(baselines_tf, 'proximal_term',
                      lambda v, r: -term(v, r))
  flipped, oracle = _ours_and_oracle('fedprox', mu, traced_anew=True)
  _assert_all_close(flipped, oracle, atol=1e-5)


def test_fedprox_pulls_towards_global():
  # One local round from the same broadcast weights and data: FedProx's
  # clients end nearer the global model than FedAvg's.
  data = _client_data(32, 1)
  distances = {}
  for name, mu in (('fedavg', 0.0), ('fedprox', 5.0)):
    config = dataclasses.replace(TINY, client_optimizer='sgd', lr=0.1,
                                 local_epochs=3, prox_mu=mu)
    baseline = baselines_tf.BASELINES[name]
    server = baselines_tf.initial_server_state(config, baseline, ())
    message = baselines_tf.ServerMessage(server.shared, (), tf.constant(0))
    state = baselines_tf.initial_client_state(config, 7)
    out = baselines_tf.client_update(baselines_tf.PartyNetworks(config), baseline,
                                     message, state, data)
    distances[name] = sum(
        float(tf.reduce_sum(tf.square(a - b)))
        for part in ('extractor', 'classifier')
        for a, b in zip(out.upload[part], server.shared[part]))
    if name == 'fedprox':
      assert float(out.metrics.extra_loss) > 0
  assert distances['fedprox'] < 0.7 * distances['fedavg'], distances


# ---------------------------------------------------------------------------
# What crosses placements.


@pytest.mark.parametrize('algorithm', baselines_process_tff.ALGORITHMS)
def test_what_crosses_placements(algorithm, tmp_path):
  kwargs = {}
  if catalog.needs_server_images(algorithm):
    kwargs = dict(server_images=_arrays(20, 9)[0],
                  server_images_dir=str(tmp_path))
  process = (baselines_process_tff.build_baseline_process(
      TINY, algorithm, **kwargs) if kwargs else built.process(algorithm, TINY))
  moved = crossings(process.next)
  baseline = baselines_tf.BASELINES[algorithm]
  # What the clients upload in a round, searched for their extractors'
  # values in any shape (types show shapes only).
  states = process.initialize_clients([1, 2])
  outputs = process.parts.clients_step(
      process.initialize(), states, [_client_data(8, 1), _client_data(8, 2)])
  uploaded = shared_fractions([o.upload for o in outputs],
                              [o.state.extractor for o in outputs])
  assert uploaded.min() > 0.99 if 'extractor' in baseline.shared else (
      uploaded.max() < 0.1), uploaded
  if not baseline.communicates:
    assert moved == []  # Local: nothing is broadcast or aggregated.
    return
  uris = {uri for uri, _ in moved}
  assert 'federated_broadcast' in uris
  shares_extractor = 'extractor' in baseline.shared
  assert bool(leaks(process.next)) == shares_extractor
  server_state = process.next.type_signature.result[0]
  has_extractor = EXTRACTOR_KERNEL_SHAPES & set(tensor_shapes(server_state))
  assert bool(has_extractor) == shares_extractor
  if baseline.collects_client_models:
    assert 'federated_aggregate' in uris


# ---------------------------------------------------------------------------
# Each baseline, end to end.


def _equal(a, b):
  return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_local_trains_alone():
  driver, _, clients0, metrics = _run('local')
  assert int(driver.server_state.round_num) == 1
  assert driver.server_state.shared == {}
  assert not any(k.startswith('server/') for k in metrics)
  # Every client trained on its own data from the shared start: they moved
  # apart.
  for before, after in zip(clients0, driver.client_states):
    assert not np.allclose(before.extractor[0], after.extractor[0])
  assert not np.allclose(driver.client_states[0].classifier[0],
                         driver.client_states[1].classifier[0])


@pytest.mark.parametrize('client_init', ['shared', 'private'])
def test_client_init(client_init):
  """shared: every client starts from the server's initial E and C (one
  draw of the run seed); private: each client's E from its own seed, C
  still the server's."""
  config = dataclasses.replace(TINY, client_init=client_init)
  a, b = (baselines_tf.initial_client_state(config, s)
          for s in driver.client_seeds(config, 2))
  server = baselines_tf.initial_server_state(
      config, baselines_tf.BASELINES['fedavg'], ())
  assert _equal(a.classifier, server.shared['classifier'])
  assert _equal(b.classifier, server.shared['classifier'])
  if client_init == 'shared':
    assert _equal(a.extractor, server.shared['extractor'])
    assert _equal(b.extractor, server.shared['extractor'])
  else:
    assert not np.allclose(a.extractor[0], b.extractor[0])
    assert not np.allclose(a.extractor[0], server.shared['extractor'][0])
  assert int(a.seed) != int(b.seed)


def test_first_round_is_the_same_for_local_fedavg_fedsplit_and_fedgen():
  """Under shared init every client starts round 1 from the same E and C
  whether they come from its state (Local, FedSplit's E) or the broadcast
  (FedAvg), so they train identically in round 1, as the published code's
  Local and FedAvg do; FedGen too, whose generator term starts in round 2
  (FedGen's code), when G has been trained once."""
  local = _run('local')[0].client_states
  for algorithm in ('fedavg', 'fedsplit', 'fedgen'):
    other = _run(algorithm)[0].client_states
    for a, b in zip(local, other):
      assert _equal(a.extractor, b.extractor), algorithm
      assert _equal(a.classifier, b.classifier), algorithm


def test_fedavg_server_takes_weighted_mean_of_clients():
  driver, server0, _, _ = _run('fedavg')
  for name in ('extractor', 'classifier'):
    expected = _weighted_mean([getattr(s, name)
                               for s in driver.client_states])
    _assert_all_close(driver.server_state.shared[name], expected)
    assert not np.allclose(driver.server_state.shared[name][0],
                           server0.shared[name][0])


def test_fedsplit_never_aggregates_the_extractor():
  driver, _, clients0, _ = _run('fedsplit', rounds=2)
  assert set(driver.server_state.shared) == {'classifier'}
  expected = _weighted_mean([s.classifier for s in driver.client_states])
  _assert_all_close(driver.server_state.shared['classifier'], expected)
  # Extractors stay each client's own: trained, and never averaged.
  extractors = [s.extractor[0] for s in driver.client_states]
  assert not np.allclose(extractors[0], extractors[1])
  for before, after in zip(clients0, driver.client_states):
    assert not np.allclose(before.extractor[0], after.extractor[0])


def test_feddf_distils_after_averaging(tmp_path):
  config = dataclasses.replace(TINY, server_steps_per_epoch=5)
  driver, _, _, metrics = _run(
      'feddf', config, server_images=_arrays(30, 9)[0],
      server_images_dir=str(tmp_path))
  assert (tmp_path / 'server_images.tf').exists()
  assert metrics['server/server_loss'] > 0
  assert int(driver.server_state.optimizer_state['step']) == 5
  # Distillation moved the global model away from the plain mean.
  mean = _weighted_mean([s.classifier for s in driver.client_states])
  assert not np.allclose(driver.server_state.shared['classifier'][0],
                         mean[0], atol=1e-6)


def test_fedgen_trains_generator_on_server_and_shares_c_and_g():
  # Two rounds: the clients' generator term starts in the second.
  driver, server0, _, metrics = _run('fedgen', rounds=2)
  assert set(driver.server_state.shared) == {'classifier'}
  assert not np.allclose(driver.server_state.generator[1],
                         server0.generator[1])
  assert int(driver.server_state.optimizer_state['step']) == 6
  for i in range(len(SIZES)):
    assert metrics[f'client_{i}/extra_loss'] > 0  # CE on generated features.
  assert metrics['server/diversity'] > 0
  expected = _weighted_mean([s.classifier for s in driver.client_states])
  _assert_all_close(driver.server_state.shared['classifier'], expected)


@pytest.mark.parametrize('chunk_examples', [8, 512])
def test_fedgen_clients_learn_from_the_broadcast_generator_frozen(
    chunk_examples, monkeypatch):
  """A FedGen client's extra loss is CE(C(G_g(z, y)), y) with the broadcast
  G_g, which it does not train: with a learning rate too small to move C,
  the mean extra loss equals that CE on the same (z, y) draws, and G_g's
  weights are unchanged. A client using another G, or training it, fails.
  G_g runs once a step or once for both steps (training_tf.
  FrozenNetworkLoss)."""
  monkeypatch.setattr(training_tf, 'FROZEN_CHUNK_EXAMPLES', chunk_examples)
  config = dataclasses.replace(TINY, lr=1e-12, weight_decay=0.0)
  baseline = baselines_tf.BASELINES['fedgen']
  nets = baselines_tf.PartyNetworks(config, baseline.client_networks)
  state = baselines_tf.initial_client_state(config, 4)
  generator = model_weights.sample_initial(nets.generator,
                                           tf.constant(99, tf.int64))
  message = baselines_tf.ServerMessage(
      shared={'classifier': state.classifier}, generator=generator,
      round_num=tf.constant(2))
  data = _client_data(16, 1)
  out = baselines_tf.client_update(nets, baseline, message, state, data)
  for a, b in zip(model_weights.values(nets.generator), generator):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  expected = []
  for step, (_, y) in enumerate(data):
    key = (state.seed, training_tf.NOISE_STREAM_GENERATED, 2, step)
    z = training_tf.noise(*key, [len(y), config.noise_dim])
    labels = training_tf.uniform_labels(*key, len(y), config.num_classes)
    expected.append(float(training_tf.cross_entropy(labels, nets.classifier(
        nets.generator([z, labels], training=False)))))
  assert float(out.metrics.extra_loss) == pytest.approx(np.mean(expected),
                                                        abs=1e-5)


def test_collect_gathers_every_client_with_its_weight():
  value_type = tff.types.to_type(
      {'a': tff.TensorType(np.float32, [2]),
       'b': (tff.TensorType(np.int32, [3]),)})
  collect = aggregators_tff.build_collect(value_type)

  @tff.federated_computation(tff.FederatedType(value_type, tff.CLIENTS),
                             tff.FederatedType(np.float32, tff.CLIENTS))
  def gather(values, weights):
    return collect(values, weights)

  values = [{'a': np.full([2], i, np.float32),
             'b': (np.full([3], 10 * i, np.int32),)} for i in range(4)]
  stacked, weights = gather(values, [1.0, 2.0, 3.0, 4.0])
  assert stacked['a'].shape == (4, 2) and stacked['b'][0].shape == (4, 3)
  # Each row still sits with its own weight.
  for row in range(4):
    i = int(weights[row]) - 1
    np.testing.assert_array_equal(stacked['a'][row], np.full([2], i))
    np.testing.assert_array_equal(stacked['b'][0][row], np.full([3], 10 * i))


# ---------------------------------------------------------------------------
# The server steps in plain TensorFlow.


def _confident_classifiers(nets, seeds, scale=20.0):
  """Client classifiers whose ensemble gives sharp, disagreeing logits that
  depend on the features: the hidden layers are widened too, since at their
  initial +-1/sqrt(fan_in) the sigmoids sit near 0.5 whatever the
  features."""
  out = []
  for s in seeds:
    weights = list(model_weights.sample_initial(
        nets.classifier, tf.constant(s, tf.int64)))
    weights[0] = weights[0] * 8.0
    weights[2] = weights[2] * 3.0
    weights[-2] = weights[-2] * scale
    out.append(tuple(weights))
  return out


def _stack(structures):
  return tf.nest.map_structure(lambda *t: tf.stack(t), *structures)


def test_feddf_distillation_lowers_its_kl():
  config = dataclasses.replace(TINY, batch_size=16, lr=1e-3,
                               server_steps_per_epoch=60)
  nets = baselines_tf.PartyNetworks(config)
  baseline = baselines_tf.BASELINES['feddf']
  images = tf.constant(_arrays(64, 3)[0])
  extractors = [model_weights.sample_initial(
      nets.extractor, tf.constant(s, tf.int64)) for s in (1, 2, 3)]
  classifiers = _confident_classifiers(nets, (1, 2, 3))
  weights = tf.constant([16.0, 24.0, 8.0])
  collected = {'extractor': _stack(extractors),
               'classifier': _stack(classifiers)}
  # The student starts from an unrelated sharp model, far from the teacher.
  averaged = {'extractor': model_weights.sample_initial(
                  nets.extractor, tf.constant(9, tf.int64)),
              'classifier': _confident_classifiers(nets, (9,))[0]}
  teacher = baselines_tf.feddf_teacher(nets, collected, weights, images)

  def kl(shared):
    model_weights.assign(nets.extractor, shared['extractor'])
    model_weights.assign(nets.classifier, shared['classifier'])
    return float(training_tf.kl_divergence(
        teacher, nets.classifier(nets.extractor(images))))

  state = baselines_tf.initial_server_state(config, baseline, ())
  new_state, metrics = baselines_tf.server_update(
      nets, baseline, state, (), averaged, collected, weights, images)
  before, after = kl(averaged), kl(new_state.shared)
  assert before > 0.05
  assert after < 0.5 * before, (before, after)
  assert float(metrics.server_loss_last) < float(metrics.server_loss_first)
  # The teacher is the weighted ensemble of the clients' (E_i, C_i).
  direct = 0.0
  for w, e, c in zip([16 / 48, 24 / 48, 8 / 48], extractors, classifiers):
    model_weights.assign(nets.extractor, e)
    model_weights.assign(nets.classifier, c)
    direct += w * nets.classifier(nets.extractor(images)).numpy()
  np.testing.assert_allclose(teacher.numpy(), direct, atol=1e-4)


def test_feddf_distils_from_the_average_not_its_old_model():
  """FedDF's new global (E, C) is `distill` run from the clients' weighted
  average, taught by their ensemble on the round's server images, to float
  rounding (bit for bit on the AMD hosts it ran on; on an Intel Xeon with
  AVX-512 and AMX, family 6 model 167, 5 of E's 150 conv1 weights came
  up to 2.2e-7 apart relatively, at 113b064 as after it). A server that
  distilled from its previous model, or that ignored the average, fails."""
  config = dataclasses.replace(TINY, server_steps_per_epoch=2)
  nets = baselines_tf.PartyNetworks(config)
  baseline = baselines_tf.BASELINES['feddf']
  server_images = tf.constant(_arrays(20, 4)[0])
  draw = lambda net, seed: model_weights.sample_initial(
      net, tf.constant(seed, tf.int64))
  collected = {'extractor': _stack([draw(nets.extractor, s)
                                    for s in (1, 2, 3)]),
               'classifier': _stack(_confident_classifiers(nets, (1, 2, 3)))}
  weights = tf.constant([16.0, 24.0, 8.0])
  averaged = {'extractor': draw(nets.extractor, 9),
              'classifier': draw(nets.classifier, 10)}
  state = baselines_tf.initial_server_state(config, baseline, ())
  new_state, _ = baselines_tf.server_update(
      nets, baseline, state, (), averaged, collected, weights, server_images)

  ref = baselines_tf.PartyNetworks(config)
  images = tf.gather(server_images,
                     baselines_tf.server_data_indices(config, 0, 20))
  teacher = baselines_tf.feddf_teacher(ref, collected, weights, images)
  model_weights.assign(ref.extractor, averaged['extractor'])
  model_weights.assign(ref.classifier, averaged['classifier'])
  student = lambda x: ref.classifier(ref.extractor(x, training=True),
                                     training=True)
  training_tf.distill(ref, state.optimizer_state,
                      baselines_tf._server_trainables(ref, baseline),  # pylint: disable=protected-access
                      student, (images,), teacher)
  for name in ('extractor', 'classifier'):
    for got, want in zip(new_state.shared[name],
                         model_weights.values(ref.model(name))):
      np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6,
                                 atol=1e-8)
  # Two steps of lr 3e-4 stay near the average, far from the old model.
  new = np.asarray(new_state.shared['classifier'][0])
  assert np.allclose(new, averaged['classifier'][0], atol=1e-2)
  assert not np.allclose(new, state.shared['classifier'][0], atol=1e-2)


def test_server_data_indices_cover_the_data_and_follow_the_round():
  config = dataclasses.replace(TINY, batch_size=10, server_steps_per_epoch=5)
  a = baselines_tf.server_data_indices(config, 0, 20).numpy()
  assert len(a) == config.distill_samples == 50
  assert sorted(a[:20]) == list(range(20))  # First pass: a permutation.
  np.testing.assert_array_equal(
      a, baselines_tf.server_data_indices(config, 0, 20).numpy())
  assert not np.array_equal(
      a, baselines_tf.server_data_indices(config, 1, 20).numpy())
  # Under replay_draws (the published code's reseeding) every round is
  # round 0's.
  replay = dataclasses.replace(config, replay_draws=True)
  np.testing.assert_array_equal(
      a, baselines_tf.server_data_indices(replay, 1, 20).numpy())


@pytest.mark.parametrize('replay', [True, False])
def test_fedgen_replay_draws_repeat_the_clients_and_servers_noise(replay):
  """Under replay_draws (the published code's reseeding) FedGen's clients
  draw the same (z, y) whatever their seed and round, and its server the
  same in every round; with fresh draws they differ."""
  config = dataclasses.replace(TINY, lr=1e-12, weight_decay=0.0,
                               replay_draws=replay)
  baseline = baselines_tf.BASELINES['fedgen']
  nets = baselines_tf.PartyNetworks(config, baseline.client_networks)
  generator = model_weights.sample_initial(nets.generator,
                                           tf.constant(99, tf.int64))
  extra = []
  for seed, round_num in ((4, 2), (5, 6)):
    state = baselines_tf.initial_client_state(config, seed)
    message = baselines_tf.ServerMessage(
        shared={'classifier': state.classifier}, generator=generator,
        round_num=tf.constant(round_num))
    out = baselines_tf.client_update(nets, baseline, message, state,
                                     _client_data(16, 1))
    extra.append(float(out.metrics.extra_loss))
  assert (extra[0] == extra[1]) == replay, extra
  classifiers = _stack([nets.classifier.get_weights()] * 2)
  optimizer_state = training_tf.initial_optimizer_state(
      training_tf.server_optimizer(config), nets.generator.trainable_variables)
  ces = []
  for round_num in (0, 3):
    model_weights.assign(nets.generator, generator)
    ces.append(tf.function(lambda r=round_num: baselines_tf.train_generator(
        nets, optimizer_state, classifiers, tf.constant([1.0, 1.0]),
        tf.constant(r)))()[1].numpy())
  assert np.array_equal(*ces) == replay


def test_fedgen_generator_training_lowers_ensemble_ce():
  config = dataclasses.replace(TINY, batch_size=16, lr=3e-3,
                               server_steps_per_epoch=80)
  nets = baselines_tf.PartyNetworks(config)
  model_weights.assign(nets.generator, model_weights.sample_initial(
      nets.generator, tf.constant(1, tf.int64)))
  classifiers = _stack(_confident_classifiers(nets, (4, 5, 6)))
  weights = training_tf.normalized_weights(tf.constant([1.0, 2.0, 3.0]))
  z = tf.random.stateless_normal([64, 100], [7, 7])
  y = tf.constant(np.arange(64) % 10, tf.int32)

  def ensemble_ce():
    features = nets.generator([z, y], training=False)
    return float(training_tf.cross_entropy(
        y, baselines_tf.ensemble_logits(nets, classifiers, weights,
                                        features)))

  before = ensemble_ce()
  optimizer_state = training_tf.initial_optimizer_state(
      training_tf.server_optimizer(config),
      nets.generator.trainable_variables)
  _, ces, diversity = tf.function(lambda: baselines_tf.train_generator(
      nets, optimizer_state, classifiers, tf.constant([1.0, 2.0, 3.0]),
      tf.constant(0)))()
  after = ensemble_ce()
  assert after < 0.7 * before, (before, after)
  assert ces.shape == (80,)
  # The diversity term's effect: test_fedgen_diversity_weight_spreads_...
  assert np.isfinite(float(diversity))


def test_fedgen_diversity_weight_spreads_the_generator():
  """The diversity term is in G's loss, scaled by `diversity_weight`: from
  the same start, a large weight ends with a lower diversity loss (more
  spread features) than none, and the two generators differ."""
  outcomes = []
  for weight in (0.0, 10.0):
    config = dataclasses.replace(TINY, batch_size=16, lr=3e-3,
                                 server_steps_per_epoch=30,
                                 diversity_weight=weight)
    nets = baselines_tf.PartyNetworks(config)
    model_weights.assign(nets.generator, model_weights.sample_initial(
        nets.generator, tf.constant(1, tf.int64)))
    optimizer_state = training_tf.initial_optimizer_state(
        training_tf.server_optimizer(config),
        nets.generator.trainable_variables)
    tf.function(lambda: baselines_tf.train_generator(
        nets, optimizer_state,  # pylint: disable=cell-var-from-loop
        _stack(_confident_classifiers(nets, (4, 5, 6))),  # pylint: disable=cell-var-from-loop
        tf.constant([1.0, 2.0, 3.0]), tf.constant(0)))()
    z = tf.random.stateless_normal([64, 100], [7, 7])
    y = tf.constant(np.tile(np.arange(32) % 10, 2), tf.int32)
    features = nets.generator([z, y], training=False)
    outcomes.append((float(baselines_tf.diversity_loss(features, z)),
                     model_weights.values(nets.generator)[0].numpy()))
  (without, g_without), (with_term, g_with) = outcomes
  print(f'diversity loss: weight 0 {without:.4f}, weight 10 {with_term:.4f}')
  assert with_term < 0.8 * without, (without, with_term)
  assert not np.allclose(g_without, g_with)


def test_diversity_loss_rewards_spread():
  z = tf.random.stateless_normal([8, 100], [1, 2])
  same = tf.ones([8, 5, 5, 16])
  spread = tf.concat([tf.zeros([4, 5, 5, 16]), tf.ones([4, 5, 5, 16])], 0)
  assert float(baselines_tf.diversity_loss(same, z)) == pytest.approx(1e5)
  assert float(baselines_tf.diversity_loss(spread, z)) < 2.0


def test_proximal_term_gradient_is_w_minus_reference():
  v = [tf.Variable([1.0, 2.0]), tf.Variable([[3.0]])]
  ref = [tf.constant([0.0, 4.0]), tf.constant([[1.0]])]
  with tf.GradientTape() as tape:
    term = baselines_tf.proximal_term(v, ref)
  assert float(term) == pytest.approx(0.5 * (1 + 4 + 4))
  grads = tape.gradient(term, v)
  np.testing.assert_allclose(grads[0].numpy(), [1.0, -2.0])
  np.testing.assert_allclose(grads[1].numpy(), [[2.0]])


def test_unknown_algorithm_and_missing_server_data():
  with pytest.raises(ValueError, match="algorithm must be one of"):
    catalog.build('fedsgd', TINY, 2)
  with pytest.raises(ValueError, match='feddf needs server_images'):
    catalog.build('feddf', TINY, 2)


def test_a_plain_process_is_built_once_per_config(monkeypatch):
  """An equal config gives the process already built (a process holds no
  state); another config or training device, or an aggregator of the
  caller's, a new one."""
  local = catalog.build_process('local', TINY)
  assert catalog.build_process('local', dataclasses.replace(TINY)) is local
  assert catalog.build_process(
      'local', dataclasses.replace(TINY, seed=TINY.seed + 1)) is not local
  with monkeypatch.context() as patch:
    patch.setattr(devices, '_training_device', '/device:CPU:0')
    assert catalog.build_process('local', TINY) is not local
  with_factory = catalog.build_process(
      'fedavg', TINY, aggregation_factory=tff.aggregators.MeanFactory())
  assert with_factory is not catalog.build_process('fedavg', TINY)


def test_update_baselines_keep_noised_batch_norm_variances_valid():
  """With DP, fedavg's server adds a noised mean update: a moving variance
  pushed below 0 (NaN at inference) is clamped to 0, every other weight
  keeps the update. ResNet-18's extractor has batch norm (LeNet's none)."""
  config = dataclasses.replace(built.TINY, model='resnet18')
  baseline = dataclasses.replace(baselines_tf.BASELINES['fedavg'],
                                 upload_update=True)
  nets = baselines_tf.PartyNetworks(config, baseline.server_networks)
  state = baselines_tf.initial_server_state(config, baseline, ())
  down = {name: tuple(tf.fill(tf.shape(w), -2.0) for w in weights)
          for name, weights in state.shared.items()}
  new_state, _ = baselines_tf.server_update(nets, baseline, state, (), down)
  names = [w.name for w in nets.extractor.weights]
  assert sum('moving_variance' in n for n in names) >= 10
  for name in baseline.shared:
    for weight, old, new in zip(nets.model(name).weights,
                                state.shared[name], new_state.shared[name]):
      want = (np.zeros_like(old) if 'moving_variance' in weight.name
              else old.numpy() - 2.0)
      np.testing.assert_allclose(new.numpy(), want, atol=1e-6,
                                 err_msg=weight.name)


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
