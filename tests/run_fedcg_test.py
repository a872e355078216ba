"""The binary: flag validation at start (in-process, as `main` runs), and
tiny runs end to end in their own processes: one of FedCG, and FedAvg's for
resume, workers and signals (the same driver and loop as FedCG's)."""

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from absl import flags
from absl.testing import flagsaver
import psutil
import pytest
import tensorflow as tf

from binaries import run_fedcg
from fedcg_tff import names
from fedcg_tff.execution import devices
from fedcg_tff.execution import workers
from fedcg_tff.program import checkpoint
from fedcg_tff.program import run_record
from tasks import image_task
from tests import binary_runs
from tests import event_logs
from tests import fake_data


def _run(args, timeout=600):
  """run_fedcg in its own process; also returns the TFF workers it started
  (its worker_binary children, seen while it ran)."""
  done, workers = binary_runs.BinaryRun('run_fedcg', args).wait(timeout)
  return done.returncode, done.stdout, done.stderr, workers


_main = binary_runs.run_fedcg_in_process


@pytest.mark.parametrize('flag,message', [
    ('--lr=-1', '--lr must be finite and > 0, got -1.0'),
    ('--lr=nan', '--lr must be finite and > 0, got nan'),
    ('--weight_decay=inf', '--weight_decay must be finite and >= 0'),
    ('--seed=-3', '--seed must be in [0, 2147483647], got -3'),
    ('--local_epochs=0', '--local_epochs must be >= 1, got 0'),
    ('--gan_epochs=-1', '--gan_epochs must be >= 1'),
    ('--batch_size=0', '--batch_size must be >= 1'),
    ('--gan_beta1=1.5', '--gan_beta1 must be in [0, 1)'),
    ('--rounds=0', '--rounds must be >= 1'),
    ('--distance=l1', 'flag --distance=l1'),
    ('--algorithm=fedsgd', 'flag --algorithm=fedsgd'),
    ('--client_init=public', 'flag --client_init=public'),
    ('--prox_mu=-0.1', '--prox_mu must be finite and >= 0'),
    ('--server_data_size=100', '--server_data_size is only used by '
     '--algorithm=feddf'),
    ('--task=mnist', 'flag --task=mnist'),
    ('--model=vgg', 'flag --model=vgg'),
    ('--dirichlet_alpha=0', '--dirichlet_alpha must be finite and >= 0.001'),
    ('--partition=dirichlet --dirichlet_alpha=1e-9',
     '--dirichlet_alpha must be finite and >= 0.001, got 1e-09'),
    ('--noise_std=0.1', '--noise_std is only used with --add_noise'),
    ('--add_noise', '--add_noise needs --noise_std > 0'),
    ('--dirichlet_alpha=0.1', '--dirichlet_alpha is only used with '
     '--partition=dirichlet'),
    ('--algorithm=fedavg --prox_mu=0.5', '--prox_mu is only used by '
     '--algorithm=fedprox, not --algorithm=fedavg'),
    ('--diversity_weight=2', '--diversity_weight is only used by '
     '--algorithm=fedgen'),
    ('--task=domainnet --train_per_client=50', '--train_per_client is only '
     'used by --task=fmnist|fmnist_shift|cifar10|digit5, not --task=domainnet'),
    ('--workers=0', '--workers must be >= 1, got 0'),
    ('--worker_addresses=nohost', "--worker_addresses: 'nohost' is not "
     'host:port'),
    ('--worker_addresses=localhost:1 --lost_worker_timeout=-5',
     '--lost_worker_timeout must be finite and >= 0, got -5'),
    ('--worker_addresses=localhost:1 --lost_worker_timeout=nan',
     '--lost_worker_timeout must be finite and >= 0, got nan'),
    ('--lost_worker_timeout=60', '--lost_worker_timeout applies to '
     '--worker_addresses workers'),
    ('--device=gpu', '--device=gpu: TensorFlow sees no GPU'),
])
def test_invalid_flag_fails_at_start_naming_it(tmp_path, flag, message):
  # No data there: with its check broken, a case stops at the data, fast.
  error = _main([f'--output_dir={tmp_path / "out"}',
                 f'--data_dir={tmp_path / "absent"}', *flag.split()])
  assert error is not None and message in error, error
  assert not (tmp_path / 'out').exists()  # Nothing was started.


def test_output_dir_that_is_a_file_is_refused_at_start(tmp_path,
                                                       monkeypatch):
  """An output directory the run could not write is refused before the
  data loads: a file, a path under a file, an empty flag, a directory this
  user may not write (simulated: root may write anywhere)."""
  path = tmp_path / 'notes.txt'
  path.write_text('kept')
  absent = f'--data_dir={tmp_path / "absent"}'
  error = _main([f'--output_dir={path}', absent])
  assert error == f'--output_dir={path} is a file, not a directory', error
  error = _main([f'--output_dir={path}/run', absent])
  assert error == (f'--output_dir={path}/run: {path} is a file, not a '
                   'directory'), error
  assert _main(['--output_dir=', absent]) == ('--output_dir is empty: give a '
                                             'directory')
  assert path.read_text() == 'kept'
  locked = tmp_path / 'locked'
  locked.mkdir()
  access = os.access
  monkeypatch.setattr(os, 'access', lambda p, mode: (
      False if os.path.abspath(p) == str(locked) else access(p, mode)))
  error = _main([f'--output_dir={locked}/new/run', absent])
  assert error == (f'--output_dir={locked}/new/run: {locked} is not '
                   'writable'), error
  assert os.listdir(locked) == []
  # A path through a broken symlink (makedirs would fail on it at the end).
  dangling = tmp_path / 'dangling'
  os.symlink(tmp_path / 'nowhere', dangling)
  error = _main([f'--output_dir={dangling}/run', absent])
  assert error == (f'--output_dir={dangling}/run: {dangling} is a broken '
                   'symlink'), error


@pytest.mark.parametrize('args,message', [
    (['--algorithm=feddf', '--aggregation=secure'],
     '--aggregation=secure applies to --algorithm in'),
    (['--secure_bound=10'], '--secure_bound is only used with'),
    (['--aggregation=secure', '--secure_bound=0'], '--secure_bound must be'),
    (['--aggregation=secure', '--dp_sigma=0.1'], 'choose one'),
    (['--algorithm=fedavg', '--dp_sigma=0.1', '--dp_teacher_clip=2'],
     '--dp_teacher_clip is only used by --algorithm=fedcg'),
    (['--dp_teacher_clip=2'], '--dp_teacher_clip is only used with'),
    (['--dp_sigma=0.1', '--dp_teacher_clip=-1'], '--dp_teacher_clip must be'),
    # The device flags, refused before anything is read (no GPU here).
    (['--logical_gpus=2'], '--logical_gpus and --gpu_memory_mb need'),
    (['--device=gpu', '--logical_gpus=0'], '--logical_gpus must be >= 1'),
    (['--device=gpu', '--logical_gpus=2', '--gpu_memory_mb=-5'],
     '--gpu_memory_mb must be >= 1'),
    (['--device=gpu', '--gpu_memory_mb=512'],
     '--gpu_memory_mb is only used with --logical_gpus > 1'),
    (['--device=gpu', '--logical_gpus=2'], 'needs --gpu_memory_mb'),
    (['--device=gpu', '--matmul_precision=bfloat16'],
     '--matmul_precision=bfloat16 sets oneDNN (CPU) kernels'),
])
def test_private_aggregation_and_device_flags_are_checked(tmp_path, args, message):
  error = _main([f'--output_dir={tmp_path / "out"}',
                 f'--data_dir={tmp_path / "absent"}', *args])
  assert error is not None and message in error, error
  assert not (tmp_path / 'out').exists()


def test_dp_fedcg_flags_give_its_aggregator_and_epsilon(monkeypatch,
                                                        tmp_path):
  """What run.json and results.json record for DP-FedCG, and the
  aggregation the process is built with (flags parsed in-process): DP-FedCG's
  factory with sigma, clip, the logits' clip and the clients of a round;
  the baselines' with sigma and clip."""
  from fedcg_tff.privacy import dp  # pylint: disable=g-import-not-at-top
  made = []
  monkeypatch.setattr(dp, 'fedcg_mean_factory',
                      lambda *a: made.append(('fedcg', *a)) or 'fedcg')
  monkeypatch.setattr(dp, 'mean_factory',
                      lambda *a: made.append(('baseline', *a)) or 'baseline')
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(['run_fedcg', '--algorithm=fedcg', '--dp_sigma=1',
                 '--dp_clip=0.5', '--dp_teacher_clip=2', '--output_dir=x'])
    assert run_fedcg.dp_definition() == {
        'dp_sigma': 1.0, 'dp_clip': 0.5, 'dp_teacher_clip': 2.0}
    assert run_fedcg.dp_aggregation(4) == {'aggregation_factory': 'fedcg',
                                           'upload_updates': True}
    assert made == [('fedcg', 1.0, 0.5, 2.0, 4)]
    summary = run_fedcg.dp_summary(7)['dp']
    assert summary['epsilon'] == dp.fedcg_epsilon(1.0, 0.5, 2.0, 7)
    # Replacing a client's uploads: twice the sensitivity, as if half the
    # noise.
    assert summary['epsilon_replace'] == dp.fedcg_epsilon(0.5, 0.5, 2.0, 7)
    assert summary['dp_teacher_clip'] == 2.0
    # Rounds started again after an interruption are releases too: here
    # round 3 redone after a fallback, and a round 6 that a start-over
    # undid.
    started = run_record.RoundsStarted(str(tmp_path), ran_before=False)
    for round_number in (1, 2, 3, 4, 5, 6, 3):
      started.start(round_number)
    again = run_fedcg.dp_summary(5, started)['dp']
    assert (again['releases'], again['extra_releases']) == (7, 2)
    assert again['epsilon'] == summary['epsilon']
    assert 'round_starts_partial' not in again
    unreadable = tmp_path / 'unreadable'
    (unreadable / 'rounds_started.json').mkdir(parents=True)
    with pytest.raises(ValueError, match=(
        r'unreadable/rounds_started.json cannot be read \(.*Is a directory'
        r'.*\): make it readable')):
      run_record.RoundsStarted(str(unreadable), ran_before=True)
    # A start is on record before the round can run (its data comes first).

    def no_data(round_num):
      raise RuntimeError(f'no data for round {round_num + 1}')

    with pytest.raises(RuntimeError, match='round 8'):
      run_fedcg.recording_starts(no_data, started)(7)
    assert json.loads((tmp_path / 'rounds_started.json').read_text())[
        'rounds'][-1] == 8
    flags.FLAGS.unparse_flags()
    flags.FLAGS(['run_fedcg', '--algorithm=fedcg', '--dp_sigma=1',
                 '--dp_clip=3', '--output_dir=x'])
    # The logits' clip defaults to --dp_clip.
    assert run_fedcg.dp_definition()['dp_teacher_clip'] == 3.0
    flags.FLAGS.unparse_flags()
    flags.FLAGS(['run_fedcg', '--algorithm=fedavg', '--dp_sigma=0.1',
                 '--dp_clip=3', '--output_dir=x'])
    assert run_fedcg.dp_aggregation(3)['aggregation_factory'] == 'baseline'
    assert made[-1] == ('baseline', 0.1, 3.0, 3)


def test_dp_run_charges_a_round_it_runs_again(tmp_path, capfd):
  """A DP run stopped after a round's noised uploads reached the server but
  before the round was saved redoes it on resume: the server has seen that
  round's uploads twice, with independent noise, and epsilon counts both
  (rounds_started.json). A damaged record stops the run, naming it."""
  from fedcg_tff.privacy import dp  # pylint: disable=g-import-not-at-top
  out = tmp_path / 'dp'
  args = [f'--output_dir={out}', f'--data_dir={_fake_idx(tmp_path)}',
          '--algorithm=fedavg', '--dp_sigma=0.1', '--dp_clip=3',
          '--rounds=1', '--num_clients=2', '--train_per_client=16',
          '--local_epochs=1']
  assert _main(args) is None
  results = out / 'results.json'
  first = json.loads(results.read_text())['dp']
  assert (first['releases'], first['extra_releases']) == (1, 0)
  # As if stopped between round 1's release and its save.
  shutil.rmtree(out / 'checkpoints' / 'round_1')
  results.unlink()
  capfd.readouterr()
  assert _main(args) is None
  again = json.loads(results.read_text())['dp']
  assert (again['releases'], again['extra_releases']) == (2, 1)
  assert again['epsilon'] == dp.epsilon(0.1, 3.0, 2) > first['epsilon']
  started = out / 'rounds_started.json'
  assert json.loads(started.read_text()) == {'rounds': [1, 1],
                                             'partial': False}
  assert ('after 2 rounds of uploads (1 of them from rounds started again '
          'after an interruption, rounds_started.json)'
          in capfd.readouterr().out)
  results.unlink()
  for damaged in ('{"rounds": "1, 1"}', '{"rounds": [1, true]}'):
    started.write_text(damaged)
    assert _main(args) == (f'{started} does not hold the rounds a run '
                           'started: restore it, or choose a new '
                           '--output_dir')
  # A run that ran before the record existed: its record is partial, and
  # the accounting says so.
  started.unlink()
  shutil.rmtree(out / 'checkpoints' / 'round_1')
  capfd.readouterr()
  assert _main(args) is None
  partial = json.loads(results.read_text())['dp']
  assert partial['round_starts_partial'] and partial['releases'] == 1
  assert 'a lower bound: rounds_started.json began' in capfd.readouterr().out


def test_replay_draws_and_precision_are_recorded_only_when_set():
  """A run.json written before --replay_draws and --matmul_precision
  existed (a committed one) has the keys the default flags' definition
  has, so such runs still resume; a replaying or bfloat16 run records the
  flag, so that a resume with the other setting is refused."""
  committed = os.path.join(os.path.dirname(__file__), '..', 'results',
                           'fmnist_paper_protocol', 'fedcg', 'seed_1',
                           'run.json')
  with open(committed) as f:
    older = json.load(f)
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(['run_fedcg', '--output_dir=x'])
    default = run_fedcg.run_definition(run_fedcg.config_from_flags())
    assert set(default['config']) == set(older['config'])
    flags.FLAGS.unparse_flags()
    flags.FLAGS(['run_fedcg', '--replay_draws', '--output_dir=x'])
    config = run_fedcg.config_from_flags()
    assert config.replay_draws is True
    assert run_fedcg.run_definition(config)['config']['replay_draws'] is True
    flags.FLAGS.unparse_flags()
    flags.FLAGS(['run_fedcg', '--matmul_precision=bfloat16', '--output_dir=x'])
    config = run_fedcg.config_from_flags()
    assert run_fedcg.run_definition(config)['config'][
        'matmul_precision'] == 'bfloat16'


def test_bfloat16_on_a_host_without_it_is_refused_at_start(tmp_path,
                                                           monkeypatch):
  from fedcg_tff.execution import precision  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(precision, 'has_bfloat16_arithmetic',
                      lambda cpuinfo=None: False)
  error = _main([f'--output_dir={tmp_path / "out"}',
                 f'--data_dir={tmp_path / "absent"}',
                 '--matmul_precision=bfloat16'])
  assert error is not None and error.startswith(
      '--matmul_precision=bfloat16 needs a CPU with bfloat16 arithmetic'), error
  assert not (tmp_path / 'out').exists()


def test_secure_fedavg_run_records_its_aggregation(tmp_path, capfd):
  """A bound far below the uploads' values: every round clips, results.json
  sums each count over the rounds, and the run says to raise the bound."""
  data = _fake_idx(tmp_path)
  out = tmp_path / 'secure'
  assert _main([f'--output_dir={out}', f'--data_dir={data}',
                '--algorithm=fedavg', '--aggregation=secure', '--rounds=2',
                '--num_clients=2', '--train_per_client=16',
                '--local_epochs=1', '--secure_bound=0.001']) is None
  assert json.loads((out / 'run.json').read_text())['run'][
      'secure_bound'] == 0.001
  results = json.loads((out / 'results.json').read_text())
  assert results['aggregation'] == 'secure'
  clipped = results['secure_clipped']
  with open(out / 'metrics.csv', newline='') as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 2
  # The weighted values clip (both ways: updates of either sign), in every
  # round; the weights' sum has its own bound.
  values = 'aggregator/mean_value/secure_%s_clipped_count'
  for key, total in clipped.items():
    per_round = [int(float(r[key])) for r in rows]
    assert min(per_round) >= 0 and sum(per_round) == total, (key, rows)
    if key in (values % 'upper', values % 'lower'):
      assert min(per_round) > 0, (key, rows)
  assert values % 'upper' in clipped and values % 'lower' in clipped
  assert ('secure aggregation clipped uploads (raise --secure_bound)'
          in capfd.readouterr().out)


def test_missing_data_and_taken_output_dir(tmp_path):
  error = _main([f'--output_dir={tmp_path / "out"}',
                 f'--data_dir={tmp_path / "nothing"}'])
  assert '--data_dir' in error and 'not found' in error
  assert not (tmp_path / 'out').exists()  # No output directory was left.
  data = _fake_idx(tmp_path)
  taken = tmp_path / 'taken'
  taken.mkdir()
  (taken / 'metrics.csv').write_text('keep me')
  error = _main([f'--output_dir={taken}', f'--data_dir={data}',
                 '--train_per_client=16'])
  assert '--output_dir' in error
  assert (taken / 'metrics.csv').read_text() == 'keep me'


def test_flags_list_every_registered_algorithm_and_task():
  from fedcg_tff.algorithms import catalog  # pylint: disable=g-import-not-at-top
  from fedcg_tff import config  # pylint: disable=g-import-not-at-top
  from fedcg_tff.models import families  # pylint: disable=g-import-not-at-top
  from tasks import pooled  # pylint: disable=g-import-not-at-top
  from tasks import registry  # pylint: disable=g-import-not-at-top
  assert run_fedcg.ALGORITHMS == catalog.ALGORITHMS
  assert run_fedcg.TASKS == tuple(registry.TASKS)
  assert config.MODELS == families.MODELS
  assert names.SERVER_DATA_TASKS == tuple(
      t for t, size in registry.DEFAULT_SERVER_SIZE.items() if size)
  # The tasks built by tasks.pooled (labelled server slice).
  assert names.POOLED_TASKS == tuple(
      t for t, module in registry._MODULES.items()  # pylint: disable=protected-access
      if getattr(module, 'pooled', None) is pooled)
  # The flags that only some algorithms or tasks use are run_fedcg flags,
  # naming algorithms and tasks that exist.
  for table, known in ((names.ALGORITHM_FLAGS, catalog.ALGORITHMS),
                       (names.TASK_FLAGS, registry.TASKS)):
    for flag, users in table.items():
      assert flag in flags.FLAGS and users and set(users) <= set(known), flag


def test_task_errors_name_the_flag(tmp_path):
  error = _main([f'--output_dir={tmp_path / "out"}', '--task=digit5',
                 f'--data_dir={tmp_path / "none"}'])
  assert '--task=digit5' in error and 'none' in error
  assert not (tmp_path / 'out').exists()
  data = _fake_idx(tmp_path)
  error = _main([f'--output_dir={tmp_path / "out"}',
                 '--task=office_caltech10', '--algorithm=feddf',
                 f'--data_dir={data}'])
  assert 'needs unlabeled server data' in error
  error = _main([f'--output_dir={tmp_path / "out"}', f'--data_dir={data}',
                 '--num_clients=2', '--train_per_client=16',
                 '--batch_size=32'])
  assert "--batch_size=32 is larger than client 'client_0''s 16" in error
  assert not (tmp_path / 'out').exists()


def test_feddf_run_uses_disjoint_server_data(tmp_path, capfd, monkeypatch):
  data = _fake_idx(tmp_path)
  error = _main([
      f'--output_dir={tmp_path / "big"}', f'--data_dir={data}',
      '--algorithm=feddf', '--num_clients=2', '--train_per_client=16',
      '--server_data_size=40'])
  assert '+ 40 server examples need 72' in error  # Only 64.
  # A server set over the memory bound (here 20 images of 32x32 against a
  # bound lowered to 50 KiB: 0.078 MiB) is refused before anything runs.
  with monkeypatch.context() as patch:
    patch.setattr(run_fedcg, 'MAX_SERVER_GIB', 50 / 2**20)
    error = _main([
        f'--output_dir={tmp_path / "big"}', f'--data_dir={data}',
        '--algorithm=feddf', '--num_clients=2', '--train_per_client=16',
        '--server_data_size=20', '--rounds=1', '--local_epochs=1',
        '--server_epochs=1', '--server_steps_per_epoch=2'])
  assert error and ('--server_data_size=20 at 32x32 (lenet) needs 0.0 GiB '
                    'as float32 inputs on the server, more than') in error
  assert not (tmp_path / 'big').exists()
  out = tmp_path / 'out'
  assert _main([
      f'--output_dir={out}', f'--data_dir={data}', '--algorithm=feddf',
      '--num_clients=2', '--train_per_client=16', '--server_data_size=20',
      '--rounds=1', '--local_epochs=1', '--server_epochs=1',
      '--server_steps_per_epoch=2']) is None
  assert "server: 20 unlabeled images" in capfd.readouterr().out
  results = json.loads((out / 'results.json').read_text())
  assert results['algorithm'] == 'feddf' and results['rounds_run'] == 1
  header = (out / 'metrics.csv').read_text().splitlines()[0].split(',')
  assert 'server/server_loss' in header


_TINY_RUN = ['--num_clients=2', '--train_per_client=16', '--local_epochs=1',
             '--gan_epochs=1', '--server_epochs=1',
             '--server_steps_per_epoch=2', '--rounds=4', '--patience=9']
# FedAvg for the runs that check the driver and the loop (resume, workers,
# signals): the same code paths as FedCG's at a third of the cost.
_FEDAVG_RUN = ['--algorithm=fedavg', '--num_clients=2', '--train_per_client=16',
               '--local_epochs=1', '--rounds=4', '--patience=9']
_TIMING = ('round_seconds', 'mean_round_seconds', 'total_round_seconds')


def _metrics_without_timing(out):
  with open(out / 'metrics.csv', newline='') as f:
    rows = list(csv.DictReader(f))
  return [{k: v for k, v in r.items() if k not in _TIMING} for r in rows]


def _results_without_timing(out):
  results = json.loads((out / 'results.json').read_text())
  return {k: v for k, v in results.items() if k not in _TIMING}


def _assert_same_run(out, reference):
  assert _metrics_without_timing(out) == _metrics_without_timing(reference)
  assert _results_without_timing(out) == _results_without_timing(reference)


def _fake_idx(tmp_path):
  data = tmp_path / 'idx'
  data.mkdir()
  fake_data.write_fake_fmnist(str(data), n_train=64, n_test=40)
  return data


def _gone(pids):
  """Whether none of `pids` is a live process any more."""
  return not any(binary_runs.alive(p) for p in pids)


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  return _fake_idx(tmp_path_factory.mktemp('data'))


@pytest.fixture(scope='module')
def fedavg_run(data_dir, tmp_path_factory):
  """One uninterrupted tiny FedAvg run: what the runs below reproduce."""
  whole = tmp_path_factory.mktemp('fedavg') / 'whole'
  rc, stdout, err, workers = _run([f'--output_dir={whole}',
                                   f'--data_dir={data_dir}', *_FEDAVG_RUN])
  assert rc == 0, err[-3000:]
  assert workers and _gone(workers)
  return whole, stdout


@pytest.fixture(scope='module')
def fedcg_run(data_dir, tmp_path_factory):
  """The one FedCG binary run (4 tiny rounds), shared by the tests of its
  output and of the inversion attack on it."""
  out = tmp_path_factory.mktemp('fedcg') / 'fedcg'
  rc, stdout, err, workers = _run([f'--output_dir={out}',
                                   f'--data_dir={data_dir}', *_TINY_RUN])
  assert rc == 0, err[-3000:]
  return out, stdout, workers


def test_tiny_fedcg_run_end_to_end(fedcg_run):
  """The one FedCG binary run: progress, table, files, and no worker left
  behind (its first round's reproducibility: the next test)."""
  out, stdout, workers = fedcg_run
  assert workers and _gone(workers)
  assert 'round 1/4' in stdout and 'round 4/4' in stdout and 'ETA' in stdout
  assert 'task fmnist: 2 clients' in stdout  # The task's description.
  assert 'test_acc_at_best_val' in stdout and 'mean' in stdout
  assert f'tensorboard --logdir {out}/tensorboard' in stdout
  results = json.loads((out / 'results.json').read_text())
  assert results['rounds_run'] == 4 and results['client_init'] == 'shared'
  assert len(results['test_accuracy_at_best_val']) == 2
  assert results['host'] == devices.host_cpu()  # What its times ran on.
  definition = json.loads((out / 'run.json').read_text())
  assert definition['config']['server_steps_per_epoch'] == 2
  assert definition['config']['client_init'] == 'shared'
  assert definition['run']['rounds'] == 4
  rows = _metrics_without_timing(out)
  assert len(rows) == 4 and float(rows[0]['mean/gamma']) == 0.0
  for key in ('client_1/g_loss', 'client_0/d_loss', 'server/distill_kl'):
    assert rows[0][key] != ''
  # Every round reached TensorBoard (each is written out as it is released:
  # nothing waits for the exit, where runtime freezes the collector).
  assert event_logs.steps(out / 'tensorboard') == [1, 2, 3, 4]


def test_tiny_fedcg_run_repeats_across_processes(fedcg_run, data_dir,
                                                 tmp_path):
  """Round 1 of the run above again, in this process: the same metrics
  and accuracies bit for bit (a race in the order of a client's passes
  showed between processes only, training_tf.PASS_ORDER_NOTE)."""
  out, _, _ = fedcg_run
  again = tmp_path / 'again'
  args = [a for a in _TINY_RUN if not a.startswith('--rounds=')]
  assert _main([f'--output_dir={again}', f'--data_dir={data_dir}', *args,
                '--rounds=1']) is None
  assert _metrics_without_timing(again) == _metrics_without_timing(out)[:1]


@pytest.fixture(scope='module')
def replaying_run(data_dir, tmp_path_factory):
  """A one-round --replay_draws run (in this process), and the (round,
  replay) of every train_datasets call it made.

  DP-FedCG with noise far above G's moving variances: the attack's noised
  G keeps them valid as the server does (otherwise its features are NaN
  and the inversion refuses them)."""
  asked = []
  datasets = image_task.FederatedImageTask.train_datasets

  def recorded(task, round_num, *args):
    asked.append((round_num, args[-1]))
    return datasets(task, round_num, *args)

  run = tmp_path_factory.mktemp('replaying') / 'run'
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(image_task.FederatedImageTask, 'train_datasets', recorded)
    assert _main([f'--output_dir={run}', f'--data_dir={data_dir}',
                  *_TINY_RUN, '--rounds=1', '--replay_draws',
                  '--dp_sigma=10']) is None
  return run, asked


@pytest.fixture(scope='module')
def attacks(fedcg_run, replaying_run, tmp_path_factory):
  """binaries/run_inversion_attack.py, every call in one interpreter (one
  import; the attack traces a process once for all its calls): after rounds
  1 and 4 of the FedCG run, runs it must refuse, round 1 against a FedAvg
  run without saves, and client 1 of the replaying run.

  Returns (each call's stop, the interpreter's output, the paths)."""
  run, _, _ = fedcg_run
  replaying, _ = replaying_run
  tmp_path = tmp_path_factory.mktemp('attacks')
  paths = {'run': run, 'out': tmp_path / 'inversion',
           'refused': tmp_path / 'refused',
           'round_1': tmp_path / 'round_1',
           'replaying': tmp_path / 'replaying_inversion'}
  # Runs the attack must refuse, by their run.json alone.
  definition = json.loads((run / 'run.json').read_text())
  fakes = {}
  for name, part, changes in (
      ('on_disk', 'run', {'client_states_on_disk': True}),
      ('secure', 'run', {'aggregation': 'secure'}),
      ('sampled', 'run', {'clients_per_round': 1}),
      ('office', 'run', {'task': 'office_caltech10'}),
      ('fedavg_seed_9', 'config', {'seed': 9}),
      ('fedavg_tpc', 'run', {'train_per_client': 17}),
      ('fedavg_no_saves', 'run', {}),
      # The task's default client count (4), found only by loading it
      # (from a pool large enough for 4 clients).
      ('fedavg_default_clients', 'run',
       {'num_clients': None, 'data_dir': str(tmp_path / 'pool')})):
    fake = json.loads(json.dumps(definition))
    fake[part].update(changes)
    if name.startswith('fedavg'):
      fake['run']['algorithm'] = 'fedavg'
    (tmp_path / name).mkdir()
    (tmp_path / name / 'run.json').write_text(json.dumps(fake))
    fakes[name] = tmp_path / name
  paths.update(fakes)
  (tmp_path / 'pool').mkdir()
  fake_data.write_fake_fmnist(str(tmp_path / 'pool'), n_train=120, n_test=40)
  refused = paths['refused']
  tiny = ['--num_images=1', '--iterations=1', '--latent_iterations=1',
          '--latent_restarts=1', '--shadow_epochs=1', '--aux_size=24']
  stops, done = binary_runs.main_calls('run_inversion_attack', [
      [f'--run_dir={run}', '--rounds=1,4', '--num_images=2',
       '--iterations=5', '--latent_iterations=5', '--latent_restarts=1',
       '--shadow_epochs=1', '--aux_size=24', f'--output_dir={paths["out"]}'],
      [f'--run_dir={run}', '--rounds=1,3', f'--output_dir={refused}'],
      [f'--run_dir={run}', '--client=-1', f'--output_dir={refused}'],
      [f'--run_dir={fakes["on_disk"]}', f'--output_dir={refused}'],
      [f'--run_dir={fakes["secure"]}', f'--output_dir={refused}'],
      [f'--run_dir={fakes["sampled"]}', f'--output_dir={refused}'],
      [f'--run_dir={run}', f'--fedavg_run_dir={fakes["fedavg_seed_9"]}',
       f'--output_dir={refused}'],
      [f'--run_dir={run}', f'--fedavg_run_dir={fakes["fedavg_tpc"]}',
       f'--output_dir={refused}'],
      [f'--run_dir={run}', f'--fedavg_run_dir={fakes["fedavg_no_saves"]}',
       '--rounds=4', f'--output_dir={refused}'],
      [f'--run_dir={run}',
       f'--fedavg_run_dir={fakes["fedavg_default_clients"]}', '--rounds=1',
       '--aux_size=24', f'--output_dir={refused}'],
      # Round 1 of a FedAvg run without saves (the fresh state) works.
      [f'--run_dir={run}', f'--fedavg_run_dir={fakes["fedavg_no_saves"]}',
       '--rounds=1', *tiny, f'--output_dir={paths["round_1"]}'],
      # The replaying run's client 1 (test_replay_draws_reach_...).
      [f'--run_dir={replaying}', '--rounds=1', '--client=1', *tiny,
       f'--output_dir={paths["replaying"]}'],
      # Into the first call's report, and into the run it reads.
      [f'--run_dir={run}', '--rounds=1', *tiny,
       f'--output_dir={paths["out"]}'],
      [f'--run_dir={run}', '--rounds=1', *tiny,
       f'--output_dir={run}/tensorboard/inversion'],
      # A round after the run's last.
      [f'--run_dir={run}', '--rounds=4,5', f'--output_dir={refused}'],
      # A task without a labelled pool, refused from run.json alone (its
      # data dir is this run's FMNIST: loading it would fail otherwise).
      [f'--run_dir={fakes["office"]}', f'--output_dir={refused}'],
  ])
  return stops, done, paths


def test_inversion_attack_on_the_tiny_fedcg_run(attacks):
  """binaries/run_inversion_attack.py after rounds 1 and 4 of the run
  above: every row, the replay check, the report; a round whose previous
  state is not kept is refused before any work."""
  stops, done, paths = attacks
  run, out, refused = paths['run'], paths['out'], paths['refused']
  assert len(stops) == 16 and stops[0] is None, (stops, done.stderr[-3000:])
  assert stops[10] is None, stops[10]
  # Round 1 beside the FedAvg run: its row inverts the extractor FedAvg
  # shares, one PSNR per attacked image.
  round_1 = json.loads((paths['round_1'] / 'inversion.json').read_text())
  fedavg_rows = [r for r in round_1['rows'] if r['algorithm'] == 'fedavg']
  assert [(r['round'], r['extractor'], r['target'], len(r['psnr']))
          for r in fedavg_rows] == [(1, 'shared', 'features', 1)], fedavg_rows
  assert '| 1 | fedavg |' in (paths['round_1'] / 'inversion.md').read_text()
  for stopped, message in zip(stops[2:10], (
      '--client must be >= 0, got -1',
      'on_disk kept its client states on disk',
      'secure used --aggregation=secure',
      'sampled samples clients',
      'has seed 9, --run_dir=',
      'has train_per_client 17, --run_dir=',
      'round 4 needs the state after round 3, which --fedavg_run_dir=',
      'fedavg_default_clients has clients ')):
    assert stopped and message in stopped, (stopped, message)
  # The default client count is refused before any replay (each call's
  # output ends at its MAIN_CALL line).
  outputs = re.split(r'^MAIN_CALL .*$', done.stdout, flags=re.M)
  assert 'inverting' in outputs[0] and 'inverting' not in outputs[9]
  # Progress through the replays, each a whole clients' step.
  assert re.search(r"round 4: recomputing the clients' step of fedcg from "
                   r".*\nround 4: recomputed \(\d+s\)", outputs[0]), outputs[0]
  # Nothing written, not even into the runs read.
  assert not refused.exists()
  assert not (paths['fedavg_no_saves'] / 'checkpoints').exists()
  summary = json.loads((out / 'inversion.json').read_text())
  rows = {(r['round'], r['extractor'], r['target']) for r in summary['rows']}
  assert rows == {(r, e, t) for r in (1, 4)
                  for e in ('true', 'own', 'disjoint', 'shifted')
                  for t in ('features', 'fitted', 'sampled')}
  assert all(len(r['psnr']) == 2 for r in summary['rows'])
  # Round 4 was recomputed from the save of round 3 and checked against the
  # run's own save of round 4: the same E_i bit for bit, as the README says
  # (a replay on another round's data, or with other draws, is not; the
  # round did change E_i).
  check = summary['replay_check']['4']
  assert check['replay_to_saved'] == 0.0 < check['round_change'], check
  table = (out / 'inversion.md').read_text()
  assert '| 4 | fedcg | true E_i (upper bound) | E_i(x) (upper bound) |' in table
  assert (out / 'grid_round_4.png').stat().st_size > 1000
  assert ('--rounds: round 3 needs the state after round 2' in stops[1]
          and 'rounds [3, 4]' in stops[1]), stops[1]
  # A second attack into the first's directory or into the run: refused
  # before any work (the first report is the two-round one above).
  assert stops[12] == (f'--output_dir={out} holds an earlier report '
                       '(inversion.json): give a new directory, or move that '
                       'one away'), stops[12]
  assert stops[13] == (f'--output_dir is in --run_dir={run}: write the '
                       'report outside the runs it reads'), stops[13]
  assert stops[14] == (f'--rounds: --run_dir={run} has run 4 rounds (its '
                       'newest checkpoint), not round 5'), stops[14]
  assert stops[15] == (
      f'--run_dir={paths["office"]} is a run of task office_caltech10: the '
      'shadow extractors train on labelled auxiliary images from the pooled '
      'training split the clients are drawn from, which only fmnist, '
      'fmnist_shift, cifar10 have'), stops[15]
  assert 'inverting' not in ''.join(outputs[12:16])


def test_replay_draws_reach_the_run_and_the_attack(replaying_run, attacks):
  """--replay_draws reaches the datasets run_fedcg trains on, and
  run_inversion_attack recomputes a replaying run's round on the same
  draws: its replay check would fail on the attacked client's own data
  (client 1's: client 0's first round is the same with or without)."""
  _, asked = replaying_run
  assert asked == [(0, True)]
  stops, done, paths = attacks
  assert len(stops) == 16 and stops[11] is None, (stops, done.stderr[-3000:])
  summary = json.loads((paths['replaying'] / 'inversion.json').read_text())
  check = summary['replay_check']['1']
  assert check['replay_to_saved'] == 0.0 < check['round_change'], check


_WITHOUT_TF = """
import sys
from absl import app, flags
from binaries import run_fedcg
try:
  run_fedcg.main(flags.FLAGS(sys.argv))
except app.UsageError as e:
  print('refused:', e)
print('tensorflow imported:', 'tensorflow' in sys.modules)
"""


def test_finished_run_is_reported_or_refused_before_tensorflow(fedavg_run,
                                                               data_dir):
  """A rerun of a finished run (what a restarted sweep does for each) and
  other flags into its directory answer without importing TensorFlow."""
  whole, _ = fedavg_run
  written = {p: p.read_bytes() for p in whole.iterdir() if p.is_file()}
  for extra, answer in (([], 'already holds this finished run (4 rounds)'),
                        (['--lr=0.001'], '--lr: stored 0.0003, given 0.001'),
                        (['--num_clients=3'], '--num_clients: stored 2')):
    done = subprocess.run(
        [sys.executable, '-c', _WITHOUT_TF, f'--output_dir={whole}',
         f'--data_dir={data_dir}', *_FEDAVG_RUN, *extra],
        cwd=binary_runs.ROOT, capture_output=True, text=True, timeout=60)
    assert answer in done.stdout, done.stdout + done.stderr[-2000:]
    assert 'tensorflow imported: False' in done.stdout
  assert written == {p: p.read_bytes() for p in whole.iterdir() if p.is_file()}
  # Also from a directory this user may not write (simulated: root may
  # write anywhere), in this process.
  access = os.access
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(os, 'access', lambda p, mode: (
        False if os.path.abspath(p) == str(whole) else access(p, mode)))
    assert _main([f'--output_dir={whole}', f'--data_dir={data_dir}',
                  *_FEDAVG_RUN]) is None


def test_two_workers_give_the_same_metrics(fedavg_run, data_dir, tmp_path):
  """Also: the run leaves none of its workers behind."""
  whole, _ = fedavg_run
  out = tmp_path / 'two_workers'
  rc, stdout, err, workers = _run([f'--output_dir={out}',
                                   f'--data_dir={data_dir}', *_FEDAVG_RUN,
                                   '--workers=2'])
  assert rc == 0, err[-3000:]
  assert 'spread over 2 TFF workers' in stdout
  # The pool's two workers and the default context's one. TFF starts a
  # worker when a computation is first sent to it, so a pool worker that
  # never got a shard is not counted: with every shard sent to the first
  # worker only two are seen (tried).
  assert len(workers) == 3 and _gone(workers)
  _assert_same_run(out, whole)


def _start(out, args, env=None):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', **(env or {}))
  return subprocess.Popen(
      [sys.executable, '-m', 'binaries.run_fedcg', f'--output_dir={out}',
       *args], cwd=binary_runs.ROOT, env=env, stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(path, proc, timeout=300):
  deadline = time.time() + timeout
  while not path.exists():
    assert proc.poll() is None, 'the run ended too early'
    assert time.time() < deadline
    time.sleep(0.1)


def test_terminated_run_stops_promptly_and_resumes_to_the_same_result(
    fedavg_run, data_dir, tmp_path, capfd, monkeypatch):
  """SIGTERM (a CI time limit, `kill`) between rounds: the run exits at
  once with 128 + SIGTERM, leaving no TFF worker and its saved rounds; the
  resumed run stops cleanly on a NaN, then on a full disk, then resumes to
  the uninterrupted result. (A SIGKILL there leaves the same files: everything before the
  hold is written. That no worker outlives a SIGKILL is runtime_test's.)
  """
  whole, _ = fedavg_run
  args = [f'--data_dir={data_dir}', *_FEDAVG_RUN]
  broken = tmp_path / 'broken'
  proc = _start(broken, args, env={'FEDCG_TEST_HOLD_ROUND': '3'})
  try:
    _wait_for(broken / 'checkpoints' / 'round_2', proc)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children  # TFF's worker.
    # A second run in the same directory meanwhile is refused, naming the
    # first, and changes nothing there.
    error = _main([f'--output_dir={broken}', *args])
    assert f'is in use by another run (pid {proc.pid})' in str(error), error
    assert [r['round'] for r in _metrics_without_timing(broken)] == ['1', '2']
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
  finally:
    binary_runs.kill_tree(proc)  # Held for 10 minutes if a check failed.
  assert proc.returncode == 128 + signal.SIGTERM
  _, alive = psutil.wait_procs(children, timeout=10)
  assert not alive
  assert not (broken / 'results.json').exists()

  # The resumed run (in this process from here on: the rest is not about
  # processes) meets a NaN in client 1's round-3 data: it stops naming
  # round, client and quantity, with rounds 1-2 still saved.
  monkeypatch.setenv('FEDCG_TEST_INJECT_NAN', '3:1')
  error = _main([f'--output_dir={broken}', *args])
  monkeypatch.delenv('FEDCG_TEST_INJECT_NAN')
  assert 'round 3, client 1: cls_loss is nan' in error, error
  assert 'resumes after round 2' in error
  assert sorted(os.listdir(broken / 'checkpoints'))[-1] == 'round_2'
  assert [r['round'] for r in _metrics_without_timing(broken)] == ['1', '2']
  assert not (broken / 'results.json').exists()

  # Rerun, the disk fills while round 3 is saved (TF's error, as a full
  # tmpfs gave it): it stops saying so, with rounds 1-2 still saved.
  def no_space(self, rounds_done, state):
    del self, rounds_done, state
    raise tf.errors.ResourceExhaustedError(
        None, None, '{{function_node __wrapped__SaveV2_dtypes_9_device_/job:'
        'localhost}} .../part-00000-of-00001; No space left on device '
        '[Op:SaveV2]')

  with monkeypatch.context() as patch:
    patch.setattr(checkpoint.Checkpoints, 'save', no_space)
    error = _main([f'--output_dir={broken}', *args])
  assert error.startswith(
      'Out of disk space: .../part-00000-of-00001; No space left on device '
      '[Op:SaveV2]\n'), error
  assert 'rerunning the same command resumes after round 2' in error
  assert 'a checkpoint of this run takes ' in error
  assert sorted(os.listdir(broken / 'checkpoints'))[-1] == 'round_2'
  # Round 3's metrics were released before its save: the resume drops them.
  assert [r['round'] for r in _metrics_without_timing(broken)] == [
      '1', '2', '3']

  # Rerun, a remote worker goes silent in round 3 past
  # --lost_worker_timeout (workers_test makes that happen; here the error
  # is raised where round 3 begins): it stops naming the worker, with
  # rounds 1-2 still saved. A run that loses it in round 1 has saved
  # nothing and says that rerunning starts again.
  train_datasets = image_task.FederatedImageTask.train_datasets

  def lost_in_round(lost_round):
    def datasets(self, round_num, *rest, **kwargs):
      if round_num + 1 == lost_round:
        raise workers.WorkerLost(
            'the TFF worker at localhost:1 did not answer for 5 s in the '
            'middle of a round (--lost_worker_timeout=5)')
      return train_datasets(self, round_num, *rest, **kwargs)
    return datasets

  with monkeypatch.context() as patch:
    patch.setattr(image_task.FederatedImageTask, 'train_datasets',
                  lost_in_round(3))
    error = _main([f'--output_dir={broken}', *args])
    assert error.startswith(
        'Worker lost: the TFF worker at localhost:1 did not answer for 5 s'
        ), error
    assert 'rerunning the same command resumes after round 2, once a ' \
        'worker serves there again' in error, error
    assert sorted(os.listdir(broken / 'checkpoints'))[-1] == 'round_2'
    patch.setattr(image_task.FederatedImageTask, 'train_datasets',
                  lost_in_round(1))
    error = _main([f'--output_dir={tmp_path / "lost_at_once"}', *args])
    assert 'no round was saved yet, and rerunning the same command starts ' \
        'the run again' in error, error

  # Without the fault it resumes after round 2 to the uninterrupted result.
  capfd.readouterr()
  assert _main([f'--output_dir={broken}', *args]) is None
  assert 'resuming after round 2' in capfd.readouterr().out
  _assert_same_run(broken, whole)
  # TensorBoard holds every round once.
  assert event_logs.steps(broken / 'tensorboard') == [1, 2, 3, 4]
  # Rerunning it, or other flags into it: test_finished_run_is_reported_or_
  # refused_before_tensorflow.



def test_a_file_the_run_may_not_use_stops_it_naming_the_file(
    tmp_path, data_dir, monkeypatch):
  """A checkpoint, client-state or metrics file this user is refused while
  the run goes on (made read-only or another user's) ends the run with the
  path and what is saved, not a traceback; other errors pass through. (The
  process build and the rounds are stubbed: the refusal is simulated, as
  root may write anywhere.)"""
  from fedcg_tff.algorithms import catalog  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import client_store  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import round_loop  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / 'out' / 'checkpoints' / 'round_3_temp1234')
  errors = [PermissionError(13, 'Permission denied', path),
            tf.errors.PermissionDeniedError(
                None, None, f'{path}; Permission denied [Op:SaveV2]'),
            ValueError(path)]

  def refused(*args, **kwargs):
    del args, kwargs
    raise errors.pop(0)

  monkeypatch.setattr(catalog, 'build', lambda *args, **kwargs: None)
  monkeypatch.setattr(round_loop, 'run', refused)
  saved = ('\nThe run stopped; no round was saved yet, and rerunning the '
           'same command starts the run again, once this user may read and '
           'write that path.')
  run = [f'--output_dir={tmp_path / "out"}', f'--data_dir={data_dir}',
         *_TINY_RUN]
  assert _main(run) == (f"Permission denied: [Errno 13] Permission denied: "
                        f"'{path}'{saved}")
  assert _main(run) == (f'Permission denied: {path}; Permission denied '
                        f'[Op:SaveV2]{saved}')
  with pytest.raises(ValueError, match=path):
    _main(run)
  # A client_states/ of another run (client_sampling_test: the store's
  # check) is said, not a traceback.
  foreign = client_store.ForeignStates('client_states holds a state of '
                                       'client 5, but the run has 2 clients')

  def build(*args, **kwargs):
    del args, kwargs
    raise foreign

  monkeypatch.setattr(catalog, 'build', build)
  assert _main(run) == (f'Cannot resume: {foreign} Start in a new '
                        '--output_dir; no client state was changed.')


def test_resume_with_the_other_precision_is_refused(tmp_path):
  """A directory that holds a bfloat16 run is not resumed as float32:
  refused before anything is read, naming the field."""
  out = tmp_path / 'out'
  out.mkdir()
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(['run_fedcg', '--matmul_precision=bfloat16',
                 f'--output_dir={out}'])
    stored = run_fedcg.run_definition(run_fedcg.config_from_flags())
  (out / 'run.json').write_text(json.dumps(stored))
  error = _main([f'--output_dir={out}', f'--data_dir={tmp_path / "absent"}'])
  assert error is not None and 'matmul_precision' in error, error
  assert json.loads((out / 'run.json').read_text()) == stored


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
