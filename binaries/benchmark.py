r"""Times FedCG rounds on real Fashion-MNIST, phase by phase.

  .venv/bin/python -m binaries.benchmark                  # 4 clients, 1 worker
  .venv/bin/python -m binaries.benchmark --num_clients=16 --workers=2 \
      --json=bench.json

Rounds run through the driver every binary uses (`program.driver`, with
`execution.round_runner`): the process's clients' step (on `--workers`
local TFF workers, or on `--worker_addresses`), then its server's step; that
is what `next` runs. The driver's timing hook reports each step's wall time,
and the process is built timed: the clients' phases are stamped inside the
workers (`fedcg_tf.client_update(timed=True)`: between stage 1, stage 2 and
the teacher logits) and the distillation inside the server's update
(`fedcg_tf.server_update(timed=True)`):

  client stage 1 / stage 2 / teacher  in-worker, summed over clients
  clients in the workers              first client start -> last client end
  TFF overhead                        clients' step wall time minus the above:
                                      serialising states and datasets,
                                      dispatch, each client's first pass
                                      over its data (counting and caching
                                      its images), results back
  aggregation                         server's step minus the distillation
  distillation                        stamped inside the server's update
  evaluation                          every client's validation + test pass

The first round traces and compiles and is not counted (`--warmup_rounds`);
`--full_protocol` times the paper's round cold, its first round, unless
`--warmup_rounds` is given (about 4 s more cold on the Intel model 167
host; a run's later rounds are warm). FLOP/s: forward
FLOPs per example of each network's convolutions and dense layers
(`execution.flops`), a trained network counted as 3x its forward pass
(forward, gradient of the input, gradient of the weights) -- an estimate of
the useful arithmetic; the machine's peak is cores x clock x FLOPs per
cycle (AVX-512: two FMA units x 16 float32 lanes x 2 = 64; AVX2, and AMD
Zen 4's AVX-512 on 256-bit pipes: 32; AMD Zen 1's AVX2: 16), read from
/proc/cpuinfo. That clock can be a virtual machine's nominal one, below
what the cores run at, so the round is also set against a measured rate:
the cores times one thread's large float32 product in TensorFlow
(`devices.product_flops_per_core`).
"""

import json
import os
import subprocess
import sys
import time

import numpy as np

from absl import app
from absl import flags
from absl import logging

from binaries import common
from fedcg_tff.execution import devices
from fedcg_tff.execution import flops
from fedcg_tff.execution import runtime
from fedcg_tff.models import small_conv

flags.DEFINE_integer('num_clients', 4, 'Number of FMNIST clients (as '
                     "run_fedcg's flag, whose name the task's errors use).")
flags.DEFINE_alias('clients', 'num_clients')
flags.DEFINE_integer('train_per_client', 2000, 'Training images per client.')
flags.DEFINE_integer('batch_size', 8, 'Batch size.')
flags.DEFINE_integer('local_epochs', 1, 'Stage-1 epochs per round.')
flags.DEFINE_integer('gan_epochs', 1, 'Stage-2 epochs per round.')
flags.DEFINE_integer('server_steps', 100, 'Distillation steps per round.')
flags.DEFINE_integer('rounds', 2, 'Timed rounds (after the warm-up rounds).')
flags.DEFINE_integer('warmup_rounds', 1,
                     'Untimed rounds first (the first round of a process '
                     'also runs TFF\'s and TF\'s one-time graph work).')
flags.DEFINE_bool('full_protocol', False,
                  'The paper\'s round: 20 + 20 epochs and 20 x 100 '
                  'distillation steps, one round timed, with no warm-up '
                  'unless --warmup_rounds is given (a warm-up round costs a '
                  'full round; without it the first round\'s one-time work, '
                  'about 4 s, shows in the TFF overhead, aggregation and '
                  'evaluation). Overrides the epoch, step and round flags.')
common.define_worker_flags()
common.define_precision_flag()
flags.DEFINE_string('data_dir', None, 'FMNIST IDX directory (default: '
                    'Debian\'s /usr/share/datasets/fashion-mnist).')
flags.DEFINE_integer('seed', 1, 'Seed of the data split and the networks.')
flags.DEFINE_string('json', None, 'Also write the figures to this file.')
flags.DEFINE_bool('time_product', True,
                  'Also time one thread\'s large float32 product (a child '
                  'process, ~10 s) and print the round\'s share of the cores '
                  'at that rate: /proc/cpuinfo\'s clock, which the peak '
                  'rests on, can be a virtual machine\'s nominal one.')
FLAGS = flags.FLAGS
GOAL_SECONDS = 150  # Issue 17: a full-protocol round on 2 cores.


def code_commit() -> str | None:
  """The commit of the code being timed (its full hash, '-dirty' if the
  tree has changes), or None outside a git checkout: JSON files outlive
  the tree."""
  try:
    return subprocess.run(
        ['git', 'describe', '--always', '--dirty', '--abbrev=40',
         '--exclude=*'], cwd=common.ROOT,
        capture_output=True, text=True, check=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None


def peak_rss_bytes(pid: int) -> int:
  """VmHWM: the peak resident set of a live process."""
  try:
    with open(f'/proc/{pid}/status') as f:
      for line in f:
        if line.startswith('VmHWM:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def apply_full_protocol() -> None:
  """--full_protocol's settings: the paper's epochs and steps, one timed
  round, and no warm-up unless --warmup_rounds was given. A warm round is
  what most of a run's rounds are; a cold one is what a single timed
  round costs, so both can be asked for."""
  if not FLAGS.full_protocol:
    return
  FLAGS.local_epochs, FLAGS.gan_epochs, FLAGS.server_steps = 20, 20, 2000
  FLAGS.rounds = 1
  if not FLAGS['warmup_rounds'].present:
    FLAGS.warmup_rounds = 0


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  apply_full_protocol()
  common.at_least(1, 'num_clients', 'train_per_client', 'batch_size',
                  'local_epochs', 'gan_epochs', 'server_steps', 'rounds')
  common.at_least(0, 'warmup_rounds')
  common.seed()
  common.check_worker_flags()
  common.check_precision_flag()
  if FLAGS.json:
    # Checked now, not after the benchmark has run.
    directory = os.path.dirname(os.path.abspath(FLAGS.json))
    if os.path.isdir(FLAGS.json) or not os.path.isdir(directory):
      raise app.UsageError(f'--json={FLAGS.json}: not a file in an existing '
                           'directory')
    if not os.access(directory, os.W_OK):
      raise app.UsageError(f'--json={FLAGS.json}: {directory} is not '
                           'writable')

  from fedcg_tff.algorithms import catalog  # pylint: disable=g-import-not-at-top
  from fedcg_tff.config import FedCGConfig  # pylint: disable=g-import-not-at-top
  from fedcg_tff.execution import workers  # pylint: disable=g-import-not-at-top
  from tasks.options import TaskOptions  # pylint: disable=g-import-not-at-top

  common.configure_precision()  # Before the workers start.
  runtime.set_local_cpp_context(FLAGS.max_concurrent_clients)
  config = FedCGConfig(batch_size=FLAGS.batch_size,
                       local_epochs=FLAGS.local_epochs,
                       gan_epochs=FLAGS.gan_epochs, server_epochs=1,
                       server_steps_per_epoch=FLAGS.server_steps,
                       seed=FLAGS.seed,
                       matmul_precision=FLAGS.matmul_precision).validate()
  # Before any TFF tracing: Keras models built afterwards in this process
  # would be built inside TFF's graph-mode state.
  forward = flops.forward_flops(config)
  options = dict(num_clients=FLAGS.num_clients,
                 train_per_client=FLAGS.train_per_client, seed=FLAGS.seed,
                 image_size=config.image_size)
  if FLAGS.data_dir:
    options['data_dir'] = FLAGS.data_dir
  task = common.load_task('fmnist', TaskOptions(**options))
  pool = common.worker_pool()

  print(f'FedCG on FMNIST: {FLAGS.num_clients} clients x '
        f'{FLAGS.train_per_client} images, batch {FLAGS.batch_size}, '
        f'{FLAGS.local_epochs} + {FLAGS.gan_epochs} epochs, '
        f'{FLAGS.server_steps} distillation steps, '
        f'{len(pool) if pool else 1} worker(s), '
        f'{FLAGS.matmul_precision} products', flush=True)
  timings = []
  driver = catalog.build('fedcg', config, FLAGS.num_clients, workers=pool,
                         on_timing=timings.append, timed=True)
  val, test = task.val_datasets(), task.test_datasets()

  rows = []
  for round_num in range(FLAGS.warmup_rounds + FLAGS.rounds):
    try:
      driver.run_round(round_num,
                       list(task.train_datasets(round_num, config.batch_size)))
    except workers.WorkerLost as e:
      sys.exit(f'Worker lost: {e}; the benchmark stopped in round '
               f'{round_num} and wrote nothing.')
    eval_start = time.perf_counter()
    driver.evaluate(val, test)
    evaluation = time.perf_counter() - eval_start
    row = timings[-1].phase_seconds()
    row.update(round=round_num, evaluation_s=evaluation)
    timed = round_num >= FLAGS.warmup_rounds
    print(f'round {round_num} [{"timed" if timed else "warm-up"}]: '
          f'{row["round_s"]:.1f}s (+ evaluation {row["evaluation_s"]:.1f}s)',
          flush=True)
    if timed:
      rows.append(row)

  mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]
          if k != 'round'}
  stage1, stage2 = flops.training_flops(config, forward,
                                       FLAGS.train_per_client)
  train_flops = FLAGS.num_clients * (stage1 + stage2)
  train_seconds = mean['client_stage1_s'] + mean['client_stage2_s']
  peak, peak_how = devices.peak_float32_flops()
  no_peak = '/proc/cpuinfo lists no clock'
  if FLAGS.worker_addresses:
    # The clients ran on other machines: this one's peak says nothing of
    # them (and their phases are stamped on their own clocks).
    peak, peak_how = 0.0, 'clients on remote workers'
    no_peak = peak_how
  achieved = train_flops / mean['clients_in_workers_s']
  per_core, product_rate = 0.0, 0.0
  product_how = 'not timed (--notime_product)'
  if FLAGS.worker_addresses:
    product_how = 'clients on remote workers'
  elif FLAGS.time_product:
    try:
      per_core, product_how = devices.product_flops_per_core()
      product_rate = devices.core_count() * per_core
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
      # The rounds' figures are worth keeping without it.
      product_how = f'timing failed: {e}'
      print(f'the product rate was not measured: {e}', file=sys.stderr)
  memory = {'driver': peak_rss_bytes(os.getpid()),
            'workers': [peak_rss_bytes(p.pid)
                        for p in runtime.worker_processes()]}
  result = {
      'host': devices.host_cpu(),
      # Read where the round was traced: these choices are tuned per host
      # kind (`small_conv.host_tuned_choices`).
      'kernel_choices': {'oriented_products': small_conv.ORIENTED_PRODUCTS,
                         'banded_convs': small_conv.BANDED_CONVS},
      'commit': code_commit(),
      'flags': {name: FLAGS[name].value for name in (
          'clients', 'train_per_client', 'batch_size', 'local_epochs',
          'gan_epochs', 'server_steps', 'rounds', 'warmup_rounds',
          'full_protocol', 'workers', 'max_concurrent_clients',
          'worker_addresses', 'seed', 'matmul_precision')},
      'mean_seconds': mean,
      'rounds': rows,
      'forward_flops_per_example': forward,
      'training_flops_per_round': train_flops,
      'achieved_training_flops_per_s': achieved,
      'peak_flops_per_s': peak,
      'peak_flops_derivation': peak_how,
      'product_flops_per_s_per_core': per_core,
      'product_flops_per_s': product_rate,
      'product_flops_derivation': product_how,
      'peak_rss_bytes': memory,
  }

  print(f'\nhost: {result["host"]}; kernels for it: '
        f'{result["kernel_choices"]}; mean of {len(rows)} timed round(s):')
  labels = [
      ('client_stage1_s', 'client stage 1 (sum over clients)'),
      ('client_stage2_s', 'client stage 2 (sum over clients)'),
      ('client_teacher_s', 'teacher logits (sum over clients)'),
      ('clients_in_workers_s', 'clients in the workers (wall)'),
      ('tff_overhead_s', 'TFF overhead (serialise, dispatch, 1st pass)'),
      ('aggregation_s', 'aggregation'),
      ('distillation_s', 'distillation'),
      ('round_s', 'round (clients\' + server\'s step)'),
      ('evaluation_s', 'evaluation'),
  ]
  for key, text in labels:
    print(f'  {text:40s} {mean[key]:7.2f} s')
  total = mean['round_s'] + mean['evaluation_s']
  print(f'  {"round + evaluation":40s} {total:7.2f} s')
  if FLAGS.full_protocol:
    kind = 'warm' if FLAGS.warmup_rounds else 'cold: one-time work included'
    print(f'full-protocol round ({kind}): {total:.0f} s against the goal of '
          f'{GOAL_SECONDS} s ({"met" if total <= GOAL_SECONDS else "not met"})')
  print(f'training FLOPs per round (estimate): {train_flops / 1e9:.1f} GFLOP;'
        f' achieved {achieved / 1e9:.2f} GFLOP/s over the clients\' wall time'
        f' ({train_flops / train_seconds / 1e9:.2f} GFLOP/s per busy client)'
        + (f' = {100 * achieved / peak:.2f}% of peak {peak / 1e9:.0f} '
           f'GFLOP/s ({peak_how})' if peak else
           f' (no share of peak: {no_peak})'))
  if product_rate:
    print(f'  = {100 * achieved / product_rate:.2f}% of the cores\' measured '
          f'product rate {product_rate / 1e9:.1f} GFLOP/s '
          f'({devices.core_count()} x {product_how})')
  print(f'peak RSS: driver {memory["driver"] / 2**20:.0f} MiB, workers '
        + ', '.join(f'{m / 2**20:.0f} MiB' for m in memory['workers']))
  if FLAGS.json:
    with open(FLAGS.json, 'w') as f:
      json.dump(result, f, indent=2)
    print(f'wrote {FLAGS.json}')


if __name__ == '__main__':
  # TFF logs each retry while a new worker starts listening: not news here.
  logging.set_verbosity(logging.WARNING)
  app.run(main)
