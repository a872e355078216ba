"""Table 1 and Figure 5 from run results, and the sweep binary end to end."""

import csv
import glob
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import tensorflow as tf
from PIL import Image

from binaries import common
from fedcg_tff.program import report
from tests import binary_runs
from tests import fake_data


def _results():
  r = report.RunResult
  return [
      r('fmnist', 'local', 1, (0.70, 0.80)),
      r('fmnist', 'local', 2, (0.60, 0.70)),
      r('fmnist', 'fedcg', 1, (0.80, 0.84)),
      r('fmnist', 'fedcg', 2, (0.72, 0.76)),
      r('fmnist', 'fedavg', 1, (0.75, 0.75)),
      r('cifar10', 'fedcg', 1, (0.40, 0.50)),
  ]


def test_table_is_mean_and_std_over_seeds_of_client_means():
  rows = report.table(_results(), algorithms=['local', 'fedavg', 'fedcg'],
                      tasks=['fmnist', 'cifar10'])
  assert [r['algorithm'] for r in rows] == ['local', 'fedavg', 'fedcg']
  mean, std, n = rows[0]['cells']['fmnist']  # Local: seed means 75 and 65.
  assert (mean, std, n) == (pytest.approx(70.0), pytest.approx(5.0), 2)
  mean, std, n = rows[2]['cells']['fmnist']  # FedCG: 82 and 74.
  assert (mean, std, n) == (pytest.approx(78.0), pytest.approx(4.0), 2)
  assert rows[1]['cells']['fmnist'][1] == 0.0  # One seed: no spread.
  assert 'cifar10' not in rows[0]['cells']
  md = report.markdown(rows)
  assert '| algorithm | fmnist | cifar10 |' in md
  assert '| local | 70.00 ± 5.00 (2) | — |' in md
  assert '| fedcg | 78.00 ± 4.00 (2) | 45.00 ± 0.00 (1) |' in md
  table = list(csv.reader(io.StringIO(report.csv_text(rows))))
  assert table[0][:4] == ['algorithm', 'fmnist_mean', 'fmnist_std',
                          'fmnist_seeds']
  assert table[3][:4] == ['fedcg', '78.0000', '4.0000', '2']


def test_paper_comparison_gives_difference_rounds_and_round_time():
  r = report.RunResult
  results = [r('fmnist', 'local', 1, (0.80, 0.82), (), 41, True, 88.4),
             r('fmnist', 'local', 2, (0.78, 0.80), (), 60, False, 90.0),
             r('fmnist', 'fedcg', 1, (0.84, 0.84), (), 60, False, 132.4,
               True, 'AMD EPYC (family 26, AVX-512)'),
             r('cifar10', 'fedcg', 1, (0.40, 0.50))]
  rows = report.table(results, ['local', 'fedcg'], ['fmnist', 'cifar10'])
  md = report.paper_markdown(rows, results, 'fmnist')
  # Local: seed means 81 and 79 (Bessel's std: sqrt(2)); the paper's
  # 79.66 ± 0.55, 0.34 / 0.55 = 0.6 of its std.
  assert ('| local | 80.00 ± 1.00 (2; Bessel 1.41) | 79.66 ± 0.55 | +0.34 '
          '| +0.6 | — | seed 1: 81.00, 41 (early stop), 88 s; seed 2: '
          '79.00, 60, 90 s |') in md, md
  # FedCG's gain over Local's seed 1, per client 84 - 80 and 84 - 82; the
  # paper's 83.81 - 79.66.
  assert ('| fedcg | 84.00 ± 0.00 (1) | 83.81 ± 0.28 | +0.19 | +0.7 | '
          '3.00 / 4.15 | seed 1: 84.00, 60, 132 s on AMD EPYC (family 26, '
          'AVX-512) |') in md, md
  assert report.paper_markdown(rows, results, 'cifar10') == ''


def test_load_result_reads_rounds_and_the_median_round_time(tmp_path):
  (tmp_path / 'results.json').write_text(json.dumps({
      'test_accuracy_at_best_val': [0.5, 0.7], 'rounds_run': 3,
      'stopped_early': False, 'total_round_seconds': 3022.0}))
  # Round 2 ran while the run was paused: the median ignores it.
  (tmp_path / 'metrics.csv').write_text(
      'round,round_seconds\n1,10.0\n2,3000.0\n3,12.0\n')
  load = lambda: report.load_result(str(tmp_path / 'results.json'),
                                    'fmnist', 'local', 1)
  result = load()
  assert result.rounds_run == 3 and result.stopped_early is False
  assert result.median_round_seconds == 12.0
  assert result.mean == pytest.approx(0.6)
  assert result.paper_protocol is None  # No run.json.
  assert result.host is None  # Written before results.json recorded it.
  paper = {'config': dict(report.PAPER_PROTOCOL['config'], seed=1),
           'run': dict(report.PAPER_PROTOCOL['run'], num_clients=None)}
  (tmp_path / 'run.json').write_text(json.dumps(paper))
  assert load().paper_protocol is True
  for part, key, value in (('config', 'gan_epochs', 1),
                           ('config', 'weight_decay', 0.0),
                           ('config', 'distance', 'cos'),
                           ('run', 'patience', 3),
                           ('run', 'train_per_client', 500),
                           ('run', 'num_clients', 8),
                           ('config', 'model', 'resnet18'),
                           ('config', 'client_init', 'private'),
                           ('run', 'dp_sigma', 0.1),
                           ('run', 'clients_per_round', 2),
                           ('config', 'matmul_precision', 'bfloat16')):
    changed = json.loads(json.dumps(paper))
    changed[part][key] = value
    (tmp_path / 'run.json').write_text(json.dumps(changed))
    assert load().paper_protocol is False, key
  paper['run']['train_per_client'] = 2000
  (tmp_path / 'run.json').write_text(json.dumps(paper))
  assert load().paper_protocol is True
  for key, value in (('aggregation', 'secure'), ('dp_sigma', 0.0)):
    # Present at all: a run unlike the paper's, whatever its value.
    (tmp_path / 'run.json').write_text(
        json.dumps({**paper, 'run': dict(paper['run'], **{key: value})}))
    assert load().paper_protocol is False, key
  results = json.loads((tmp_path / 'results.json').read_text())
  (tmp_path / 'results.json').write_text(json.dumps(dict(results, host='h')))
  assert load().host == 'h'


def test_paper_protocol_is_the_spec_and_holds_for_the_committed_runs():
  """The marker's figures are the spec's (the test above builds its run.json
  from the marker, so a wrong figure there would pass it), and every run
  committed under results/fmnist_paper_protocol/ carries the marker."""
  spec = {'batch_size': 8, 'lr': 3e-4, 'weight_decay': 1e-4,
          'noise_dim': 100, 'local_epochs': 20, 'gan_epochs': 20,
          'server_epochs': 20, 'server_steps_per_epoch': 100,
          'distance': 'mse', 'model': 'lenet', 'client_init': 'shared'}
  config = report.PAPER_PROTOCOL['config']
  assert {k: config.get(k) for k in spec} == spec
  assert report.PAPER_PROTOCOL['run'] == {'partition': 'iid',
                                          'add_noise': False, 'patience': 20}
  assert report.PAPER_PROTOCOL_EITHER['train_per_client'] == (None, 2000)
  found = sorted(glob.glob(os.path.join(
      common.ROOT, 'results', 'fmnist_paper_protocol', '*', 'seed_*',
      'results.json')))
  assert len(found) >= 21, found  # Seeds 1-3 of all seven algorithms.
  for path in found:
    seed_dir = os.path.dirname(path)
    algorithm = os.path.basename(os.path.dirname(seed_dir))
    seed = int(os.path.basename(seed_dir).split('_')[1])
    result = report.load_result(path, 'fmnist', algorithm, seed)
    assert result.paper_protocol is True, path


def test_gains_over_local_and_chart(tmp_path):
  gains = report.gains_over_local(_results(), 'fmnist')
  assert sorted(gains) == ['fedavg', 'fedcg']
  np.testing.assert_allclose(gains['fedcg'], [11.0, 5.0])  # (10+12)/2, (4+6)/2
  np.testing.assert_allclose(gains['fedavg'], [5.0, -5.0])  # Seed 1 only.
  path = tmp_path / 'gain.png'
  pixels, bars = report.gain_chart(gains, ('a', 'b'), 'fmnist', str(path))
  assert bars == 2 * 2  # One bar per client per algorithm.
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  with Image.open(path) as image:
    assert image.format == 'PNG' and image.size[0] > 100
  assert pixels.ndim == 3 and pixels.shape[2] == 3 and pixels.dtype == np.uint8


def test_reconstruction_grid_shows_its_first_rows_within_matplotlib_limit(
    tmp_path, monkeypatch):
  """One row per attacked image, up to GRID_MAX_ROWS (at 504 rows the
  figure would pass matplotlib's 2^16 px, after the attack's tables were
  written); the binaries say how many the grid shows."""
  rng = np.random.default_rng(0)

  def grid(count, name):
    truth = rng.uniform(size=(count, 8, 8, 1)).astype(np.float32)
    pixels = report.reconstruction_grid(
        truth, {'fedcg': truth}, {'fedcg': [20.0] * count},
        str(tmp_path / name))
    with Image.open(tmp_path / name) as image:
      assert image.size == pixels.shape[1::-1]
    return pixels.shape[0]

  assert (report.grid_rows(3), report.grid_note(3)) == (3, '')
  two, three = grid(2, 'two.png'), grid(3, 'three.png')
  assert three - two == 130  # 1.3 in at 100 dpi a row.
  # Each tile where its row and column put it: a black true image, a red
  # (RGB) reconstruction; the PNG holds the pixels returned (TensorBoard's).
  black = np.zeros((2, 8, 8, 3), np.float32)
  red = black.copy()
  red[..., 0] = 1.0
  pixels = report.reconstruction_grid(black, {'fedcg': red},
                                      {'fedcg': [9.0, 8.0]},
                                      str(tmp_path / 'tiles.png'))
  with Image.open(tmp_path / 'tiles.png') as image:
    np.testing.assert_array_equal(np.asarray(image.convert('RGB')), pixels)
  assert pixels.shape == (290, 250, 3)  # 2 x 1.3 + 0.3 in, 2 x 1.25 in.
  for row in (0, 1):
    y = 30 + 130 * row + 5 + 47  # A tile's middle: 0.95 in from 0.05 in.
    assert tuple(pixels[y, 62]) == (0, 0, 0)  # Column 'true'.
    assert tuple(pixels[y, 125 + 62]) == (255, 0, 0)  # Column 'fedcg'.
    assert tuple(pixels[y, 125]) == (255, 255, 255)  # Between the tiles.
  monkeypatch.setattr(report, 'GRID_MAX_ROWS', 2)
  assert grid(3, 'capped.png') == two
  assert report.grid_note(3) == (' (its first 2 of 3 images; TensorBoard '
                                 'has every one)')
  # The real cap stays below matplotlib's limit.
  monkeypatch.undo()
  assert 130 * report.GRID_MAX_ROWS + 30 < 2 ** 16
  assert report.grid_rows(600) == report.GRID_MAX_ROWS


def test_curves_come_from_metrics_csv_and_average_over_the_seeds_run(
    tmp_path):
  path = tmp_path / 'metrics.csv'
  path.write_text('round,mean/val_accuracy,mean/test_accuracy,other\n'
                  '2,0.6,0.5,x\n1,0.4,0.3,y\n')  # Any row order.
  curves = report.load_curves(str(path))
  np.testing.assert_allclose(curves['mean/val_accuracy'], [0.4, 0.6])
  np.testing.assert_allclose(curves['mean/test_accuracy'], [0.3, 0.5])
  # A run that stopped early leaves the mean of the later rounds to the
  # runs that reached them.
  longer = {'mean/val_accuracy': np.array([0.2, 0.4, 0.9]),
            'mean/test_accuracy': np.array([0.1, 0.3, 0.8])}
  mean = report.mean_curves([curves, longer])
  np.testing.assert_allclose(mean['mean/val_accuracy'], [0.3, 0.5, 0.9])
  np.testing.assert_allclose(mean['mean/test_accuracy'], [0.2, 0.4, 0.8])
  pixels = report.curve_chart({'fedcg': mean}, 'fmnist',
                              str(tmp_path / 'c.png'))
  assert pixels.ndim == 3 and (tmp_path / 'c.png').exists()
  # A round whose row was lost (a power loss that its checkpoint survived)
  # leaves a gap: later rounds stay at their round, and the mean there is
  # the other runs'.
  path.write_text('round,mean/val_accuracy,mean/test_accuracy\n'
                  '1,0.4,0.3\n3,0.7,0.6\n')
  gapped = report.load_curves(str(path))
  np.testing.assert_allclose(gapped['mean/val_accuracy'], [0.4, np.nan, 0.7])
  mean = report.mean_curves([gapped, longer])
  np.testing.assert_allclose(mean['mean/val_accuracy'], [0.3, 0.4, 0.8])
  report.curve_chart({'fedcg': report.mean_curves([gapped])}, 'fmnist',
                     str(tmp_path / 'gap.png'))


def _sweep(args, timeout=900, cwd=binary_runs.ROOT):
  return binary_runs.run_binary('run_experiments', args, timeout, cwd)


def test_sweep_runs_resumably_and_reports(tmp_path):
  data = tmp_path / 'idx'
  data.mkdir()
  fake_data.write_fake_fmnist(str(data), n_train=64, n_test=40)
  out = tmp_path / 'sweep'
  # Relative paths, from another working directory than the repository's.
  # One seed: the mean and std over seeds are tested on results above; the
  # runs, their directories and the reports are what this checks.
  run_flags = ('--run_flags=--data_dir=idx --num_clients=2 '
               '--train_per_client=16 --rounds=1 --local_epochs=1')
  # FedProx's mu, as two words, reaches FedProx's run alone (Local's would
  # refuse it).
  args = ['--output_dir=sweep', '--algorithms=local,fedprox',
          '--tasks=fmnist', '--seeds=3', run_flags + ' --prox_mu 0.02']
  proc = _sweep(args, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # After Local's run, FedProx's left (at Local's time: none of its own).
  assert re.search(r'\[1/2\] fmnist local seed 3: .*\nsweep: 1 run\(s\) left, '
                   r'about \d+m\d\ds at the times', proc.stdout, re.S), (
                       proc.stdout)
  assert 'sweep: 0 run' not in proc.stdout
  for algorithm, mu in (('local', 0.01), ('fedprox', 0.02)):
    run = out / 'fmnist' / algorithm / 'seed_3'
    assert (run / 'results.json').exists()
    assert json.loads((run / 'run.json').read_text())['config'][
        'prox_mu'] == mu
  md = (out / 'results.md').read_text()
  assert '| algorithm | fmnist |' in md and '(1) |' in md
  rows = list(csv.DictReader(io.StringIO((out / 'results.csv').read_text())))
  assert [r['algorithm'] for r in rows] == ['local', 'fedprox']
  result = json.loads(
      (out / 'fmnist' / 'fedprox' / 'seed_3' / 'results.json').read_text())
  assert float(rows[1]['fmnist_mean']) == pytest.approx(
      100 * np.mean(result['test_accuracy_at_best_val']), abs=1e-3)
  beside = (out / 'paper_fmnist.md').read_text()
  assert '| local | ' in beside and '| 79.66 ± 0.55 |' in beside
  # Each seed: its result, then its rounds run (1).
  assert re.search(r'seed 3: \d+\.\d\d, 1, ', beside), beside
  assert "(not the paper's protocol)" in beside
  assert (out / 'gain_fmnist.png').read_bytes()[:4] == b'\x89PNG'
  tags = [v.tag for path in glob.glob(f'{out}/tensorboard/events*')
          for e in tf.compat.v1.train.summary_iterator(path)
          for v in e.summary.value]
  assert 'gain_over_local/fmnist' in tags
  assert 'accuracy_curves/fmnist' in tags
  assert (out / 'curves_fmnist.png').read_bytes()[:4] == b'\x89PNG'
  # The reports again from the small files alone (what results/ commits):
  # no checkpoints, no TensorBoard logs of the runs, and in the layout
  # without the task level (results/fmnist_paper_protocol/<algorithm>/...).
  import shutil  # pylint: disable=g-import-not-at-top
  table = (out / 'results.md').read_text()
  for run in glob.glob(f'{out}/fmnist/*/seed_3'):
    for name in ('checkpoints', 'tensorboard'):
      shutil.rmtree(os.path.join(run, name))
  shutil.copytree(out / 'fmnist', tmp_path / 'flat')
  # A run without its metrics.csv: in the tables, not in the curves.
  shutil.copytree(out / 'fmnist', tmp_path / 'no_csv')
  os.remove(tmp_path / 'no_csv' / 'fedprox' / 'seed_3' / 'metrics.csv')
  # An earlier invocation's report of another task goes with the others:
  # results.md no longer shows its runs.
  (tmp_path / 'flat' / 'paper_cifar10.md').write_text('stale')
  # A report of whatever is there refuses to average a run made with other
  # flags (FedProx's seed 4, at another lr) with the others of its cell.
  shutil.copytree(out / 'fmnist', tmp_path / 'mixed')
  (tmp_path / 'mixed' / 'results.md').write_text('an earlier report')
  shutil.copytree(tmp_path / 'mixed' / 'fedprox' / 'seed_3',
                  tmp_path / 'mixed' / 'fedprox' / 'seed_4')
  other = tmp_path / 'mixed' / 'fedprox' / 'seed_4' / 'run.json'
  definition = json.loads(other.read_text())
  definition['config'].update(seed=4, lr=0.001)
  other.write_text(json.dumps(definition))
  # Nor does it put runs of other client counts in one table (Local's seed
  # 3 with a third client).
  shutil.copytree(out / 'fmnist', tmp_path / 'clients')
  (tmp_path / 'clients' / 'results.md').write_text('an earlier report')
  three = tmp_path / 'clients' / 'local' / 'seed_3' / 'results.json'
  result = json.loads(three.read_text())
  result['test_accuracy_at_best_val'].append(0.5)
  three.write_text(json.dumps(result))
  # Then rerunning skips finished runs, and other run flags are refused
  # rather than mixed into the table.
  # These six calls share one interpreter (one import of TensorFlow).
  one_run = ['--output_dir=sweep', '--algorithms=local', '--tasks=fmnist',
             '--seeds=3']
  stops, done = binary_runs.main_calls('run_experiments', [
      ['--output_dir=flat', *args[1:-1], '--report_only', '--notask_dirs'],
      ['--output_dir=no_csv', *args[1:-1], '--report_only', '--notask_dirs'],
      args,
      [*one_run, run_flags + ' --lr=0.001'],
      ['--output_dir=mixed', '--algorithms=local,fedprox', '--tasks=fmnist',
       '--seeds=3,4', '--report_only', '--notask_dirs'],
      ['--output_dir=clients', '--algorithms=local,fedprox', '--tasks=fmnist',
       '--seeds=3', '--report_only', '--notask_dirs'],
  ], timeout=300, cwd=tmp_path)
  assert len(stops) == 6, done.stderr[-3000:]
  assert stops[5] == (
      'fmnist: its runs have different numbers of clients (2 clients: '
      'fedprox seed 3; 3 clients: local seed 3), which one table and the '
      'gains per client would mix (choose --algorithms and --seeds, or move '
      'those runs); no report was changed'), stops[5]
  assert (tmp_path / 'clients' / 'results.md').read_text() == (
      'an earlier report')
  assert not (tmp_path / 'flat' / 'paper_cifar10.md').exists()
  refused = stops[4] or ''
  assert ('fmnist fedprox: its runs were made with other flags' in refused
          and '--lr: stored 0.0003, given 0.001' in refused), stops[4]
  assert (tmp_path / 'mixed' / 'results.md').read_text() == (
      'an earlier report')  # Refused before any report is touched.
  remade, no_csv, again, changed = done.stdout.split('MAIN_CALL ')[:4]
  # Finished runs passed over give the sweep no time to go by.
  assert 'run(s) left' not in again and '[2/2]' in again, again
  assert stops[:3] == [None, None, None], (stops, done.stderr[-3000:])
  assert (tmp_path / 'flat' / 'results.md').read_text() == table
  assert (tmp_path / 'flat' / 'paper_fmnist.md').read_text() == beside
  assert (tmp_path / 'flat' / 'curves_fmnist.png').exists()
  assert 'seed_3/metrics.csv is missing: that run is in the tables' in no_csv
  assert (tmp_path / 'no_csv' / 'results.md').read_text() == table
  assert (tmp_path / 'no_csv' / 'curves_fmnist.png').exists()
  assert 'already holds' not in remade  # Nothing ran.
  assert again.count('already holds this finished run') == 2, again
  assert stops[3] and '1 run(s) failed' in stops[3], stops
  assert '--lr: stored 0.0003, given 0.001' in done.stderr
  assert 'already holds' not in changed
  # Its earlier result stays out of this sweep's tables.
  assert 'left out of the report: [1/1] fmnist local seed 3' in changed
  # With no run finished, the reports of the sweep before are left as they
  # were, not removed.
  assert 'no finished run to report: the reports already in' in changed
  assert (tmp_path / 'sweep' / 'results.md').read_text() == md
  assert (tmp_path / 'sweep' / 'tensorboard').exists()


@pytest.mark.parametrize('how', ['sigterm_to_the_sweep', 'ctrl_c',
                                 'ctrl_c_from_a_terminal'])
def test_terminated_sweep_ends_its_run(tmp_path, how):
  """SIGTERM to the sweep alone (`kill <its pid>`) ends its run too, which
  would otherwise go on as an orphan that a rerun of the sweep meets in the
  run's directory; Ctrl-C (SIGINT to both) lets the run end by itself. A
  terminal's Ctrl-C reaches the whole foreground process group at once:
  the sweep, the run and the run's TFF worker."""
  data = tmp_path / 'idx'
  data.mkdir()
  fake_data.write_fake_fmnist(str(data), n_train=64, n_test=40)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3',
             FEDCG_TEST_HOLD_ROUND='2')  # The run waits before round 2.
  sweep = subprocess.Popen(
      [sys.executable, '-m', 'binaries.run_experiments',
       f'--output_dir={tmp_path / "sweep"}', '--algorithms=local',
       '--tasks=fmnist', '--seeds=1',
       f'--run_flags=--data_dir={data} --num_clients=2 '
       '--train_per_client=16 --rounds=2'],
      cwd=binary_runs.ROOT, env=env, stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True, start_new_session=True,
      # SIGINT at its default, as from a terminal, whatever this test
      # process ignores (Python then turns it into KeyboardInterrupt).
      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  tree = []
  try:
    run_dir = tmp_path / 'sweep' / 'fmnist' / 'local' / 'seed_1'
    lock = run_dir / '.lock'
    deadline = time.time() + 300
    # Round 1 saved: the run waits in its hold, where a signal is handled
    # at once (not in the middle of building its computations).
    while not (run_dir / 'checkpoints' / 'round_1').exists():
      assert sweep.poll() is None, sweep.stderr.read()[-3000:]
      assert time.time() < deadline
      time.sleep(0.1)
    run = psutil.Process(int(lock.read_text()))
    tree = [run, *run.children(recursive=True)]
    if how == 'ctrl_c':
      # The sweep's SIGINT first: it waits for the run, which a terminal's
      # Ctrl-C reaches too (here a moment later) and which then ends by
      # itself, the sweep with it.
      sweep.send_signal(signal.SIGINT)
      time.sleep(2)
      assert run.is_running() and sweep.poll() is None
      run.send_signal(signal.SIGINT)
      _, err = sweep.communicate(timeout=common.CHILD_STOP_SECONDS + 60)
      assert sweep.returncode != 0
    elif how == 'ctrl_c_from_a_terminal':
      assert {p.pid for p in tree if p.cmdline()[:1] != [sys.executable]}, (
          'the run has no worker process to reach', tree)
      assert all(os.getpgid(p.pid) == sweep.pid for p in tree)
      os.killpg(sweep.pid, signal.SIGINT)  # The sweep's own group.
      _, err = sweep.communicate(timeout=common.CHILD_STOP_SECONDS + 60)
      assert sweep.returncode != 0
      # The round saved before the signal is still there to resume from.
      assert (run_dir / 'checkpoints' / 'round_1').exists()
    else:
      sweep.send_signal(signal.SIGTERM)
      _, err = sweep.communicate(timeout=common.CHILD_STOP_SECONDS + 60)
      assert sweep.returncode == 128 + signal.SIGTERM
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, alive
    # After Ctrl-C the run stopped by itself; SIGTERM to the sweep stops it.
    stopped = 'stopping the run (pid' in err
    assert stopped == (how == 'sigterm_to_the_sweep'), how
  finally:
    binary_runs.kill_tree(sweep)
    for process in tree:  # An orphaned run, if the sweep left one.
      try:
        process.kill()
      except psutil.NoSuchProcess:
        pass


def test_sweep_time_left_goes_by_each_algorithms_runs():
  ran = {('fmnist', 'fedcg'): [100.0, 300.0, 200.0],
         ('fmnist', 'local'): [10.0]}
  left = [('fmnist', 'fedcg', 4), ('fmnist', 'fedavg', 1),
          ('fmnist', 'local', 2)]
  # FedCG at its median (200), FedAvg, not yet run, at all runs' (150),
  # Local at its own (10).
  assert common.sweep_time_left(ran, left) == 200.0 + 150.0 + 10.0


def test_run_flags_reach_only_the_runs_that_use_them():
  tokens = ['--rounds=1', '--prox_mu', '0.5', '--train_per_client=5',
            '--diversity_weight=2']
  assert common.run_flags_for('fedprox', 'fmnist', tokens) == [
      '--rounds=1', '--prox_mu', '0.5', '--train_per_client=5']
  assert common.run_flags_for('fedgen', 'office_caltech10', tokens) == [
      '--rounds=1', '--diversity_weight=2']
  assert common.run_flags_for('fedcg', 'digit5', tokens) == [
      '--rounds=1', '--train_per_client=5']


def test_sweep_rejects_bad_flags(tmp_path):
  cases = (('--algorithms=fedsgd', '--algorithms'),
           ('--seeds=1,x', '--seeds must be integers'),
           ('--seeds=1,1', '--seeds must be distinct integers'),
           ('--algorithms=local,local', '--algorithms must be distinct'),
           ('--run_flags=--rouns=5', "fmnist local seed 1: Unknown command "
            "line flag 'rouns'"),
           ('--algorithms=local --run_flags=--lr=-1',
            'fmnist local seed 1: --lr must be finite and > 0'),
           ('--algorithms=local,fedavg --run_flags=--prox_mu=0.1',
            'sets --prox_mu, which only --algorithm=fedprox uses, and no run '
            'is one of them'),
           ('--tasks=office_caltech10 --run_flags=--train_per_client=5',
            'sets --train_per_client, which only --task=fmnist|'),
           # FedDF (among the default algorithms) on a task without server
           # data: the sweep stops before its first run.
           ('--tasks=office_caltech10', 'office_caltech10 feddf seed 1: '
            '--algorithm=feddf needs unlabeled server data, which '
            '--task=office_caltech10 does not provide'),
           # A value given, as a word of its own, to a flag that takes none.
           ("--algorithms=local --run_flags='--add_noise 1 --noise_std=0.1'",
            "fmnist local seed 1: Unexpected arguments: ['1']"),
           ('--run_flags=--seed=3', 'must not set --seed'),
           ('--tasks=fmnist,cifar10 --notask_dirs',
            '--notask_dirs needs one task'),
           ('--report_only --algorithms=local --seeds=1',
            'none of the runs asked for has a results.json'),
           ("--run_flags=--data_dir=/o\\'brien",
            "--run_flags=--data_dir=/o'brien: No closing quotation"),
           (f'--output_dir={tmp_path}/notes/sweep',
            f'--output_dir={tmp_path}/notes/sweep: {tmp_path}/notes is a '
            'file, not a directory'))
  (tmp_path / 'notes').write_text('kept')
  # One interpreter for them all.
  stops, done = binary_runs.main_calls(
      'run_experiments',
      [[f'--output_dir={tmp_path}', *shlex.split(flag)] for flag, _ in cases],
      timeout=120)
  assert len(stops) == len(cases), done.stderr[-3000:]
  for (flag, message), stopped in zip(cases, stops):
    assert stopped is not None and message in stopped, (flag, stopped)
  assert os.listdir(tmp_path) == ['notes']
  assert (tmp_path / 'notes').read_text() == 'kept'


def test_committed_bfloat16_run_is_the_protocol_but_for_its_precision(
    tmp_path):
  """The committed bfloat16 run (results/fmnist_paper_protocol_bfloat16/,
  the opt-in's accuracy measurement) is not counted as the paper's
  protocol, and its run.json is float32 seed 1's but for the precision:
  the comparison the README draws is like with like."""
  def definition(directory):
    with open(os.path.join(common.ROOT, 'results', directory, 'fedcg',
                           'seed_1', 'run.json')) as f:
      return json.load(f)
  bfloat16 = definition('fmnist_paper_protocol_bfloat16')
  result = report.load_result(
      os.path.join(common.ROOT, 'results', 'fmnist_paper_protocol_bfloat16',
                   'fedcg', 'seed_1', 'results.json'), 'fmnist', 'fedcg', 1)
  assert result.paper_protocol is False
  assert bfloat16['config'].pop('matmul_precision') == 'bfloat16'
  assert bfloat16 == definition('fmnist_paper_protocol')
  (tmp_path / 'run.json').write_text(json.dumps(bfloat16))
  (tmp_path / 'results.json').write_text(json.dumps(
      {'test_accuracy_at_best_val': list(result.test_at_best)}))
  assert report.load_result(str(tmp_path / 'results.json'), 'fmnist',
                            'fedcg', 1).paper_protocol is True


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
