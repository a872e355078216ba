"""Client sampling at cross-device scale: which clients a round samples, the
on-disk client-state store (versions, rollback, memory bound), rounds that
touch only the sampled clients, resume after a crash mid-round, and the
binary's --clients_per_round."""

import csv
import dataclasses
import json
import os
import re
import shutil
import tracemalloc

import attrs
import numpy as np
import pytest
import tensorflow as tf

from fedcg_tff import config
from fedcg_tff.algorithms import baselines_tf
from fedcg_tff.algorithms import training_tf
from fedcg_tff.program import checkpoint
from fedcg_tff.program import client_store
from fedcg_tff.program import driver
from fedcg_tff.program import round_loop
from fedcg_tff.program import run_files
from tasks import image_task
from tests import binary_runs
from tests import built
from tests import fake_data

TINY = built.TINY
NUM_CLIENTS = 52
PER_ROUND = 5


def _dataset(client, salt):
  rng = np.random.default_rng([client, salt])
  return tf.data.Dataset.from_tensor_slices(
      (rng.normal(size=(8, 32, 32, 1)).astype(np.float32),
       rng.integers(0, 10, 8).astype(np.int32))).batch(8)


def _train_data(round_num, built=None, salt=0, num_clients=NUM_CLIENTS):
  """Round `round_num`'s datasets, built lazily; `built` collects which."""
  def build(i):
    if built is not None:
      built.append(i)
    return _dataset(i, 1000 * salt + round_num)
  return image_task.ClientDatasets(num_clients, build)


def _eval_data(num_clients=NUM_CLIENTS):
  """Fresh dataset objects (same contents every call)."""
  return ([_dataset(i, 900_001) for i in range(num_clients)],
          [_dataset(i, 900_002) for i in range(num_clients)])


@pytest.fixture(scope='module')
def process():
  """FedAvg's process, built once (tracing it is most of a driver's cost)."""
  return built.process('fedavg', TINY)


def _driver(process, states_dir=None, per_round=PER_ROUND,
            num_clients=NUM_CLIENTS):
  return driver.Driver(TINY, num_clients, process,
                       client_store.ClientSampling(per_round, states_dir))


def _bytes(state):
  """A state's exact content, for bit-for-bit comparisons."""
  return {k: v.tobytes() for k, v in checkpoint.pack(state).items()}


def _stored(directory):
  """Every client file's arrays as bytes, by file name (the files' own
  bytes hold zip timestamps)."""
  out = {}
  for name in sorted(os.listdir(directory)):
    with np.load(os.path.join(directory, name)) as f:
      out[name] = {k: f[k].tobytes() for k in f.files}
  return out


def _client_of(file_name):
  return int(file_name[len('client_'):len('client_') + 5])


# ---------------------------------------------------------------------------
# The driver without sampling: evaluation, states on disk, the fault check.


def test_evaluation_scores_each_client_with_its_own_networks(process):
  """Client i's validation and test accuracy are those of its own E_i, C_i
  on its own splits: labels are set so that each client's own predictions
  score a known, different fraction on each split; scoring with another
  client's networks, or on the other split, gives other figures."""
  n = 3
  algorithm = _driver(process, per_round=None, num_clients=n)
  # Clients whose predictions differ: private initial draws of E and C,
  # widened, each client's output units rotated (at their initial scale a
  # sigmoid LeNet predicts nearly one class whatever the input).
  private = dataclasses.replace(TINY, client_init='private')
  states = []
  for i, seed in enumerate(driver.client_seeds(private, n)):
    state = tf.nest.map_structure(np.asarray, baselines_tf.initial_client_state(
        private, seed))
    classifier = [8 * w for w in state.classifier]
    classifier[-2:] = [np.roll(w, 3 * i, axis=-1) for w in classifier[-2:]]
    states.append(attrs.evolve(
        state, extractor=tuple(8 * w for w in state.extractor),
        classifier=tuple(classifier)))
  algorithm.restore((algorithm.server_state, states))
  rng = np.random.default_rng(3)
  images = [rng.normal(size=(20, 32, 32, 1)).astype(np.float32)
            for _ in range(2 * n)]
  nets = training_tf.PartyNetworks(
      TINY, ('extractor', 'classifier'))
  own = {'val': [15, 5, 10], 'test': [2, 18, 12]}  # Correct out of 20.
  splits = {'val': [], 'test': []}
  for i, state in enumerate(algorithm.client_states):
    nets.extractor.set_weights(state.extractor)
    nets.classifier.set_weights(state.classifier)
    for k, split in enumerate(('val', 'test')):
      x = images[2 * i + k]
      predicted = np.argmax(nets.classifier(nets.extractor(x)), axis=-1)
      labels = np.where(np.arange(20) < own[split][i], predicted,
                        (predicted + 1) % 10).astype(np.int32)
      splits[split].append(
          tf.data.Dataset.from_tensor_slices((x, labels)).batch(8))
  guard = []
  for state in algorithm.client_states:
    nets.extractor.set_weights(state.extractor)
    nets.classifier.set_weights(state.classifier)
    guard.append(np.argmax(nets.classifier(nets.extractor(images[0])), -1))
  assert len({tuple(g) for g in guard}) == n  # The clients disagree.
  val, test = algorithm.evaluate(splits['val'], splits['test'])
  assert val == pytest.approx([v / 20 for v in own['val']])
  assert test == pytest.approx([t / 20 for t in own['test']])


def test_states_on_disk_without_sampling_give_the_memory_run(process,
                                                             tmp_path):
  """--client_states_on_disk with every client in every round: the same
  rounds, metrics and states as in memory, every client's state in its
  file and none held by the driver."""
  n = 3
  memory = _driver(process, per_round=None, num_clients=n)
  disk = _driver(process, str(tmp_path), per_round=None, num_clients=n)
  assert disk.states_on_disk and disk.state()[1] == []
  for r in range(2):
    data = [_dataset(i, 10 + r) for i in range(n)]
    assert memory.run_round(r, data) == disk.run_round(r, data)
  for i, state in enumerate(memory.client_states):
    assert _bytes(disk.load_client_states([i])[0]) == _bytes(state)
    assert disk.client_store.versions(i) == [1, 2]
  assert memory.evaluate(*_eval_data(n)) == disk.evaluate(*_eval_data(n))


def test_a_non_finite_round_stores_nothing(process, tmp_path):
  """A round whose training goes non-finite raises NumericalFault naming
  the client, before the driver keeps its server state or stores a client
  state (the round's one finiteness check)."""
  n = 3
  algorithm = _driver(process, str(tmp_path), per_round=None, num_clients=n)
  algorithm.run_round(0, [_dataset(i, 1) for i in range(n)])
  server, files = _bytes(algorithm.server_state), _stored(str(tmp_path))
  data = [_dataset(i, 2) for i in range(n)]
  data[1] = data[1].map(lambda x, y: (x * float('nan'), y))
  with pytest.raises(round_loop.NumericalFault, match=r'round 2, client 1'):
    algorithm.run_round(1, data)
  assert _bytes(algorithm.server_state) == server
  assert _stored(str(tmp_path)) == files


# ---------------------------------------------------------------------------
# Sampling.


def test_sampling_is_deterministic_sorted_and_varies():
  rounds = [client_store.sample_clients(7, r, NUM_CLIENTS, PER_ROUND)
            for r in range(20)]
  assert rounds == [client_store.sample_clients(7, r, NUM_CLIENTS, PER_ROUND)
                    for r in range(20)]  # A resumed run draws the same.
  for ids in rounds:
    assert ids == sorted(set(ids)) and len(ids) == PER_ROUND
    assert 0 <= ids[0] and ids[-1] < NUM_CLIENTS
  assert len({tuple(ids) for ids in rounds}) == 20  # Each round its own.
  assert client_store.sample_clients(8, 0, NUM_CLIENTS, PER_ROUND) != rounds[0]
  # Over many rounds every client is drawn about equally often.
  counts = np.bincount(np.concatenate(
      [client_store.sample_clients(7, r, NUM_CLIENTS, PER_ROUND)
       for r in range(2000)]), minlength=NUM_CLIENTS)
  expected = 2000 * PER_ROUND / NUM_CLIENTS
  assert counts.min() > 0.7 * expected and counts.max() < 1.3 * expected
  # Everyone, in order, when every client takes part: the unsampled driver.
  assert client_store.sample_clients(7, 3, 4, 4) == [0, 1, 2, 3]
  with pytest.raises(ValueError, match=r'clients_per_round must be in '
                     r'\[1, 4\] \(the number of clients\), got 5'):
    client_store.sample_clients(7, 0, 4, 5)


def test_client_seeds_are_distinct_across_runs_and_keep_old_runs(process):
  seeds = {s: driver.client_seeds(dataclasses.replace(TINY, seed=s), 2100)
           for s in (0, 1, 2, config.MAX_SEED)}
  # Clients below 1000 keep the seeds every committed run used.
  assert seeds[1][:3] == [1001, 1002, 1003] and seeds[2][999] == 3000
  every = [v for per_run in seeds.values() for v in per_run]
  assert len(set(every)) == len(every)  # Client 1000 of seed 1 was seed 2's 0.
  # Clients from 1000 on draw as no run's server either.
  assert min(v for per_run in seeds.values() for v in per_run[1000:]) > (
      config.MAX_SEED)
  assert max(every) < 2**63  # TFF passes them as int64.
  # Drawn from: client 1000 of seed 1 and client 0 of seed 2 start apart.
  private = dataclasses.replace(TINY, client_init='private')
  first, second = (baselines_tf.initial_client_state(private, s).extractor
                   for s in (seeds[1][1000], seeds[2][0]))
  assert not np.array_equal(first[0], second[0])
  # Through TFF's int64 client placement, the largest seed arrives whole.
  largest = seeds[config.MAX_SEED][-1]
  state, = process.initialize_clients([largest])
  assert int(state.seed) == largest


def test_driver_refuses_more_clients_per_round_than_clients(process):
  with pytest.raises(ValueError, match=rf'clients_per_round must be in '
                     rf'\[1, {NUM_CLIENTS}\].*got {NUM_CLIENTS + 1}'):
    _driver(process, per_round=NUM_CLIENTS + 1)


# ---------------------------------------------------------------------------
# The on-disk store alone (numpy states, a counting initializer).


def _toy_state(value):
  return {'w': np.full([3], value, np.float32), 'step': np.int64(value)}


def test_disk_store_keeps_three_versions_and_rolls_back(tmp_path):
  initialized = []

  def initialize(ids):
    initialized.extend(ids)
    return [_toy_state(-i) for i in ids]

  def open_store():
    return client_store.DiskClientStore(str(tmp_path), 4, initialize,
                                        _toy_state(0))

  store = open_store()
  values = lambda ids: [float(s['w'][0]) for s in store.load(ids)]
  assert values([0, 1, 2, 3]) == [0, -1, -2, -3]  # Initial, drawn lazily.
  assert initialized == [0, 1, 2, 3] and os.listdir(tmp_path) == []
  store.save(1, [0, 1], [_toy_state(10), _toy_state(11)])
  store.save(2, [1, 2], [_toy_state(21), _toy_state(22)])
  store.save(3, [1], [_toy_state(31)])
  assert values([0, 1, 2, 3]) == [10, 31, 22, -3]
  assert int(store.load([1])[0]['step']) == 31  # Every leaf round-trips.
  # Client 1 keeps its three versions (a fourth pushes one out: below).
  assert store.versions(1) == [1, 2, 3] and store.versions(0) == [1]
  assert sorted(os.listdir(tmp_path)) == [
      'client_00000.r000001.npz', 'client_00001.r000001.npz',
      'client_00001.r000002.npz', 'client_00001.r000003.npz',
      'client_00002.r000002.npz']

  # A crash in round 3 after client 1's file was written, before the
  # round-3 checkpoint: a store reopened on the directory (a leftover
  # temporary file is removed) and rolled back to 2 rounds holds the states
  # after round 2.
  (tmp_path / 'client_00003.r000003.npz.tmp').write_bytes(b'half')
  store = open_store()
  assert store.versions(1) == [1, 2, 3]
  store.discard_after(2)
  assert values([0, 1, 2, 3]) == [10, 21, 22, -3]
  assert not (tmp_path / 'client_00001.r000003.npz').exists()
  assert not (tmp_path / 'client_00003.r000003.npz.tmp').exists()
  store.discard_after(0)  # Nothing committed: every client starts afresh.
  assert values([0, 1, 2, 3]) == [0, -1, -2, -3]
  assert os.listdir(tmp_path) == []
  store.save(1, [3], [_toy_state(13)])
  with pytest.raises(client_store.ForeignStates, match='client 3.*2 clients'):
    client_store.DiskClientStore(str(tmp_path), 2, initialize, _toy_state(0))
  # One version for each of the two kept checkpoints, one for the round in
  # flight; older ones are deleted.
  for r in (1, 2, 3, 4):
    store.save(r, [2], [_toy_state(r)])
  assert store.versions(2) == [2, 3, 4]
  assert sorted(p.name for p in tmp_path.glob('client_00002.*')) == [
      'client_00002.r000002.npz', 'client_00002.r000003.npz',
      'client_00002.r000004.npz']


def test_disk_store_names_a_state_of_another_shape_and_sets_it_aside_only_if_damaged(
    tmp_path):
  """A client file of another state (2000 weights where this code has 3) is
  not damage: check and load stop naming it and leave it in place. A
  damaged one that reads short is set aside as damage."""
  wide = lambda v: {'w': np.full([2000], v, np.float32),
                    'step': np.int64(v)}
  client_store.DiskClientStore(str(tmp_path), 1, None, wide(0)).save(
      1, [0], [wide(7)])
  store = client_store.DiskClientStore(
      str(tmp_path), 1, lambda ids: [_toy_state(0) for _ in ids],
      _toy_state(0))
  for read in (store.check, lambda: store.load([0])):
    with pytest.raises(checkpoint.StateMismatch,
                       match=r'client_00000\.r000001\.npz: it holds 2000 '
                             r'float32 values, the state needs 3'):
      read()
  assert os.listdir(tmp_path) == ['client_00000.r000001.npz']
  # The same file with a garbled shape in its array header: it reads short
  # (2 of its 8 kB), so zip's checksum is never reached; the zip's own test
  # then finds the damage, and the file is set aside.
  path = tmp_path / 'client_00000.r000001.npz'
  data = path.read_bytes()
  assert data.count(b"'shape': (2000,)") == 1
  path.write_bytes(data.replace(b"'shape': (2000,)", b"'shape': (2,)   "))
  with pytest.raises(checkpoint.DamagedState, match='is damaged'):
    store.check()
  assert os.listdir(tmp_path) == ['damaged_client_00000.r000001.npz']
  # Damaged again under the same name (the round redone): the earlier
  # damaged copy is kept beside it.
  path.write_bytes(data.replace(b"'shape': (2000,)", b"'shape': (2,)   "))
  with pytest.raises(checkpoint.DamagedState, match=r'\.npz\.2\) is damaged'):
    client_store.DiskClientStore(
        str(tmp_path), 1, lambda ids: [_toy_state(0) for _ in ids],
        _toy_state(0)).check()
  assert sorted(os.listdir(tmp_path)) == [
      'damaged_client_00000.r000001.npz', 'damaged_client_00000.r000001.npz.2']


def test_disk_store_leaves_a_file_it_may_not_read_in_place(tmp_path,
                                                            monkeypatch):
  """An error of the machine (here a permission) is not damage: `check`
  lets it through and sets nothing aside."""
  client_store.DiskClientStore(str(tmp_path), 1, None, _toy_state(0)).save(
      1, [0], [_toy_state(7)])
  store = client_store.DiskClientStore(
      str(tmp_path), 1, lambda ids: [_toy_state(0) for _ in ids],
      _toy_state(0))

  def refused(path, *args, **kwargs):
    raise PermissionError(13, 'Permission denied', str(path))

  monkeypatch.setattr(np, 'load', refused)
  with pytest.raises(PermissionError):
    store.check()
  assert os.listdir(tmp_path) == ['client_00000.r000001.npz']


def test_a_damaged_client_file_stops_counting_once_its_round_is_redone(
    tmp_path):
  """A resume sets client 0's damaged file of round 2 aside and falls back;
  round 2 is redone and client 0 is not sampled after it. If that redone
  file is later lost, the next resume must stop naming the client
  (`MissingState`), not take the old damaged copy for its damage and fall
  back before round 2 (to round 1 if no save that old is kept). Every
  damaged copy is kept."""
  initialize = lambda ids: [_toy_state(-i) for i in ids]
  open_store = lambda: client_store.DiskClientStore(str(tmp_path), 2,
                                                    initialize, _toy_state(0))
  store = open_store()
  store.save(1, [0, 1], [_toy_state(10), _toy_state(11)])
  trained = {0: (1, 2), 1: (1, 3)}  # Client 0 sampled last in round 2.
  for _ in range(2):  # Damaged twice, each time found and redone.
    store.save(2, [0], [_toy_state(20)])
    (tmp_path / 'client_00000.r000002.npz').write_bytes(b'not a zip')
    with pytest.raises(checkpoint.DamagedState, match='round 2'):
      store.check()
    store.discard_after(1)  # The resume's fallback to round 1.
  store.save(2, [0], [_toy_state(22)])
  store.save(3, [1], [_toy_state(31)])
  store.require(trained, 3)  # Every state there.
  assert sorted(n for n in os.listdir(tmp_path) if 'damaged' in n) == [
      'redone_damaged_client_00000.r000002.npz',
      'redone_damaged_client_00000.r000002.npz.2']
  os.remove(tmp_path / 'client_00000.r000002.npz')
  with pytest.raises(client_store.MissingState,
                     match='client 0 was trained in rounds 1 to 2'):
    open_store().require(trained, 3)


# ---------------------------------------------------------------------------
# Rounds with 52 tiny clients, 5 a round.


def test_round_updates_only_the_sampled_clients(process, tmp_path):
  states_dir = tmp_path / 'states'
  disk = _driver(process, str(states_dir))
  memory = _driver(process)  # Same sampling, states in memory.
  initial = [_bytes(s) for s in memory.client_states]
  before = {}
  for round_num in range(2):
    sampled = disk.sample_clients(round_num)
    built = []
    metrics = disk.run_round(round_num, _train_data(round_num, built))
    # Only the sampled clients' datasets were even built.
    assert sorted(built) == sampled
    after = _stored(states_dir)
    new_files = set(after) - set(before)
    assert sorted(_client_of(f) for f in new_files) == sampled
    for name in new_files:  # The new state differs from the previous one.
      i = _client_of(name)
      previous = [f for f in before if _client_of(f) == i]
      old = before[max(previous)] if previous else initial[i]
      assert after[name] != old, name
    # Every other client's stored state is untouched, bit for bit (clients
    # never trained have no file: their initial state, drawn when needed).
    for name in set(before) & set(after):
      assert after[name] == before[name], name
    for name in set(before) - set(after):  # Only superseded versions go.
      assert _client_of(name) in sampled
    # The round's training metrics name the sampled clients; the means are
    # over them.
    trained = {int(k.split('/')[0][len('client_'):]) for k in metrics
               if k.startswith('client_')}
    assert trained == set(sampled)
    assert metrics['mean/cls_loss'] == pytest.approx(
        np.mean([metrics[f'client_{i}/cls_loss'] for i in sampled]))
    assert memory.run_round(round_num, _train_data(round_num)) == metrics
    before = after
  # Some clients trained in round 1 sat round 2 out: the untouched stored
  # states checked above include non-initial ones.
  assert set(disk.sample_clients(0)) - set(disk.sample_clients(1))
  with pytest.raises(AttributeError, match='on disk'):
    disk.client_states  # pylint: disable=pointless-statement
  # Loading through the store gives what the in-memory driver holds, bit
  # for bit, never more than a round's clients at a time; a disk store's
  # checkpoint holds the server state only.
  for start in range(0, NUM_CLIENTS, PER_ROUND):
    ids = list(range(start, min(start + PER_ROUND, NUM_CLIENTS)))
    assert ([_bytes(s) for s in disk.load_client_states(ids)] ==
            [_bytes(s) for s in memory.load_client_states(ids)])
  assert disk.client_store.max_loaded == PER_ROUND
  assert _bytes(disk.server_state) == _bytes(memory.server_state)
  assert disk.state()[1] == [] and len(memory.state()[1]) == NUM_CLIENTS


def _heap_peak(fn):
  """Peak growth of the Python heap (numpy arrays included) while `fn`
  runs."""
  tracemalloc.start()
  try:
    base = tracemalloc.get_traced_memory()[0]
    fn()
    return tracemalloc.get_traced_memory()[1] - base
  finally:
    tracemalloc.stop()


def test_memory_bound_and_evaluation_of_unchanged_clients(process,
                                                          tmp_path):
  """With the disk store a round plus an evaluation of all 52 clients peaks
  at a few states per sampled client, below what the 52 states take (the
  same measurement sees an in-memory driver draw all 52, so it does see
  the states TFF returns); evaluation reuses exactly the accuracies of
  unchanged clients."""
  disk = _driver(process, str(tmp_path))
  state_bytes = sum(len(v) for v in
                    _bytes(disk.load_client_states([0])[0]).values())
  every_state = NUM_CLIENTS * state_bytes
  memory_peak = _heap_peak(lambda: _driver(process))
  assert memory_peak > 0.9 * every_state, (memory_peak, every_state)

  eval_data = _eval_data()
  disk.run_round(0, _train_data(0))
  first = disk.evaluate(*eval_data)  # All 52, 5 at a time.
  results = {}
  evaluated = []  # The clients each evaluation loaded.
  evaluate = disk.process.evaluate
  disk.process.evaluate = lambda states, val, test: (
      evaluated.append(len(states)), evaluate(states, val, test))[1]

  def round_and_evaluations():
    disk.run_round(1, _train_data(1))
    evaluated.clear()
    results['reused'] = disk.evaluate(*eval_data)  # Round 2's 5 clients.
    results['reused_count'] = sum(evaluated)
    evaluated.clear()
    # New dataset objects (same contents): every client is evaluated again.
    results['fresh'] = disk.evaluate(*_eval_data())
    results['fresh_count'] = sum(evaluated)

  disk_peak = _heap_peak(round_and_evaluations)
  print(f'state {state_bytes} B; all {NUM_CLIENTS}: {every_state} B; '
        f'peak with the disk store {disk_peak} B')
  # About three copies of each state in flight (the file's bytes, the
  # arrays, TFF's serialised value), for 5 states at a time: a bound in
  # clients per round, not clients.
  assert disk_peak < 4 * PER_ROUND * state_bytes < every_state, disk_peak
  assert disk.client_store.max_loaded == PER_ROUND
  assert results['reused'] == results['fresh']
  # Only the round's clients were evaluated again, then every client.
  assert results['reused_count'] == PER_ROUND
  assert results['fresh_count'] == NUM_CLIENTS
  sampled = disk.sample_clients(1)
  for now, then in zip(results['fresh'], first):
    assert [now[i] for i in range(NUM_CLIENTS) if i not in sampled] == [
        then[i] for i in range(NUM_CLIENTS) if i not in sampled]


def test_crash_mid_round_resumes_from_the_previous_round(process, tmp_path):
  """12 clients, 3 a round (the rollback does not depend on the count)."""
  num_clients, per_round = 12, 3
  val, test = _eval_data(num_clients)
  train = lambda r, salt=0: _train_data(r, salt=salt, num_clients=num_clients)

  def run(directory, rounds):
    driver = _driver(process, str(directory / 'states'), per_round,
                     num_clients)
    result = round_loop.run(
        driver, train, val, test, max_rounds=rounds, patience=9,
        log=lambda _: None,
        checkpoints=checkpoint.Checkpoints(str(directory / 'ckpt')))
    return driver, result

  whole, whole_result = run(tmp_path / 'whole', 3)

  # Two rounds saved; round 3, on other data (so its states differ from a
  # correct redo's), writes two of its three clients' files and dies.
  broken, _ = run(tmp_path / 'broken', 2)
  sampled = broken.sample_clients(2)
  store = broken.client_store
  save = store.save

  def crash(rounds_done, ids, states):
    save(rounds_done, ids[:2], states[:2])
    raise KeyboardInterrupt('power loss')

  store.save = crash
  with pytest.raises(KeyboardInterrupt):
    broken.run_round(2, train(2, salt=1))
  assert all(store.versions(i)[-1] == 3 for i in sampled[:2])
  assert _stored(tmp_path / 'broken' / 'states') != _stored(
      tmp_path / 'whole' / 'states')

  # A new process resumes after round 2 and ends where the whole run did.
  resumed, result = run(tmp_path / 'broken', 3)
  assert result.resumed_from == 2 and result.rounds_run == 3
  assert _stored(tmp_path / 'broken' / 'states') == _stored(
      tmp_path / 'whole' / 'states')
  assert _bytes(resumed.server_state) == _bytes(whole.server_state)
  assert resumed.evaluate(val, test) == whole.evaluate(val, test)
  for key, value in whole_result.tracker.as_arrays().items():
    np.testing.assert_array_equal(result.tracker.as_arrays()[key], value)


def _corrupt(path):
  """Overwrites bytes in the middle of a file, as a bad disk would."""
  size = os.path.getsize(path)
  with open(path, 'r+b') as f:
    f.seek(size // 2)
    f.write(bytes(range(256)) * max(1, min(64, size // 512)))


@pytest.mark.parametrize('damaged', ['checkpoint', 'client_file',
                                     'client_file_set_aside',
                                     'older_client_file',
                                     'checkpoint_after_a_crash'])
def test_resume_passes_over_a_damaged_newest_save(process, tmp_path,
                                                  damaged):
  """The newest checkpoint's variables, or a client's newest state file, is
  damaged after the run stopped: the rerun names the file and round, sets
  it aside (nothing deleted), resumes from the newest save that does not
  need it and ends equal to an uninterrupted run. A client not sampled in
  round 3 whose round-1 or round-2 file is damaged invalidates every kept
  save (rounds 2 and 3): the run starts over. With every client's state
  on disk and a crash in round 4 after its client files were written, the
  fallback from round 3 to round 2 needs every client's round-2 file,
  which round 4's files must not have pushed out. A client file a resume
  set aside as damaged before a crash stopped it (the checkpoint still in
  place) is found so: the next resume falls back too, rather than give
  that client its older state."""
  num_clients = 6
  per_round = {'client_file': 3, 'client_file_set_aside': 3,
               'older_client_file': 3}.get(damaged)
  on_disk = damaged != 'checkpoint'
  val, test = _eval_data(num_clients)
  train = lambda r: _train_data(r, num_clients=num_clients)

  def run(directory, rounds, log=lambda _: None):
    states = str(directory / 'states') if on_disk else None
    driver = _driver(process, states, per_round, num_clients)
    result = round_loop.run(
        driver, train, val, test, max_rounds=rounds, patience=9, log=log,
        writer=run_files.MetricsWriter(str(directory)),
        checkpoints=checkpoint.Checkpoints(str(directory / 'ckpt')))
    return driver, result

  def rounds_in(csv_path):
    with open(csv_path) as f:
      return [int(r['round']) for r in csv.DictReader(f)]

  whole, whole_result = run(tmp_path / 'whole', 3)
  broken, _ = run(tmp_path / 'broken', 3)
  if damaged == 'checkpoint_after_a_crash':
    broken.run_round(3, train(3))  # Round 4's files; then the crash.
    assert broken.client_store.versions(0) == [2, 3, 4]
  if damaged.startswith('checkpoint'):
    bad = tmp_path / 'broken' / 'ckpt' / 'round_3'
    _corrupt(bad / 'variables' / 'variables.data-00000-of-00001')
  elif damaged.startswith('client_file'):
    client = broken.sample_clients(2)[0]
    bad = tmp_path / 'broken' / 'states' / f'client_{client:05d}.r000003.npz'
    if damaged == 'client_file':
      _corrupt(bad)
    else:  # As a resume's check sets it aside; then the crash.
      os.replace(bad, bad.parent / f'damaged_{bad.name}')
  else:
    newest = {}
    for path in sorted((tmp_path / 'broken' / 'states').glob('*.npz')):
      newest[path.name.split('.')[0]] = path  # Sorted: the last is newest.
    bad = next(p for p in newest.values() if not p.name.endswith('03.npz'))
    _corrupt(bad)
  lines = []
  resumed, result = run(tmp_path / 'broken', 3, lines.append)
  said = '\n'.join(lines)
  assert 'the saved state of round 3 (' in said and ') is damaged' in said
  assert str(bad) in said, said
  # Set aside under its own name: the checkpoint, or the client's file
  # (whose round-3 checkpoint is then set aside with it); the client's
  # round, redone, renamed that copy `redone_damaged_` (still kept).
  assert os.path.exists(tmp_path / 'broken' / 'ckpt' / 'damaged_round_3')
  if not damaged.startswith('checkpoint'):
    assert not os.path.exists(bad.parent / f'damaged_{bad.name}')
    assert os.path.exists(bad.parent / f'redone_damaged_{bad.name}')
  earlier = list((tmp_path / 'broken').glob('earlier_attempt_*'))
  if damaged == 'older_client_file':
    assert 'the run starts over' in said, said
    assert result.resumed_from == 0 and result.rounds_run == 3
    # The metrics of the rounds run before are kept, not overwritten.
    assert len(earlier) == 1 and f'moved to {earlier[0]}' in said, said
    assert rounds_in(earlier[0] / 'metrics.csv') == [1, 2, 3]
    assert os.listdir(earlier[0] / 'tensorboard')
    # So are the client states it wrote (those not set aside as damaged).
    kept = list((tmp_path / 'broken' / 'states').glob(
        'earlier_attempt_*/client_*.npz'))
    assert len(kept) >= 3, kept
  else:
    assert 'resuming after round 2' in said, said
    assert result.resumed_from == 2 and result.rounds_run == 3
    assert not earlier
  assert rounds_in(tmp_path / 'broken' / 'metrics.csv') == [1, 2, 3]
  assert _bytes(resumed.state()) == _bytes(whole.state())
  assert resumed.evaluate(val, test) == whole.evaluate(val, test)
  for key, value in whole_result.tracker.as_arrays().items():
    np.testing.assert_array_equal(result.tracker.as_arrays()[key], value)


def test_resume_stops_when_a_trained_client_has_no_state(process, tmp_path):
  """A client trained before the checkpoint whose files are gone would
  silently restart from its initial state: the resume stops naming it and
  the round it was first sampled in (here 2 of 4 clients a round), with
  every save and every other client file left in place."""
  val, test = _eval_data(4)
  ckpt = checkpoint.Checkpoints(str(tmp_path / 'ckpt'))

  def run(rounds):
    driver = _driver(process, str(tmp_path / 'states'), 2, 4)
    return driver, round_loop.run(
        driver, lambda r: _train_data(r, num_clients=4), val, test,
        max_rounds=rounds, patience=9, log=lambda _: None, checkpoints=ckpt)

  driver, _ = run(3)
  first = {}
  for r in range(3):
    for i in driver.sample_clients(r):
      first.setdefault(i, r + 1)
  client = max(first, key=first.get)  # The latest first-sampled client.
  assert first[client] > 1
  for path in (tmp_path / 'states').glob(f'client_{client:05d}.*'):
    path.unlink()
  # An uncommitted file of round 4 (a crash before its checkpoint): no
  # state of round 3 or before, and the check comes before any deletion.
  other = next(p for p in (tmp_path / 'states').glob('client_*.npz'))
  shutil.copy(other, tmp_path / 'states' / f'client_{client:05d}.r000004.npz')
  files = sorted((tmp_path / 'states').glob('client_*.npz'))
  with pytest.raises(client_store.MissingState,
                     match=rf'client {client} was trained in rounds '
                           rf'{first[client]} to \d, but .*states holds no '
                           r'state of it for the checkpoint of round 3'):
    run(4)
  assert ckpt.kept_rounds() == [2, 3]
  assert sorted((tmp_path / 'states').glob('client_*.npz')) == files


# ---------------------------------------------------------------------------
# The binary.


def test_binary_refuses_more_clients_per_round_than_clients(tmp_path):
  out = tmp_path / 'out'
  error = binary_runs.run_fedcg_in_process(
      [f'--output_dir={out}', '--clients_per_round=0'])
  assert '--clients_per_round must be >= 1, got 0' in error, error
  data = tmp_path / 'idx'
  data.mkdir()
  fake_data.write_fake_fmnist(str(data), n_train=64, n_test=40)
  error = binary_runs.run_fedcg_in_process(
      [f'--output_dir={out}', f'--data_dir={data}', '--num_clients=2',
       '--train_per_client=16', '--clients_per_round=3'])
  assert ("--clients_per_round=3 is more than the run's 2 clients "
          '(--task=fmnist, --num_clients=2)') in error, error
  assert not out.exists()  # Nothing was written.


def test_binary_samples_dirichlet_clients(tmp_path, capfd):
  data = tmp_path / 'idx'
  data.mkdir()
  fake_data.write_fake_fmnist(str(data), n_train=500, n_test=500)
  out = tmp_path / 'out'
  args = [f'--output_dir={out}', f'--data_dir={data}', '--algorithm=fedavg',
          '--num_clients=20', '--train_per_client=20',
          '--partition=dirichlet', '--dirichlet_alpha=5', '--batch_size=4',
          '--local_epochs=1', '--rounds=2', '--seed=3']
  # In this process: the run's sampling is checked here, not its process.
  assert binary_runs.run_fedcg_in_process(
      [*args, '--clients_per_round=5']) is None
  stdout = capfd.readouterr().out
  assert 'task fmnist: 20 clients' in stdout and 'round 2/2' in stdout
  # The Dirichlet split reached the task: client sizes vary (IID's are
  # all 20).
  sizes = [int(n) for n in re.findall(r'^  \S+: train (\d+) /', stdout,
                                      re.M)]
  assert len(sizes) == 20 and len(set(sizes)) > 1, sizes
  definition = json.loads((out / 'run.json').read_text())
  assert definition['run']['clients_per_round'] == 5
  # Files for the clients the two rounds sampled, and only theirs.
  sampled = [client_store.sample_clients(3, r, 20, 5) for r in range(2)]
  files = os.listdir(out / 'client_states')
  assert {int(f[len('client_'):len('client_') + 5]) for f in files} == (
      set(sampled[0]) | set(sampled[1]))
  with open(out / 'metrics.csv', newline='') as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 2
  for row, ids in zip(rows, sampled):
    # Every client is evaluated every round; only the sampled ones trained.
    assert all(row[f'client_{i}/val_accuracy'] != '' for i in range(20))
    trained = {i for i in range(20) if row.get(f'client_{i}/cls_loss')}
    assert trained == set(ids)
  results = json.loads((out / 'results.json').read_text())
  assert len(results['test_accuracy_at_best_val']) == 20
  # Resuming with another sample size is refused, naming the flag.
  error = binary_runs.run_fedcg_in_process([*args, '--clients_per_round=10'])
  assert '--clients_per_round: stored 5, given 10' in error, error


def test_binary_keeps_every_client_on_disk_when_asked(tmp_path):
  """--client_states_on_disk without sampling: every client's state goes
  to its file each round (the driver test above shows the rounds equal
  the in-memory run's), and run.json records the flag."""
  data = tmp_path / 'idx'
  data.mkdir()
  fake_data.write_fake_fmnist(str(data), n_train=64, n_test=40)
  out = tmp_path / 'out'
  assert binary_runs.run_fedcg_in_process(
      [f'--output_dir={out}', f'--data_dir={data}', '--algorithm=fedavg',
       '--num_clients=2', '--train_per_client=8', '--batch_size=4',
       '--local_epochs=1', '--rounds=1', '--client_states_on_disk']) is None
  assert sorted(os.listdir(out / 'client_states')) == [
      'client_00000.r000001.npz', 'client_00001.r000001.npz']
  definition = json.loads((out / 'run.json').read_text())
  assert definition['run']['client_states_on_disk'] is True


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
