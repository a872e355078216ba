"""binaries/benchmark.py: its flag checks, and that the phases it reports
from the driver's timing hook add up (the README's speed tables come
from it)."""

import json
import os
import subprocess
import sys

import pytest

from fedcg_tff.execution import devices
from tests import binary_runs
from tests import fake_data


def test_benchmark_times_the_timed_rounds_phase_by_phase(tmp_path):
  data = tmp_path / 'fmnist'
  data.mkdir()
  fake_data.write_fake_fmnist(str(data), n_train=64, n_test=40)
  out = tmp_path / 'bench.json'
  tiny = [f'--data_dir={data}', '--clients=2', '--train_per_client=16',
          '--server_steps=2']
  stops, done = binary_runs.main_calls('benchmark', [
      [*tiny, '--clients=0'],
      [*tiny, '--seed=-1'],
      [*tiny, f'--json={tmp_path / "absent" / "bench.json"}'],
      # 5 x 16 images, from 64: the task's error names the benchmark's flag.
      [*tiny, '--num_clients=5'],
      [*tiny, '--warmup_rounds=1', '--rounds=2', f'--json={out}'],
  ])
  assert len(stops) == 5, done.stderr[-3000:]
  assert 'clients' in stops[0] and '>= 1' in stops[0]
  assert '--seed must be in [0, 2147483647], got -1' in stops[1], stops[1]
  assert stops[2] and 'not a file in an existing directory' in stops[2]
  assert 'lower --num_clients or --train_per_client' in stops[3], stops[3]
  assert stops[4] is None, done.stderr[-3000:]
  # The refused ones stopped before any round: one run's output alone.
  assert done.stdout.count('peak RSS') == 1

  result = json.loads(out.read_text())
  assert result['host'] == devices.host_cpu()
  # small_conv.host_tuned_choices: both AVX2 kernel tricks, or neither.
  avx2_tricks = not devices.runs_avx512_kernels()
  assert result['kernel_choices'] == {'oriented_products': avx2_tricks,
                                      'banded_convs': avx2_tricks}
  # The code timed: this checkout's commit (None outside a git checkout).
  head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=binary_runs.ROOT,
                        capture_output=True, text=True)
  if head.returncode == 0:
    assert result['commit'].split('-')[0] == head.stdout.strip()
  else:
    assert result['commit'] is None
  # The warm-up round (round 0) traces and compiles: it is not averaged.
  assert [row['round'] for row in result['rounds']] == [1, 2]
  mean = result['mean_seconds']
  for row in result['rounds']:
    # Stamps from inside the workers and the server's update: every phase
    # ran, and each part lies inside the step that contains it.
    for phase in ('client_stage1_s', 'client_stage2_s', 'client_teacher_s',
                  'clients_in_workers_s', 'distillation_s', 'evaluation_s'):
      assert row[phase] > 0, phase
    assert row['tff_overhead_s'] >= 0 and row['aggregation_s'] >= 0
    assert row['round_s'] >= (row['clients_in_workers_s']
                              + row['distillation_s'])
  for key, value in mean.items():
    expected = sum(r[key] for r in result['rounds']) / 2
    assert abs(value - expected) < 1e-9, key
  # The peak is the devices module's (the clock in /proc/cpuinfo may move
  # between two reads: compare the cores and the FLOPs per cycle).
  _, how = devices.peak_float32_flops()
  cores_and_width = lambda text: (text.split(' x ')[0], text.split(' x ')[-1])
  assert (cores_and_width(result['peak_flops_derivation'])
          == cores_and_width(how))
  assert result['peak_flops_per_s'] > 0
  # Beside it, the cores times one thread's product, timed in a child.
  assert result['product_flops_per_s_per_core'] > 0
  assert result['product_flops_per_s'] == (
      devices.core_count() * result['product_flops_per_s_per_core'])
  size = devices.PRODUCT_SIZE
  assert result['product_flops_derivation'].startswith(
      f'one thread, float32 [{size}, {size}] @')
  assert (f'% of the cores\' measured product rate '
          f'{result["product_flops_per_s"] / 1e9:.1f} GFLOP/s '
          f'({devices.core_count()} x one thread') in done.stdout
  assert (result['achieved_training_flops_per_s']
          == result['training_flops_per_round'] / mean['clients_in_workers_s'])
  # What that rate counts: both clients' 16 images through the round's
  # epochs, at the networks' own per-layer counts.
  from fedcg_tff.config import FedCGConfig  # pylint: disable=g-import-not-at-top
  from fedcg_tff.execution import flops  # pylint: disable=g-import-not-at-top
  ran = result['flags']
  assert (ran['clients'], ran['train_per_client']) == (2, 16)
  config = FedCGConfig(local_epochs=ran['local_epochs'],
                       gan_epochs=ran['gan_epochs'])
  forward = flops.forward_flops(config)
  assert result['forward_flops_per_example'] == forward
  assert result['training_flops_per_round'] == 2 * sum(
      flops.training_flops(config, forward, 16))
  assert result['peak_rss_bytes']['driver'] > 0
  assert 'full-protocol round' not in done.stdout  # Only with --full_protocol.
  assert 'GFLOP/s' in done.stdout and '% of peak' in done.stdout


def test_full_protocol_warms_up_only_when_asked():
  """--full_protocol sets the paper's epochs and steps and one timed round,
  whatever those flags say; it times a cold round (no warm-up) unless
  --warmup_rounds is given, and a warm one then. In a fresh interpreter:
  the benchmark's flags are not defined in the test's process."""
  code = (
      'import json, sys\n'
      'from absl import flags\n'
      'from binaries import benchmark\n'
      'for args in json.loads(sys.argv[1]):\n'
      '  flags.FLAGS.unparse_flags()\n'
      '  flags.FLAGS(["benchmark", *args])\n'
      '  benchmark.apply_full_protocol()\n'
      '  f = flags.FLAGS\n'
      '  print(json.dumps([f.local_epochs, f.gan_epochs, f.server_steps, '
      'f.rounds, f.warmup_rounds]))\n')
  cases = [['--full_protocol'],
           ['--full_protocol', '--warmup_rounds=1'],
           ['--full_protocol', '--rounds=3', '--local_epochs=2',
            '--warmup_rounds=2'],
           ['--rounds=3']]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3',
             PYTHONPATH=binary_runs.ROOT)
  done = subprocess.run([sys.executable, '-c', code, json.dumps(cases)],
                        cwd=binary_runs.ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert [json.loads(line) for line in done.stdout.splitlines()] == [
      [20, 20, 2000, 1, 0], [20, 20, 2000, 1, 1], [20, 20, 2000, 1, 2],
      [1, 1, 100, 3, 1]]


def test_phases_from_stamps_by_hand():
  """How a round's stamps become its phases: each client's stage 1, stage 2
  and teacher intervals summed over the clients; the clients' wall time
  from the first start to the last end; the rest of each step."""
  from fedcg_tff.execution import round_runner  # pylint: disable=g-import-not-at-top
  timing = round_runner.RoundTiming(
      clients_step_s=7.0, server_step_s=4.0,
      client_stamps=[[10.0, 11.0, 13.0, 16.0], [10.5, 11.0, 12.0, 12.5]],
      server_stamps=(20.0, 23.0))
  assert timing.phase_seconds() == {
      'client_stage1_s': 1.0 + 0.5, 'client_stage2_s': 2.0 + 1.0,
      'client_teacher_s': 3.0 + 0.5, 'clients_in_workers_s': 6.0,
      'tff_overhead_s': 1.0, 'aggregation_s': 1.0, 'distillation_s': 3.0,
      'round_s': 11.0}


def test_forward_flops_by_hand():
  """The GFLOP/s and % of peak the README reports rest on these counts:
  LeNet's worked out by hand (2 FLOPs per multiply-add over each layer's
  output positions), and a transposed convolution over its input
  positions."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from fedcg_tff.config import FedCGConfig  # pylint: disable=g-import-not-at-top
  from fedcg_tff.execution import flops as counts  # pylint: disable=g-import-not-at-top
  flops = counts.forward_flops(FedCGConfig(model='lenet'))
  # conv 5x5x1->6 at 28x28, conv 5x5x6->16 at 10x10; dense 400-120-84-10.
  assert flops['extractor'] == 2 * (28 * 28 * 150 + 10 * 10 * 2400)
  assert flops['classifier'] == 2 * (400 * 120 + 120 * 84 + 84 * 10)
  # G: [z, embedded y] (110 channels) at 1x1, then 2x2 transposed convs over
  # 1, 4, 9 and 16 input positions. D: [features, tiled embedding] (26
  # channels) at 5x5, then 2x2 convs to 4x4, 3x3, 2x2 and 1x1 outputs. Both
  # dominate stage 2.
  assert flops['generator'] == 2 * (1 * 4 * 110 * 512 + 4 * 4 * 512 * 256
                                    + 9 * 4 * 256 * 128 + 16 * 4 * 128 * 16)
  assert flops['discriminator'] == 2 * (16 * 4 * 26 * 128 + 9 * 4 * 128 * 256
                                        + 4 * 4 * 256 * 512 + 4 * 512)
  # Stage 1: E and C trained (3x forward), G forward; stage 2: E forward, D
  # on real and fake trained (6x), G trained (3x), D again with its input
  # gradient (2x). Distinct counts, so a term read from the wrong network
  # shows.
  config = FedCGConfig(local_epochs=3, gan_epochs=5)
  made_up = {'extractor': 1.0, 'classifier': 10.0, 'generator': 100.0,
             'discriminator': 1000.0}
  assert counts.training_flops(config, made_up, 7) == (
      3 * 7 * (3 * 11.0 + 100.0), 5 * 7 * (1.0 + 8 * 1000.0 + 3 * 100.0))
  with tf.Graph().as_default():
    up = tf.keras.Sequential([tf.keras.Input([2, 2, 5]),
                              tf.keras.layers.Conv2DTranspose(4, 3)])
    # 4 input positions x (3 x 3 x 5 x 4) weights, not 16 output positions.
    assert counts.layer_flops(up) == 2 * 4 * 180


def test_contention_benchmark_names_the_flag_of_a_bad_workload():
  from benchmarks import contention_benchmark  # pylint: disable=g-import-not-at-top
  check = contention_benchmark.check_workloads
  assert check(['compute', 'adam_6', 'gan'])
  assert contention_benchmark.adam_megabytes('adam_25') == 25
  with pytest.raises(contention_benchmark.flags.ValidationError,
                     match='--workload: .*adam_x'):
    check(['adam_x'], 'workload')
  with pytest.raises(contention_benchmark.flags.ValidationError,
                     match='--workloads: name at least one'):
    check([])
  for bad in ('adam_x', 'adam_0', 'adam_', 'gans', 'adam6', 'adam_\u00b2'):
    try:
      check(['compute', bad])
    except contention_benchmark.flags.ValidationError as e:
      assert '--workloads' in str(e) and repr(bad) in str(e), (bad, e)
    else:
      raise AssertionError(f'{bad!r} accepted')
