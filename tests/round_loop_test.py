"""The shared round loop: best-validation bookkeeping and early stopping."""

import csv
import errno
import glob
import json
import os
import re
import shutil
import time

import numpy as np
import pytest

from fedcg_tff.program import checkpoint
from fedcg_tff.program import round_loop
from fedcg_tff.program import run_record
from fedcg_tff.program import run_files
from tests import event_logs


class _ScriptedAlgorithm:
  """Returns preset validation/test accuracies, one pair of lists a round."""

  def __init__(self, val, test):
    self.val, self.test, self.rounds = val, test, []

  def run_round(self, round_num, train_data):
    self.rounds.append((round_num, train_data))
    self._round = round_num
    return {'server/loss': 1.0 / (round_num + 1)}

  def evaluate(self, val_data, test_data):
    return self.val[self._round], self.test[self._round]

  def state(self):
    """(server state, client states), like the real drivers'."""
    r = getattr(self, '_round', -1)
    return ({'round': np.int32(r)},
            [{'weights': np.full([3], float(r), np.float32)}])

  def restore(self, state):
    self._round = int(state[0]['round'])
    self.restored = state


def test_tracker_keeps_test_at_best_validation():
  t = round_loop.BestTracker(2)
  assert t.update(0, [0.5, 0.6], [0.4, 0.7])
  assert t.update(1, [0.7, 0.5], [0.65, 0.9])  # client 0 improves
  assert not t.update(2, [0.7, 0.6], [0.99, 0.99])  # ties are no new best
  assert t.best_round == [1, 0]
  assert t.test_at_best == [0.65, 0.7]
  assert t.mean_test == pytest.approx(0.675)
  table = t.table()
  assert '65.00' in table and '70.00' in table and '67.50' in table
  with pytest.raises(ValueError, match='2 clients, but 3 validation'):
    t.update(3, [0.9, 0.9, 0.9], [0.9, 0.9, 0.9])


def test_eta_counts_writing_the_round_out(tmp_path):
  """The ETA's rounds include writing the metrics and the checkpoint, which
  the recorded round times leave out."""

  class SlowWriter(run_files.MetricsWriter):
    def write(self, round_num, scalars):
      time.sleep(1.0)
      super().write(round_num, scalars)

  lines = []
  result = round_loop.run(
      _ScriptedAlgorithm([[0.1], [0.2], [0.3]], [[0.1], [0.2], [0.3]]),
      lambda r: [r], [None], [None], max_rounds=3, patience=9,
      writer=SlowWriter(str(tmp_path)), log=lines.append,
      checkpoints=checkpoint.Checkpoints(str(tmp_path / 'ckpt')))
  assert max(result.round_seconds) < 0.5
  # Two rounds left, at least 1 s each.
  minutes, seconds = re.search(r'ETA <= (\d+)m(\d+)s', lines[0]).groups()
  assert 60 * int(minutes) + int(seconds) >= 2, lines


def test_time_left_is_at_the_median_round():
  """A paused round of an hour does not make every round left an hour."""
  assert round_loop.time_left([300.0, 3600.0, 330.0], 10) == '55m00s'
  assert round_loop.time_left([300.0], 13) == '1h05m00s'
  assert round_loop.time_left([300.0, 330.0], 0) == '0m00s'


def test_run_stops_after_patience_rounds_without_a_new_best(tmp_path):
  val = [[0.1, 0.1], [0.2, 0.1], [0.2, 0.3], [0.2, 0.3], [0.2, 0.3],
         [0.2, 0.3], [0.9, 0.9]]
  test = [[0.0, 0.0], [0.5, 0.0], [0.5, 0.6], [0.1, 0.1], [0.1, 0.1],
          [0.1, 0.1], [0.9, 0.9]]
  algo = _ScriptedAlgorithm(val, test)
  lines = []
  writer = run_files.MetricsWriter(str(tmp_path))
  result = round_loop.run(algo, train_data_fn=lambda r: [f'data{r}'],
                          val_data=[None, None], test_data=[None, None],
                          max_rounds=7, patience=3, writer=writer,
                          log=lines.append, checkpoints=checkpoint.Checkpoints(
                              str(tmp_path / 'ckpt')))
  assert result.stopped_early and result.rounds_run == 6
  # Rerun (say after a crash before results.json was written): it stops
  # where it stopped, without training round 7 (which would be a new best).
  again = _ScriptedAlgorithm(val, test)
  rerun = round_loop.run(again, lambda r: [f'data{r}'], [None, None],
                         [None, None], max_rounds=7, patience=3,
                         log=lambda _: None, checkpoints=checkpoint.Checkpoints(
                             str(tmp_path / 'ckpt')))
  assert again.rounds == [] and rerun.stopped_early
  assert rerun.rounds_run == 6 and rerun.tracker.test_at_best == [0.5, 0.6]
  assert [r for r, _ in algo.rounds] == list(range(6))
  assert algo.rounds[4][1] == ['data4']
  assert result.tracker.test_at_best == [0.5, 0.6]
  assert len(lines) == 6 and lines[0].startswith('round 1/7')
  assert 'ETA' in lines[-1] and '3/3 rounds without a new best' in lines[-1]
  with open(tmp_path / 'metrics.csv') as f:
    rows = list(csv.DictReader(f))
  assert [int(r['round']) for r in rows] == list(range(1, 7))  # 1-based
  assert result.tracker.best_round == [2, 3]
  assert float(rows[2]['client_1/val_accuracy']) == pytest.approx(0.3)
  assert float(rows[2]['mean/test_accuracy_at_best_val']) == pytest.approx(0.55)
  assert float(rows[1]['server/loss']) == pytest.approx(0.5)


def test_run_without_early_stop_runs_max_rounds():
  algo = _ScriptedAlgorithm([[0.1 * r] for r in range(4)],
                            [[0.1 * r] for r in range(4)])
  result = round_loop.run(algo, lambda r: [], [None], [None], max_rounds=4,
                          patience=2, log=lambda _: None)
  assert not result.stopped_early and result.rounds_run == 4
  assert len(result.round_seconds) == 4


def test_prepare_output_dir_refuses_foreign_or_different_runs(tmp_path):
  (tmp_path / 'metrics.csv').write_text('round\n0\n')
  with pytest.raises(FileExistsError, match='--output_dir.*holds no run.json'):
    run_record.prepare_output_dir(str(tmp_path), {'run': {'rounds': 3}})
  assert (tmp_path / 'metrics.csv').read_text() == 'round\n0\n'
  new = tmp_path / 'new'
  definition = {'config': {'lr': 0.001}, 'run': {'rounds': 3}}
  assert not run_record.prepare_output_dir(str(new), definition)
  assert json.loads((new / 'run.json').read_text()) == definition
  assert run_record.prepare_output_dir(str(new), definition)  # Resumable.
  with pytest.raises(FileExistsError,
                     match=r'--lr: stored 0.001, given 0.01.*same flags'):
    run_record.prepare_output_dir(
        str(new), {'config': {'lr': 0.01}, 'run': {'rounds': 3}})
  assert json.loads((new / 'run.json').read_text()) == definition


def test_a_lock_whose_pid_cannot_be_written_is_released(tmp_path,
                                                       monkeypatch):
  """A full disk while the lock file gets the pid: the start fails, and
  the lock is not left held by the half-made object (which the error's
  traceback keeps alive)."""

  def no_space():
    raise OSError(errno.ENOSPC, 'No space left on device')

  with monkeypatch.context() as patch:
    patch.setattr(run_record.os, 'getpid', no_space)
    with pytest.raises(OSError, match='No space left') as failed:
      run_record.OutputDirLock(str(tmp_path))
  with run_record.OutputDirLock(str(tmp_path)):  # Free again.
    assert failed.value is not None


def test_a_start_refused_by_the_lock_writes_nothing(tmp_path):
  """Two runs started on one directory: the one that does not get the lock
  leaves the directory as it was (run.json is written under the lock)."""
  out = tmp_path / 'run'
  definition = {'config': {'lr': 0.001}, 'run': {'rounds': 3}}
  other = {'config': {'lr': 0.01}, 'run': {'rounds': 3}}
  out.mkdir()
  with run_record.OutputDirLock(str(out)):  # The other run, starting.
    with pytest.raises(FileExistsError, match='in use by another run'):
      run_record.claim_output_dir(str(out), other)
    assert os.listdir(out) == ['.lock']
  resuming, lock = run_record.claim_output_dir(str(out), definition)
  with lock:
    assert not resuming
    with pytest.raises(FileExistsError, match='in use by another run'):
      run_record.claim_output_dir(str(out), definition)
  assert json.loads((out / 'run.json').read_text()) == definition
  with pytest.raises(FileExistsError, match='--lr: stored 0.001, given 0.01'):
    run_record.claim_output_dir(str(out), other)
  resuming, lock = run_record.claim_output_dir(str(out), definition)
  with lock:  # The refusal above released the lock.
    assert resuming
  foreign = tmp_path / 'foreign'
  foreign.mkdir()
  (foreign / 'notes.txt').write_text('mine')
  with pytest.raises(FileExistsError, match='holds no run.json'):
    run_record.claim_output_dir(str(foreign), definition)
  assert os.listdir(foreign) == ['notes.txt']  # Not even a lock file.


def test_run_resumes_from_checkpoints(tmp_path):
  val = [[0.1 * r, 0.2] for r in range(6)]
  test = [[0.05 * r, 0.1] for r in range(6)]
  checkpoints = checkpoint.Checkpoints(str(tmp_path / 'ckpt'))
  writer = run_files.MetricsWriter(str(tmp_path))
  first = _ScriptedAlgorithm(val, test)
  round_loop.run(first, lambda r: [r], [None, None], [None, None],
                 max_rounds=3, patience=9, writer=writer, log=lambda _: None,
                 checkpoints=checkpoints)
  assert checkpoints.latest_round() == 3
  # A crash after round 4's metrics were released, before its state was
  # saved: the CSV holds a row that the resumed run must replace.
  run_files.MetricsWriter(str(tmp_path)).write(4, {'mean/val_accuracy': 9.0})
  with open(tmp_path / 'metrics.csv', 'a') as f:
    f.write('1')  # Round 12's row, cut short by a full disk.
  # A rewrite of the CSV by TFF's manager that a crash cut short.
  (tmp_path / 'metrics.csv_temp4321').write_text('round,mean/val')
  lines = []
  second = _ScriptedAlgorithm(val, test)
  result = round_loop.run(second, lambda r: [r], [None, None], [None, None],
                          max_rounds=6, patience=9,
                          writer=run_files.MetricsWriter(str(tmp_path)),
                          log=lines.append, checkpoints=checkpoints)
  assert lines[0].startswith('resuming after round 3')
  assert not (tmp_path / 'metrics.csv_temp4321').exists()
  assert [r for r, _ in second.rounds] == [3, 4, 5]  # None lost or repeated.
  assert int(second.restored[0]['round']) == 2
  np.testing.assert_array_equal(second.restored[1][0]['weights'], [2.0] * 3)
  assert result.rounds_run == 6 and result.resumed_from == 3
  assert result.tracker.best_round == [6, 1]
  assert len(result.round_seconds) == 6
  with open(tmp_path / 'metrics.csv') as f:
    rows = list(csv.DictReader(f))
  assert [int(r['round']) for r in rows] == [1, 2, 3, 4, 5, 6]
  assert float(rows[3]['mean/val_accuracy']) == pytest.approx(0.25)  # Not 9.
  assert event_logs.steps(tmp_path / 'tensorboard') == [1, 2, 3, 4, 5, 6]
  # Round 2's row lost (a power loss: the CSV is appended without fsync,
  # the checkpoint after it was kept): the resumed run says so and keeps
  # the rows it has.
  with open(tmp_path / 'metrics.csv') as f:
    kept = [line for line in f if not line.startswith('2,')]
  (tmp_path / 'metrics.csv').write_text(''.join(kept))
  lines = []
  round_loop.run(_ScriptedAlgorithm(val, test), lambda r: [r], [None, None],
                 [None, None], max_rounds=6, patience=9,
                 writer=run_files.MetricsWriter(str(tmp_path)),
                 log=lines.append, checkpoints=checkpoints)
  assert any('has no row for rounds [2]' in line for line in lines), lines
  with open(tmp_path / 'metrics.csv') as f:
    assert [int(r['round']) for r in csv.DictReader(f)] == [1, 3, 4, 5, 6]
  # A finished run that is started again does nothing more.
  third = _ScriptedAlgorithm(val, test)
  again = round_loop.run(third, lambda r: [r], [None, None], [None, None],
                         max_rounds=6, patience=9, log=lambda _: None,
                         checkpoints=checkpoints)
  assert third.rounds == [] and again.rounds_run == 6


@pytest.mark.parametrize('damage', ['a_value', 'the_header', 'bytes',
                                    'a_huge_field'])
def test_damaged_metrics_csv_is_kept_aside_and_the_run_resumes(tmp_path,
                                                               damage):
  """A metrics.csv damaged between runs (a value that is no number; a
  header without `round`) is moved with the TensorBoard logs into an
  earlier_attempt_* directory, the resume says so and keeps the readable
  rows (before, the first lost every row and then failed on TFF's CSV
  key; the second failed on the value after removing the TensorBoard
  logs)."""
  val = [[0.1 * r, 0.2] for r in range(5)]
  test = [[0.05 * r, 0.1] for r in range(5)]
  checkpoints = checkpoint.Checkpoints(str(tmp_path / 'ckpt'))
  round_loop.run(_ScriptedAlgorithm(val, test), lambda r: [r], [None, None],
                 [None, None], max_rounds=3, patience=9,
                 writer=run_files.MetricsWriter(str(tmp_path)),
                 log=lambda _: None, checkpoints=checkpoints)
  csv_path = tmp_path / 'metrics.csv'
  original = csv_path.read_text()
  lines = original.splitlines(keepends=True)
  if damage == 'a_value':
    lines[2] = lines[2].replace(',', ',0.8x1', 1)  # Round 2's row.
  elif damage == 'the_header':
    lines[0] = lines[0].replace('round', 'rOund', 1)
  elif damage == 'a_huge_field':  # Past the csv module's field limit.
    lines[2] = lines[2].replace(',', ',"' + '9' * 200_000 + '"', 1)
  damaged = ''.join(lines).encode()
  if damage == 'bytes':  # No UTF-8: a bad disk's bytes in round 2's row.
    start = len(''.join(lines[:2]).encode()) + 3
    damaged = damaged[:start] + b'\xff\xfe' + damaged[start + 2:]
  csv_path.write_bytes(damaged)
  log = []
  result = round_loop.run(
      _ScriptedAlgorithm(val, test), lambda r: [r], [None, None],
      [None, None], max_rounds=5, patience=9,
      writer=run_files.MetricsWriter(str(tmp_path)), log=log.append,
      checkpoints=checkpoints)
  assert result.rounds_run == 5
  aside, = glob.glob(str(tmp_path / 'earlier_attempt_*'))
  assert any(f'had damaged lines: it and the TensorBoard logs were kept in '
             f'{aside}' in line for line in log), log
  with open(os.path.join(aside, 'metrics.csv'), 'rb') as f:
    assert f.read() == damaged  # Nothing lost.
  assert event_logs.steps(os.path.join(aside, 'tensorboard')) == [1, 2, 3]
  with open(csv_path) as f:
    rounds = [int(r['round']) for r in csv.DictReader(f)]
  # A huge field stops the csv module's reading: the rows after it too.
  lost = {'the_header': [1, 2, 3], 'a_huge_field': [2, 3]}.get(damage, [2])
  assert rounds == [r for r in range(1, 6) if r not in lost]
  assert any(f'has no row for rounds {lost}' in line for line in log), log
  assert event_logs.steps(tmp_path / 'tensorboard') == rounds


def test_finished_run_is_recognised_and_a_foreign_run_json_named(tmp_path):
  definition = {'config': {'lr': 0.1}, 'run': {'rounds': 3}}
  run_record.prepare_output_dir(str(tmp_path), definition)
  same = lambda stored: definition
  assert run_record.finished_run(str(tmp_path), same) is None  # Unfinished.
  with pytest.raises(FileExistsError, match=r'--rounds: stored 3, given 4'):
    run_record.finished_run(str(tmp_path), lambda stored: {
        'config': {'lr': 0.1}, 'run': {'rounds': 4}})
  (tmp_path / 'results.json').write_text('{"rounds_run": 3}')
  assert run_record.finished_run(str(tmp_path), same) == {'rounds_run': 3}
  with pytest.raises(FileExistsError,
                     match=r"--seed: stored \(not set\), given 4"):
    run_record.finished_run(str(tmp_path), lambda stored: {
        'config': {'lr': 0.1, 'seed': 4}, 'run': {'rounds': 3}})
  (tmp_path / 'run.json').write_text('[1, 2]')
  with pytest.raises(ValueError, match='run.json does not hold what a run'):
    run_record.finished_run(str(tmp_path), same)


def test_starting_over_keeps_the_record_of_saves_set_aside_before(tmp_path):
  """Every save damaged: a resume set them aside, then stopped before the
  run moved its metrics aside. The next start finds only the damaged
  saves, and still moves the record of the rounds run aside, not
  truncating it."""
  checkpoints = checkpoint.Checkpoints(str(tmp_path / 'ckpt'))
  val, test = [[0.1], [0.2], [0.3]], [[0.1], [0.2], [0.3]]
  round_loop.run(_ScriptedAlgorithm(val, test), lambda r: [r], [None],
                 [None], max_rounds=2, patience=9,
                 writer=run_files.MetricsWriter(str(tmp_path)),
                 log=lambda _: None, checkpoints=checkpoints)
  for rounds_done in checkpoints.kept_rounds():
    checkpoint.set_aside(checkpoints.path(rounds_done))
  lines = []
  round_loop.run(_ScriptedAlgorithm(val, test), lambda r: [r], [None],
                 [None], max_rounds=1, patience=9,
                 writer=run_files.MetricsWriter(str(tmp_path)),
                 log=lines.append, checkpoints=checkpoints)
  earlier, = glob.glob(str(tmp_path / 'earlier_attempt_*'))
  with open(os.path.join(earlier, 'metrics.csv')) as f:
    assert [int(r['round']) for r in csv.DictReader(f)] == [1, 2]
  assert any('moved to' in line for line in lines), lines
  with open(tmp_path / 'metrics.csv') as f:
    assert [int(r['round']) for r in csv.DictReader(f)] == [1]


def test_resume_sets_aside_only_what_is_damaged(tmp_path):
  """A save `restore` finds damaged (DamagedState) is set aside and the
  older one restored; any other error of `restore` is a bug of the caller:
  it propagates and every save stays where it was."""
  checkpoints = checkpoint.Checkpoints(str(tmp_path / 'ckpt'))
  algo = _ScriptedAlgorithm([[0.1], [0.2]], [[0.1], [0.2]])
  round_loop.run(algo, lambda r: [r], [None], [None], max_rounds=2,
                 patience=9, log=lambda _: None, checkpoints=checkpoints)
  template = round_loop._checkpoint_template(algo.state(), 1)  # pylint: disable=protected-access

  def buggy(rounds_done, state):
    raise ValueError('a bug in restore')

  with pytest.raises(ValueError, match='a bug in restore'):
    checkpoints.resume(template, buggy, log=lambda _: None)
  assert checkpoints.kept_rounds() == [1, 2]

  def client_file_damaged_in_round_2(rounds_done, state):
    if rounds_done == 2:
      raise checkpoint.DamagedState('client 0\'s file of round 2')

  # A save cut short (TFF writes into round_<n>_temp<4 digits>, then
  # renames) is removed; a folder of another name is left alone.
  for name in ('round_3_temp1234', 'round_3_notes'):
    os.makedirs(tmp_path / 'ckpt' / name)
    (tmp_path / 'ckpt' / name / 'saved_model.pb').write_bytes(b'part')
  lines = []
  assert checkpoints.resume(template, client_file_damaged_in_round_2,
                            log=lines.append) == 1
  assert checkpoints.kept_rounds() == [1]
  assert 'round_3_temp1234, a save cut short' in lines[0]
  assert not (tmp_path / 'ckpt' / 'round_3_temp1234').exists()
  assert (tmp_path / 'ckpt' / 'round_3_notes' / 'saved_model.pb').exists()
  assert "client 0's file of round 2" in lines[1]


def test_an_error_of_the_machine_sets_no_save_aside(tmp_path, monkeypatch):
  """Memory running out inside TF while a save is read is not damage: it
  propagates, and every save stays where it was."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  checkpoints = checkpoint.Checkpoints(str(tmp_path / 'ckpt'))
  algo = _ScriptedAlgorithm([[0.1], [0.2]], [[0.1], [0.2]])
  round_loop.run(algo, lambda r: [r], [None], [None], max_rounds=2,
                 patience=9, log=lambda _: None, checkpoints=checkpoints)
  template = round_loop._checkpoint_template(algo.state(), 1)  # pylint: disable=protected-access

  async def out_of_memory(version, structure):
    raise tf.errors.ResourceExhaustedError(None, None, 'OOM when allocating')

  monkeypatch.setattr(checkpoints._manager, 'load', out_of_memory)  # pylint: disable=protected-access
  for read in (lambda: checkpoints.resume(template, lambda *_: None,
                                          log=lambda _: None),
               lambda: checkpoints.load(2, template)):
    with pytest.raises(tf.errors.ResourceExhaustedError):
      read()
  assert checkpoints.kept_rounds() == [1, 2]


def test_non_finite_values_stop_the_run_naming_them(tmp_path):
  checkpoints = checkpoint.Checkpoints(str(tmp_path / 'ckpt'))
  algo = _ScriptedAlgorithm([[0.1], [0.2], [0.3]], [[0.1], [0.2], [0.3]])
  state = algo.state
  algo.state = lambda: (state()[0], [{'weights': np.array(
      [0.0, np.nan if getattr(algo, '_round', -1) == 1 else 0.0],
      np.float32)}])
  run_round = algo.run_round

  def checked_round(round_num, train_data):
    """As the driver's run_round: the round's one check, before storing."""
    metrics = run_round(round_num, train_data)
    round_loop.check_finite(round_num + 1, metrics, algo.state())
    return metrics

  algo.run_round = checked_round
  with pytest.raises(round_loop.NumericalFault,
                     match=r'round 2, client 0 state: weights holds 1 '):
    round_loop.run(algo, lambda r: [], [None], [None], max_rounds=3,
                   patience=9, writer=run_files.MetricsWriter(str(tmp_path)),
                   log=lambda _: None, checkpoints=checkpoints)
  assert checkpoints.latest_round() == 1  # The last good round.
  with open(tmp_path / 'metrics.csv') as f:
    assert [r['round'] for r in csv.DictReader(f)] == ['1']
  with pytest.raises(round_loop.NumericalFault,
                     match=r'round 4, client 3: cls_loss is nan'):
    round_loop.check_finite(4, {'client_3/cls_loss': float('nan')},
                            ({}, []))
  with pytest.raises(round_loop.NumericalFault,
                     match=r'round 1, server: distill_kl is inf'):
    round_loop.check_finite(1, {'server/distill_kl': float('inf')}, ({}, []))
  # A client's fault is named before its consequences at the server.
  with pytest.raises(round_loop.NumericalFault, match=r'client 0: d_loss'):
    round_loop.check_finite(1, {'server/distill_kl': float('nan'),
                                'mean/d_loss': float('nan'),
                                'client_0/d_loss': float('nan')}, ({}, []))


def test_each_round_reaches_tensorboard_when_written(tmp_path):
  """Every `write` is on disk at once (TF flushes a summary writer as its
  `as_default()` context ends, which TFF's release manager uses), with the
  writer still alive: so no event waits for a finaliser at exit, where
  `execution.runtime` freezes the garbage collector."""
  writer = run_files.MetricsWriter(str(tmp_path))
  for r in (1, 2, 3):
    writer.write(r, {'mean/val_accuracy': 0.1 * r})
    assert event_logs.steps(tmp_path / 'tensorboard') == list(
        range(1, r + 1))


def test_pack_and_unpack_round_trip():
  structure = ({'a': np.arange(6, dtype=np.float32).reshape(2, 3),
                'b': (np.int32(7), np.arange(3, dtype=np.int64))},
               [np.ones(2, np.float32)])
  packed = checkpoint.pack(structure)
  assert sorted(packed) == ['float32', 'int32', 'int64']
  assert packed['float32'].shape == (8,)
  back = checkpoint.unpack(packed, structure)
  np.testing.assert_array_equal(back[0]['a'], structure[0]['a'])
  assert back[0]['b'][0].dtype == np.int32 and int(back[0]['b'][0]) == 7
  with pytest.raises(checkpoint.StateMismatch,
                     match='holds 8 float32 values, fewer than the state'):
    checkpoint.unpack(packed, (structure, [np.ones(1, np.float32)]))
  with pytest.raises(checkpoint.StateMismatch, match='the state needs 7'):
    checkpoint.unpack(packed, (structure[0], [np.ones(1, np.float32)]))


def test_a_save_with_another_bookkeeping_key_is_another_state(tmp_path):
  """A loop state with a key this code does not have (another version's
  bookkeeping) is no garbled byte: the resume stops, naming it."""
  checkpoints = checkpoint.Checkpoints(str(tmp_path / 'ckpt'))
  algo = _ScriptedAlgorithm([[0.1]] * 3, [[0.1]] * 3)
  round_loop.run(algo, lambda r: [r], [None], [None], max_rounds=1,
                 patience=9, log=lambda _: None, checkpoints=checkpoints)
  template = round_loop._checkpoint_template(algo.state(), 1)  # pylint: disable=protected-access
  checkpoints.save(2, {'algorithm': template['algorithm'],
                       'loop': {**template['loop'],
                                'patience': np.int64(9)}})
  with pytest.raises(checkpoint.StateMismatch,
                     match=r'round_2: it holds .*loop/patience.*another '
                           r'version'):
    round_loop.run(algo, lambda r: [r], [None], [None], max_rounds=3,
                   patience=9, log=lambda _: None, checkpoints=checkpoints)
  assert checkpoints.kept_rounds() == [1, 2]


def test_a_damaged_key_in_a_save_is_damage_not_another_state(tmp_path):
  """TF does not checksum a SavedModel's proto: a garbled byte in one of its
  names (each place 'since_best' is written, in turn) reads back as another
  key, fails to bind a variable, or does no harm. The save is then set
  aside and the run resumes from the one before, or resumes from it: it is
  never stopped as a save of another version of the code."""
  base = tmp_path / 'base'
  round_loop.run(_ScriptedAlgorithm([[0.1], [0.2]], [[0.1], [0.2]]),
                 lambda r: [r], [None], [None], max_rounds=2, patience=9,
                 log=lambda _: None,
                 checkpoints=checkpoint.Checkpoints(str(base / 'ckpt')))
  proto = (base / 'ckpt' / 'round_2' / 'saved_model.pb').read_bytes()
  places = [i for i in range(len(proto)) if proto.startswith(b'since_best', i)]
  assert len(places) > 2
  resumed = set()
  for k, i in enumerate(places):
    run = tmp_path / f'damaged_{k}'
    shutil.copytree(base, run)
    (run / 'ckpt' / 'round_2' / 'saved_model.pb').write_bytes(
        proto[:i + 3] + b'`' + proto[i + 4:])
    lines = []
    result = round_loop.run(
        _ScriptedAlgorithm([[0.1]] * 3, [[0.1]] * 3), lambda r: [r], [None],
        [None], max_rounds=3, patience=9, log=lines.append,
        checkpoints=checkpoint.Checkpoints(str(run / 'ckpt')))
    resumed.add(result.resumed_from)
    if result.resumed_from == 1:
      assert 'the saved state of round 2 (' in lines[0], lines
  assert resumed == {1, 2}, resumed  # Harmless places, and caught ones.


def test_atomic_writes_sync_the_file_then_its_directory(tmp_path,
                                                       monkeypatch):
  """run.json and results.json are written once, as new files: without a
  sync before the rename a machine that ends can leave them empty."""
  synced = []
  sync = os.fsync

  def recording_sync(fd):
    synced.append(os.readlink(f'/proc/self/fd/{fd}'))
    sync(fd)

  monkeypatch.setattr(os, 'fsync', recording_sync)
  path = tmp_path / 'results.json'
  run_record.write_json_atomically(str(path), {'rounds_run': 3})
  assert synced == [f'{path}.tmp', str(tmp_path)]
  assert json.loads(path.read_text()) == {'rounds_run': 3}
  assert not os.path.exists(f'{path}.tmp')


@pytest.mark.parametrize('weights,message', [
    # Other networks: client weights of 4 values where this code's have 3.
    (np.zeros(4, np.float32),
     r'round_2: it holds 4 float32 values, the state needs 3: was it '
     r'written by another version'),
    # Another set of dtypes, which TFF's load refuses with a plain
    # ValueError: float64 client weights where this code's are float32.
    (np.zeros(3, np.float64),
     r'round_2: it holds algorithm/float64, .*; the state needs '
     r'algorithm/float32, .*: was it written by another version'),
])
def test_a_save_of_another_state_stops_the_resume_naming_it(tmp_path,
                                                           weights, message):
  """A save written for another state, whether of other sizes or of
  another structure, is not damage: resume stops naming the save, and
  every save stays where it was."""
  checkpoints = checkpoint.Checkpoints(str(tmp_path / 'ckpt'))
  other = _ScriptedAlgorithm([[0.1], [0.2]], [[0.1], [0.2]])
  state = other.state
  other.state = lambda: (state()[0], [{'weights': weights}])
  round_loop.run(other, lambda r: [r], [None], [None], max_rounds=2,
                 patience=9, log=lambda _: None, checkpoints=checkpoints)
  this = _ScriptedAlgorithm([[0.1], [0.2]], [[0.1], [0.2]])
  with pytest.raises(checkpoint.StateMismatch, match=message):
    round_loop.run(this, lambda r: [r], [None], [None], max_rounds=3,
                   patience=9, log=lambda _: None, checkpoints=checkpoints)
  assert checkpoints.kept_rounds() == [1, 2]
  assert not glob.glob(str(tmp_path / 'ckpt' / 'damaged_*'))
  if weights.dtype == np.float64:  # So do the inspection tools' loads.
    with pytest.raises(checkpoint.StateMismatch, match='algorithm/float64'):
      round_loop.saved_algorithm_state(this, checkpoints, 2, 1)


def test_out_of_space_is_told_from_other_errors(tmp_path):
  """The disk out of space or of quota, as an OSError or inside a
  TensorFlow error's message; not other errors of writing."""
  assert run_record.out_of_space(OSError(errno.ENOSPC, 'x', 'metrics.csv'))
  assert run_record.out_of_space(OSError(errno.EDQUOT, 'x'))
  assert run_record.out_of_space(RuntimeError(
      '.../variables.data; No space left on device [Op:SaveV2]'))
  assert not run_record.out_of_space(OSError(errno.EACCES, 'x'))
  assert not run_record.out_of_space(MemoryError('out of memory'))
  assert not run_record.out_of_space(RuntimeError(
      'OOM when allocating tensor with shape[64,512] [Op:MatMul]'))
  # The line that says so, from a multi-line TF message too.
  assert run_record.out_of_space_line(RuntimeError(
      '{{function_node __wrapped__SaveV2_dtypes_9}} /c/part-0; No space '
      'left on device\n\t [[{{node SaveV2}}]] [Op:__inference_save_7]')) == (
          '/c/part-0; No space left on device')
  (tmp_path / 'a').mkdir()
  (tmp_path / 'a' / 'b').write_bytes(b'1234')
  (tmp_path / 'c').write_bytes(b'12')
  assert run_record.directory_bytes(str(tmp_path)) == 6
  assert run_record.directory_bytes(str(tmp_path / 'absent')) == 0


def test_atomic_write_that_fails_leaves_no_partial_file(tmp_path, monkeypatch):
  path = tmp_path / 'results.json'
  path.write_text('earlier')

  def full(fd):
    raise OSError(errno.ENOSPC, 'No space left on device')

  monkeypatch.setattr(os, 'fsync', full)
  with pytest.raises(OSError):
    run_record.write_text_atomically(str(path), 'new')
  assert path.read_text() == 'earlier'
  assert sorted(p.name for p in tmp_path.iterdir()) == ['results.json']


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
