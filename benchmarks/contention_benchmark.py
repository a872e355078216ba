r"""How much two one-thread jobs on the host's two CPUs slow each other down,
for the three kinds of work a FedCG round is made of, in wall and CPU
seconds (wall above CPU: the job sat idle rather than slowed).

  .venv/bin/python -m benchmarks.contention_benchmark

A full-protocol round runs two clients at once, one thread each
(`execution/runtime.py`). On the Intel Xeon host, before the clients'
datasets ran without tf.data's autotuning, one client's GAN epoch took
about 4 s alone and about 7 s in the round; this benchmark showed the
extra time to be idling, not sharing (docs/speed.md). Each
workload is timed alone, then as two processes at once (unpinned, as a
round's threads are), both released together after their warm-up:
- `compute`: a 128x128 matrix product repeated, in L2; slows down only if
  the two CPUs share a core's vector units (SMT siblings).
- `adam_<MB>`: TF's fused Adam step over weights of that many MB (the
  step reads weights, gradient and both moments and writes three of them: a
  client's working set is four times its weights). FedCG's G and D hold
  1.56 M weights (6.2 MB), so one client streams ~25 MB a step.
- `gan`: one client's GAN epoch (2000 images, batch 8, as in the round),
  on `synthetic.client_dataset`, which runs without autotuning as the
  clients' datasets do.
The slowdown of each is printed with the host's CPU and L3 size.
"""

import os
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

from benchmarks import synthetic
from fedcg_tff.config import FedCGConfig
from fedcg_tff.execution import devices

_WORKLOAD = flags.DEFINE_string(
    'workload', None, 'Run one workload in this process and print its '
    'wall and CPU seconds (used by the parent run: after its warm-up it '
    'prints "ready" and waits for a line on stdin).')
_WORKLOADS = flags.DEFINE_list(
    'workloads', ['compute', 'adam_6', 'adam_25', 'adam_50', 'gan'],
    'Workloads to time alone and in pairs.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timings per workload and '
                                'setting (the median is printed).',
                                lower_bound=1)


def adam_megabytes(name):
  """The weights' size of an `adam_<MB>` workload; None for other names."""
  prefix, _, size = name.partition('_')
  if prefix != 'adam':
    return None
  if not (size.isascii() and size.isdecimal()) or int(size) < 1:
    raise ValueError(f'{name!r}: the size in adam_<MB> must be a positive '
                     'integer')
  return int(size)


def check_workloads(names, flag='workloads'):
  """Raises flags.ValidationError naming --`flag` for a bad name."""
  if not names:
    raise flags.ValidationError(f'--{flag}: name at least one workload')
  for name in names:
    try:
      known = name in ('compute', 'gan') or adam_megabytes(name) is not None
    except ValueError as e:
      raise flags.ValidationError(f'--{flag}: {e}') from e
    if not known:
      raise flags.ValidationError(
          f'--{flag}: unknown workload {name!r} (compute, adam_<MB>, gan)')
  return True


flags.register_validator('workloads', check_workloads)
flags.register_validator(
    'workload', lambda name: name is None or check_workloads([name],
                                                             'workload'))


def _time_workload(name):
  """Median wall and CPU seconds of one unit of `name` in this process
  (after one warm-up)."""
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  if name == 'compute':
    a = tf.random.normal([128, 128])

    @tf.function
    def unit():
      # Scaled to keep the product near unit size (no denormals).
      return tf.foldl(lambda acc, _: tf.matmul(acc, a) * 128**-0.5,
                      tf.range(20000), initializer=a)
  elif megabytes := adam_megabytes(name):
    size = megabytes * 2**20 // 4
    weights = tf.Variable(tf.random.normal([size]))
    m = tf.Variable(tf.zeros([size]))
    v = tf.Variable(tf.zeros([size]))
    grad = tf.random.normal([size])

    @tf.function
    def unit():
      for _ in tf.range(200):
        tf.raw_ops.ResourceApplyAdam(
            var=weights.handle, m=m.handle, v=v.handle, beta1_power=0.9,
            beta2_power=0.999, lr=3e-4, beta1=0.9, beta2=0.999,
            epsilon=1e-8, grad=grad)
  else:
    config = FedCGConfig(local_epochs=1, gan_epochs=1)
    unit = synthetic.gan_epoch(config,
                               synthetic.client_dataset(config.batch_size))
  unit()
  # Warmed up: tell the parent, and start when it says so (both copies of
  # a pair then time the same stretch of the machine's life).
  print('ready', flush=True)
  sys.stdin.readline()
  walls, cpus = [], []
  for _ in range(_REPEATS.value):
    wall, cpu = time.perf_counter(), time.process_time()
    unit()
    walls.append(time.perf_counter() - wall)
    cpus.append(time.process_time() - cpu)
  return float(np.median(walls)), float(np.median(cpus))


def _run_at_once(name, copies):
  """Starts `copies` processes of `name` at once; their (wall, CPU)
  seconds each.

  Not pinned to CPUs, as a round's worker threads are not. Each copy
  imports TF and warms up first; all start timing together.
  """
  procs = []
  for _ in range(copies):
    procs.append(subprocess.Popen(
        [sys.executable, '-m', 'benchmarks.contention_benchmark',
         f'--workload={name}', f'--repeats={_REPEATS.value}'],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')))
  for proc in procs:
    if proc.stdout.readline().strip() != 'ready':
      break  # It failed: communicate() below reports it.
  for proc in procs:
    try:
      proc.stdin.write('go\n')
      proc.stdin.flush()
    except BrokenPipeError:
      pass  # It failed: communicate() below reports it.
  seconds = []
  for proc in procs:
    out, err = proc.communicate()
    if proc.returncode:
      raise RuntimeError(f'workload {name} failed (exit {proc.returncode}):'
                         f'\n{err[-2000:]}')
    seconds.append(tuple(map(float, out.split()[-2:])))
  return seconds


def _l3_size():
  path = '/sys/devices/system/cpu/cpu0/cache/index3/size'
  if not os.path.exists(path):
    return 'unknown'
  with open(path) as f:
    return f.read().strip()


def main(argv):
  del argv
  if _WORKLOAD.value:
    print(*_time_workload(_WORKLOAD.value))
    return
  if len(os.sched_getaffinity(0)) < 2:
    raise app.UsageError('contention_benchmark needs two CPUs.')
  print(f'{devices.host_cpu()}, L3 {_l3_size()}; one thread per job; '
        f'median of {_REPEATS.value} timings, wall (CPU) seconds:')
  show = lambda t: f'{t[0]:7.3f} ({t[1]:6.3f})'
  for name in _WORKLOADS.value:
    alone = _run_at_once(name, 1)[0]
    pair = _run_at_once(name, 2)
    slowest = max(wall for wall, _ in pair)
    print(f'  {name:10s} alone {show(alone)}   two at once {show(pair[0])} / '
          f'{show(pair[1])}   slowdown {slowest / alone[0]:4.2f}x',
          flush=True)


if __name__ == '__main__':
  app.run(main)
