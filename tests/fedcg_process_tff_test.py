"""The TFF layer: placements, the federated teacher, rounds end to end."""

import dataclasses

import attrs
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fedcg_tff.algorithms import catalog
from fedcg_tff.algorithms import fedcg_process_tff as fedcg
from fedcg_tff.algorithms import fedcg_tf
from fedcg_tff.privacy import dp
from fedcg_tff.program import driver
from fedcg_tff.program import round_loop
from fedcg_tff.program import run_files
from tests import built
from tests import placement
from tests.placement import EXTRACTOR_KERNEL_SHAPES
from tests.placement import crossings as _crossings
from tests.placement import leaks as _leaks
from tests.placement import tensor_shapes as _tensor_shapes

TINY = built.TINY


def _client_data(n, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 32, 32, 1)).astype(np.float32)
  y = rng.integers(0, 10, n).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


@pytest.fixture(scope='module')
def process():
  return built.process('fedcg', TINY)


@pytest.fixture(scope='module')
def init_clients(process):
  return process.initialize_clients


def test_no_extractor_crosses_a_placement(process, init_clients):
  crossings = _crossings(process.next)
  uris = {uri for uri, _ in crossings}
  # The check sees the round's broadcast and its aggregation ...
  assert 'federated_broadcast' in uris
  assert uris & {'federated_mean', 'federated_weighted_mean', 'federated_sum',
                 'federated_aggregate'}
  # ... and none of them carries an extractor kernel.
  assert _leaks(process.next) == []
  for comp in (process.initialize, init_clients, process.evaluate):
    assert _leaks(comp) == []
  # The server state never holds one either; the client state does, at
  # CLIENTS only (so the shape check above is looking for the right thing).
  server_out, clients_out, _ = process.next.type_signature.result
  assert server_out.placement is tff.SERVER
  assert not EXTRACTOR_KERNEL_SHAPES & set(_tensor_shapes(server_out))
  assert clients_out.placement is tff.CLIENTS
  assert EXTRACTOR_KERNEL_SHAPES <= set(_tensor_shapes(clients_out))


def test_no_extractor_value_is_uploaded(process, init_clients):
  """What a round's clients upload, searched for their extractors' values
  before and after the round: none is there, in any shape (the types'
  check above sees shapes only)."""
  states = init_clients([1, 2])
  outputs = process.parts.clients_step(
      process.initialize(), states,
      [_client_data(16, 1), _client_data(16, 2)])
  uploads = [o.upload for o in outputs]
  assert placement.shared_fractions(
      uploads, _extractors(states, outputs)).max() < 0.1
  # The search does look through the upload (C_i is in it, all of it) ...
  assert placement.shared_fractions(
      uploads, [o.upload.classifier for o in outputs]).min() == 1.0
  # ... finds an extractor hidden as one vector of all its weights ...
  hidden = [np.concatenate([np.ravel(w) for w in o.state.extractor])
            for o in outputs]
  assert placement.shared_fractions(
      hidden, [o.state.extractor for o in outputs]).min() == 1.0
  # ... and its first convolution alone (150 of its 2550 kernel values).
  first = [*uploads, outputs[0].state.extractor[0].ravel()]
  assert placement.shared_fractions(
      first, _extractors(states, outputs)).max() == 1.0


def _extractors(states, outputs):
  """Each client's E_i before and after the round. (Not its update: after
  a few Adam steps an update's values are near +-lr and shared by every
  network's update, bit for bit, so a search for them finds them all.)"""
  return ([s.extractor for s in states] +
          [o.state.extractor for o in outputs])


def test_leak_check_catches_a_leaky_computation(init_clients):
  state_type = init_clients.type_signature.result

  @tff.federated_computation(state_type)
  def leaky(client_states):
    return tff.federated_mean(client_states.extractor)

  assert _leaks(leaky) == ['federated_mean']

  # A flattened (or otherwise reshaped) extractor kernel is caught too.
  flatten = tff.tensorflow.computation(
      lambda extractor: tf.reshape(extractor[2], [-1]),
      state_type.member.extractor)

  @tff.federated_computation(state_type)
  def flattened(client_states):
    return tff.federated_mean(tff.federated_map(flatten,
                                                client_states.extractor))

  assert _leaks(flattened) == ['federated_mean']


def test_leak_check_knows_each_family_s_extractor():
  assert placement.extractor_kernels('lenet', 1) == EXTRACTOR_KERNEL_SHAPES
  resnet = placement.extractor_kernels('resnet18', 3)
  assert (7, 7, 3, 64) in resnet and (3, 3, 128, 128) in resnet
  assert not resnet & placement.extractor_kernels('lenet', 3)


def _equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_shared_client_init_starts_every_client_from_the_servers_networks(
    init_clients):
  a, b = init_clients([3, 4])
  server = fedcg_tf.initial_server_state(TINY, ())
  for name in ('extractor', 'classifier', 'discriminator'):
    assert _equal(getattr(a, name), getattr(b, name)), name
  assert _equal(a.classifier, server.classifier)
  # The draw is the run seed's: another run seed gives other networks.
  other = fedcg_tf.initial_client_state(dataclasses.replace(TINY, seed=2), 3)
  assert not np.allclose(a.extractor[0], other.extractor[0])
  # Each client keeps its own noise seed.
  assert int(a.seed) == 3 and int(b.seed) == 4


def test_private_client_init_draws_e_and_d_from_the_clients_seed():
  config = dataclasses.replace(TINY, client_init='private')
  a, again, b = (fedcg_tf.initial_client_state(config, s) for s in (3, 3, 4))
  for name in ('extractor', 'discriminator'):
    assert _equal(getattr(a, name), getattr(again, name)), name  # Seeded.
    assert not np.allclose(getattr(a, name)[0], getattr(b, name)[0]), name
  # C is shared: every client starts from the server's C_g.
  server = fedcg_tf.initial_server_state(config, ())
  assert _equal(a.classifier, b.classifier)
  assert _equal(a.classifier, server.classifier)


def test_first_round_equals_locals_under_shared_init(process):
  """As in the published code: with the same initial networks and gamma = 0
  in round 1, FedCG's stage 1 is Local's training, so every client's E and C
  after round 1 (what the evaluation scores) are Local's."""
  data = [_client_data(16, 1), _client_data(24, 2)]
  fedcg_run = driver.Driver(TINY, 2, process)
  local_run = catalog.build('local', TINY, 2)
  fedcg_metrics = fedcg_run.run_round(0, data)
  local_run.run_round(0, data)
  assert fedcg_metrics['mean/gamma'] == 0.0
  for ours, local in zip(fedcg_run.client_states, local_run.client_states):
    assert _equal(ours.extractor, local.extractor)
    assert _equal(ours.classifier, local.classifier)


def test_rounds_are_reproducible_bit_for_bit(process):
  """Two drivers of the same process and seed give the same states after
  two rounds: every random draw is keyed (seed, stream, round, step), none
  comes from TF's global random state. (The pass-order race of
  training_tf.PASS_ORDER_NOTE showed between processes only; the binary's
  resume test compares runs across processes.)"""
  runs = [driver.Driver(TINY, 2, process) for _ in range(2)]
  for run in runs:
    for r in range(2):
      run.run_round(r, [_client_data(16, 3 + r), _client_data(24, 4)])
  a, b = (tf.nest.flatten(run.state()) for run in runs)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


def test_teacher_by_federated_mean_equals_direct_ensemble(process,
                                                           init_clients):
  """The n_i-weighted mean of the teacher logits the clients upload is the
  logits of the weighted ensemble of their (G_i, C_i), computed here
  directly: averaging logits on the server needs no client model there."""
  upload_type = process.parts.clients_step.type_signature.result.member.upload
  mean_of = tff.aggregators.MeanFactory().create(upload_type,
                                                 tff.TensorType(np.float32))
  noise, labels = fedcg_tf.distillation_inputs(TINY, 0)
  sizes = [8, 24, 40]  # Unequal weights.
  outputs = process.parts.clients_step(
      process.initialize(), init_clients([1, 2, 3]),
      [_client_data(n, i) for i, n in enumerate(sizes)])
  uploads = [o.upload for o in outputs]
  weights = [o.weight for o in outputs]
  mean = mean_of.next(mean_of.initialize(), uploads, weights).result
  assert [float(w) for w in weights] == sizes

  w = np.array(sizes, np.float64) / sum(sizes)
  nets = fedcg_tf.PartyNetworks(TINY)
  direct = 0.0
  for wi, upload in zip(w, uploads):
    nets.generator.set_weights(upload.generator)
    nets.classifier.set_weights(upload.classifier)
    logits = nets.classifier(nets.generator([noise, labels], training=False),
                             training=False)
    direct = direct + wi * logits.numpy()
  # The client-computed teachers differ, so the mean is a real ensemble.
  assert not np.allclose(uploads[0].teacher_logits, uploads[2].teacher_logits)
  np.testing.assert_allclose(mean.teacher_logits, direct, atol=1e-4, rtol=1e-4)


def test_dp_fedcg_without_noise_is_fedcg(process):
  """DP-FedCG's clients upload G_i - G_g and C_i - C_g and the server adds
  the mean back: with no noise, clips that clip nothing and equal client
  sizes (the DP mean is uniform), its round is FedCG's."""
  dp_process = fedcg.build_fedcg_process(
      TINY, dp.fedcg_mean_factory(0.0, 1e9, 1e9, 2), upload_updates=True)
  data = [_client_data(16, 5), _client_data(16, 6)]
  runs = [driver.Driver(TINY, 2, p) for p in (process, dp_process)]
  for run in runs:
    run.run_round(0, data)
  plain, private = (run.server_state for run in runs)
  for name in ('generator', 'classifier'):
    for a, b in zip(getattr(plain, name), getattr(private, name)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  # What DP-FedCG's clients upload (updates of G and C) holds no value of
  # E_i and, by the types of its crossings, nothing shaped as its kernels.
  states = dp_process.initialize_clients([1, 2])
  outputs = dp_process.parts.clients_step(dp_process.initialize(), states,
                                          data)
  assert placement.shared_fractions(
      [o.upload for o in outputs], _extractors(states, outputs)).max() < 0.1
  assert _leaks(dp_process.next) == []


def test_dp_fedcg_noises_and_clips_each_part_of_each_upload(process,
                                                             init_clients):
  """`dp.fedcg_mean_factory` on real FedCG uploads: the mean of n clients
  carries noise of std sigma / sqrt(n) in every part (each client drew std
  sigma), each part is clipped on its own, and the noise is drawn on the
  clients."""
  upload_type = process.parts.clients_step.type_signature.result.member.upload
  weight_type = tff.TensorType(np.float32)
  outputs = process.parts.clients_step(
      process.initialize(), init_clients([1, 2]),
      [_client_data(16, 1), _client_data(16, 2)])
  uploads = [o.upload for o in outputs]

  def mean(sigma, clip, teacher_clip):
    agg = dp.fedcg_mean_factory(sigma, clip, teacher_clip, 2).create(
        upload_type, weight_type)
    return agg.next(agg.initialize(), uploads, [16.0, 16.0]).result

  flat = lambda part: np.concatenate([np.ravel(x) for x in
                                      tf.nest.flatten(part)])
  exact = mean(0.0, 1e9, 1e9)
  tf.random.set_seed(0)
  noised = mean(0.2, 1e9, 1e9)
  for name in ('generator', 'classifier', 'teacher_logits'):
    plain = np.mean([flat(getattr(u, name)) for u in uploads], axis=0)
    np.testing.assert_allclose(flat(getattr(exact, name)), plain, rtol=1e-5,
                               atol=1e-5)
    residual = flat(getattr(noised, name)) - plain
    # Four standard errors of a std estimated from this many draws (the
    # 240 teacher logits of TINY: 18%), far from sigma or sigma / 2.
    tolerance = 4 / np.sqrt(2 * residual.size)
    assert np.std(residual) == pytest.approx(0.2 / np.sqrt(2),
                                             rel=tolerance), name
  # Clipped part by part: each client's G and C to norm 1, its logits to 2
  # (all far above), then averaged. A clip of the whole upload at once, or
  # none, gives another mean.
  clipped = mean(0.0, 1.0, 2.0)
  for name, clip in (('generator', 1.0), ('classifier', 1.0),
                     ('teacher_logits', 2.0)):
    parts = [flat(getattr(u, name)) for u in uploads]
    assert min(np.linalg.norm(p) for p in parts) > 2 * clip, name
    expected = np.mean([p * clip / np.linalg.norm(p) for p in parts], axis=0)
    np.testing.assert_allclose(flat(getattr(clipped, name)), expected,
                               rtol=1e-4, atol=1e-6, err_msg=name)
  agg = dp.fedcg_mean_factory(0.2, 1.0, 3.0, 2).create(upload_type,
                                                       weight_type)
  ops = placement.tf_ops_by_placement(agg.next)
  random = lambda found: {op for op in found if 'Random' in op}
  assert random(ops[tff.CLIENTS]) and not random(ops.get(tff.SERVER, ()))


def test_dp_fedcg_epsilon_is_dp_accountings():
  """Three Gaussian mechanisms a round (G's and C's updates at sigma/clip,
  the logits at sigma/teacher_clip), composed over the rounds."""
  import dp_accounting  # pylint: disable=g-import-not-at-top
  sigma, clip, teacher_clip, rounds = 1.0, 0.5, 2.0, 7
  accountant = dp_accounting.rdp.RdpAccountant(dp.RDP_ORDERS)
  accountant.compose(dp_accounting.ComposedDpEvent([
      dp_accounting.GaussianDpEvent(sigma / clip),
      dp_accounting.GaussianDpEvent(sigma / clip),
      dp_accounting.GaussianDpEvent(sigma / teacher_clip)]), rounds)
  expected = accountant.get_epsilon(1e-5)
  got = dp.fedcg_epsilon(sigma, clip, teacher_clip, rounds, 1e-5)
  assert got == pytest.approx(expected, rel=1e-9)
  # More than one mechanism's epsilon: all three are counted.
  assert got > dp.epsilon(sigma, clip, rounds, 1e-5)
  described = dp.describe(sigma, clip, rounds, 1e-5, teacher_clip=teacher_clip)
  assert described['epsilon'] == got
  assert described['mechanisms_per_round'] == 3


def test_two_rounds_end_to_end(process, init_clients):
  server_state = process.initialize()
  initial_server = server_state
  assert int(server_state.round_num) == 0
  client_states = init_clients([11, 12, 13])
  initial = client_states
  for round_num in range(2):
    data = [_client_data(16 + 8 * i, 100 * round_num + i) for i in range(3)]
    server_state, client_states, metrics = process.next(
        server_state, client_states, data)
    assert int(server_state.round_num) == round_num + 1
    assert [int(m.num_examples) for m in metrics.clients] == [16, 24, 32]
    assert all(np.isfinite(float(v)) for m in metrics.clients
               for v in attrs.astuple(m))
    assert float(metrics.server.distill_kl) > 0
    # The ramp's gamma of this round (p = round index / 50): 0 in the first
    # round, as in the published code; 2 / (1 + e^-0.2) - 1 in the second.
    for m in metrics.clients:
      assert float(m.gamma) == pytest.approx([0.0, 0.099668][round_num],
                                             abs=1e-6)
  # The private pieces of every client's state moved; its seed did not.
  for n, before, after in zip([16, 24, 32], initial, client_states):
    for name in ('extractor', 'discriminator'):
      assert not np.allclose(getattr(before, name)[0],
                             getattr(after, name)[0]), name
    batches = -(-n // 8)  # One epoch of each stage, two rounds.
    for opt in ('classification_optimizer', 'discriminator_optimizer',
                'generator_optimizer'):  # Persisted across both rounds.
      assert int(getattr(after, opt)['step']) == 2 * batches, opt
    assert int(after.seed) == int(before.seed)
  # G_g and C_g moved.
  for name in ('generator', 'classifier'):
    assert not np.allclose(getattr(initial_server, name)[1],
                           getattr(server_state, name)[1]), name
  # Clients personalise: their extractors differ from each other.
  assert not np.allclose(client_states[0].extractor[0],
                         client_states[1].extractor[0])
  assert int(server_state.optimizer_state['step']) == 2 * TINY.distill_steps

  # Accuracy is counted, per client on its own data: each client's
  # validation and test accuracy equal its own count on its own split.
  val = [_client_data(20, 7 + i) for i in range(3)]
  test = [_client_data(12, 17 + i) for i in range(3)]
  results = process.evaluate(client_states, val, test)
  assert len(results) == 3
  nets = fedcg_tf.PartyNetworks(TINY)

  def counted(state, data):
    x, y = (np.concatenate(parts) for parts in
            zip(*data.as_numpy_iterator()))
    nets.extractor.set_weights(state.extractor)
    nets.classifier.set_weights(state.classifier)
    pred = np.argmax(nets.classifier(nets.extractor(x)).numpy(), axis=1)
    return np.mean(pred == y)

  for state, r, v, t in zip(client_states, results, val, test):
    assert float(r.val_accuracy) == pytest.approx(counted(state, v))
    assert float(r.test_accuracy) == pytest.approx(counted(state, t))


def test_algorithm_runs_under_experiment_loop(process, tmp_path):
  algorithm = driver.Driver(TINY, 2, process)
  writer = run_files.MetricsWriter(str(tmp_path))
  result = round_loop.run(
      algorithm,
      train_data_fn=lambda r: [_client_data(16, r), _client_data(8, r + 1)],
      val_data=[_client_data(8, 5)] * 2, test_data=[_client_data(8, 6)] * 2,
      max_rounds=2, patience=5, writer=writer, log=lambda _: None)
  assert result.rounds_run == 2
  rows = (tmp_path / 'metrics.csv').read_text().splitlines()
  assert len(rows) == 3  # header + 2 rounds
  header = rows[0].split(',')
  for key in ('server/distill_kl', 'mean/gamma', 'client_1/d_loss',
              'client_0/val_accuracy', 'mean/cls_loss', 'round_seconds'):
    assert key in header
  assert list((tmp_path / 'tensorboard').iterdir())


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
