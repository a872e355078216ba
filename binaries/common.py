"""What the binaries share: flag checks that name the flag, the worker and
DP flags, loading a task with errors that name the flags to fix, and
starting `run_fedcg` as a child process.

Flags are defined by the `define_*` functions, called at import by each
binary that takes them, so a binary gets only the flags it uses. Nothing
here imports TensorFlow at import time: a binary checks its flags before
TensorFlow starts.
"""

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from typing import Optional, Sequence

from absl import app
from absl import flags

from fedcg_tff.execution import child_env

FLAGS = flags.FLAGS
ROOT = child_env.ROOT


# --- Checks ------------------------------------------------------------------


def at_least(minimum: int, *names: str) -> None:
  """Refuses any flag of `names` set below `minimum` (None is not set)."""
  for name in names:
    value = FLAGS[name].value
    if value is not None and value < minimum:
      raise app.UsageError(f'--{name} must be >= {minimum}, got {value}')


def finite(name: str, low: float = 0.0, strict: bool = False) -> None:
  """Refuses a non-finite flag value, or one below (or at, `strict`)
  `low`."""
  value = FLAGS[name].value
  if not math.isfinite(value) or value < low or (strict and value == low):
    relation = '>' if strict else '>='
    raise app.UsageError(
        f'--{name} must be finite and {relation} {low:g}, got {value}')


def distinct_list(name: str, kind: type, what: str, valid=None,
                  condition: str = '') -> list:
  """The list flag `name` as distinct values of `kind` (int or float),
  each passing `valid` (described by `condition`); refuses anything else
  naming the flag and what it must hold (`what`: 'integers', 'numbers')."""
  raw = FLAGS[name].value
  try:
    values = [kind(v) for v in raw]
  except ValueError:
    raise app.UsageError(f'--{name} must be {what}, got {raw}') from None
  for v in values:
    if valid is not None and not valid(v):
      raise app.UsageError(f'--{name} values must be {condition}, got {v}')
  if not values or len(set(values)) != len(values):
    raise app.UsageError(f'--{name} must be distinct {what}, got {raw}')
  return values


def writable_dir(name: str = 'output_dir', access: bool = True) -> None:
  """Refuses a directory flag the binary could not write into, before any
  work: empty, an existing file, a path through a file or a broken
  symlink, or (`access`) one whose nearest existing directory this user
  may not write (the attacks found that out only when writing their
  reports, after all their work)."""
  path = FLAGS[name].value
  if not path:
    raise app.UsageError(f'--{name} is empty: give a directory')
  existing = os.path.abspath(path)
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if not os.path.exists(existing):
    raise app.UsageError(f'--{name}={path}: {existing} is a broken symlink')
  if not os.path.isdir(existing):
    raise app.UsageError(
        f'--{name}={path} is a file, not a directory' if existing ==
        os.path.abspath(path) else
        f'--{name}={path}: {existing} is a file, not a directory')
  if access and not os.access(existing, os.W_OK | os.X_OK):
    raise app.UsageError(f'--{name}={path}: {existing} is not writable')


def fresh_report_dir(report_file: str,
                     runs: Optional[dict[str, str]] = None) -> None:
  """Refuses an --output_dir that already holds this binary's report
  (`report_file`: a rerun would replace it and leave the earlier one's other
  files beside it) or that is, or is inside, a run directory the binary
  reads or trains (`runs`, what the error calls it -> path; symlinks
  resolved: a run's resume replaces its tensorboard/)."""
  path = os.path.realpath(FLAGS.output_dir)
  if os.path.exists(os.path.join(path, report_file)):
    raise app.UsageError(
        f'--output_dir={FLAGS.output_dir} holds an earlier report '
        f'({report_file}): give a new directory, or move that one away')
  for label, run in (runs or {}).items():
    if run and (path + os.sep).startswith(os.path.realpath(run) + os.sep):
      raise app.UsageError(f'--output_dir is in {label}: write the '
                           'report outside the runs it reads')


def split_flags(name: str) -> list[str]:
  """The command-line flags held in string flag --`name` (shell quoting)."""
  try:
    return shlex.split(FLAGS[name].value)
  except ValueError as e:  # An unbalanced quote.
    raise app.UsageError(f'--{name}={FLAGS[name].value}: {e}') from None


def used_by_some(flag_name: str, tokens, algorithms, tasks=None) -> None:
  """Refuses a flag in `tokens` (the value of --`flag_name`) that only
  algorithms or tasks other than these use (`names.ALGORITHM_FLAGS`,
  `names.TASK_FLAGS`): no run would get it (`run_flags_for`)."""
  from fedcg_tff.names import ALGORITHM_FLAGS, TASK_FLAGS  # pylint: disable=g-import-not-at-top
  for token in tokens:
    name = token.lstrip('-').split('=')[0]
    for kind, table, given in (('algorithm', ALGORITHM_FLAGS, algorithms),
                               ('task', TASK_FLAGS, tasks)):
      users = table.get(name) if token.startswith('-') else None
      if users and given is not None and not set(users) & set(given):
        raise app.UsageError(
            f'--{flag_name} sets --{name}, which only --{kind}='
            f'{"|".join(users)} uses, and no run is one of them')


def seed(name: str = 'seed') -> None:
  value = FLAGS[name].value
  if not 0 <= value <= 2**31 - 1:
    raise app.UsageError(f'--{name} must be in [0, 2147483647], got {value}')


# --- Differential privacy ------------------------------------------------------


def define_dp_flags() -> None:
  """--dp_clip and --dp_delta (each binary defines its own --dp_sigma)."""
  flags.DEFINE_float(
      'dp_clip', 10.0,
      'L2 norm each client record (a round\'s update in training, the '
      'shared gradient in the attack) is clipped to before its noise. The '
      'default is above the norms measured on FMNIST (gradients of round 1 '
      'about 5, one-epoch updates 1.5-4.5), so it does not bind there; it '
      'sets the noise multiplier dp_sigma / dp_clip that epsilon is '
      'computed for.')
  flags.DEFINE_float('dp_delta', 1e-5,
                     'Delta of the (epsilon, delta) reported with DP.')


def check_dp_flags() -> None:
  finite('dp_clip', 0.0, strict=True)
  if not 0 < FLAGS.dp_delta < 1:
    raise app.UsageError(f'--dp_delta must be in (0, 1), got {FLAGS.dp_delta}')


# --- Precision of the products --------------------------------------------------


def define_precision_flag() -> None:
  from fedcg_tff.config import MATMUL_PRECISIONS  # pylint: disable=g-import-not-at-top
  flags.DEFINE_enum(
      'matmul_precision', MATMUL_PRECISIONS[0], list(MATMUL_PRECISIONS),
      'float32: every product in float32 (the default). bfloat16: an opt-in '
      'for CPUs with AVX512-BF16 or AMX: oneDNN rounds the inputs of the '
      'GAN\'s products and of E\'s convolutions to bfloat16 and sums in '
      'float32; faster there, '
      'other results than float32 (README, "bfloat16 products"). A run '
      'records it; every worker must use the same (run_worker takes it '
      'too).')


def check_precision_flag() -> None:
  """Refuses --matmul_precision where it cannot run as asked
  (`execution.precision.problem`); reads no file but /proc/cpuinfo."""
  from fedcg_tff.execution import precision  # pylint: disable=g-import-not-at-top
  reason = precision.problem(FLAGS.matmul_precision)
  if reason:
    raise app.UsageError(reason)


def configure_precision() -> None:
  """Sets this process's environment for --matmul_precision, before any
  TFF worker starts (`execution.precision.configure`)."""
  from fedcg_tff.execution import precision  # pylint: disable=g-import-not-at-top
  try:
    precision.configure(FLAGS.matmul_precision)
  except ValueError as e:
    raise app.UsageError(str(e)) from None


# --- Workers -----------------------------------------------------------------


def define_concurrency_flag() -> None:
  flags.DEFINE_integer('max_concurrent_clients', None,
                       'Client computations a worker runs at once (default: '
                       'its share of the CPU cores; non-positive: all).')


def define_worker_flags() -> None:
  flags.DEFINE_integer('workers', 1,
                       'Local TFF worker processes the clients of a round are '
                       'spread over (same results as one).')
  flags.DEFINE_list('worker_addresses', [],
                    'host:port of TFF workers started with binaries/run_worker '
                    '(on this or other machines) to spread the clients over, '
                    'instead of local ones.')
  flags.DEFINE_float('lost_worker_timeout', 0.0,
                     'Seconds a --worker_addresses worker may stay silent '
                     'in the middle of a round before the run stops (it '
                     'resumes when rerun); 0: wait until a worker answers '
                     'there again, which continues the round.')
  define_concurrency_flag()


def check_worker_flags() -> None:
  at_least(1, 'workers')
  if FLAGS.worker_addresses and FLAGS.workers != 1:
    raise app.UsageError('--workers starts local workers; with '
                         '--worker_addresses the workers are given: use one')
  finite('lost_worker_timeout')
  if FLAGS.lost_worker_timeout and not FLAGS.worker_addresses:
    raise app.UsageError(
        '--lost_worker_timeout applies to --worker_addresses workers (TFF '
        'replaces a local worker that dies by itself)')
  for address in FLAGS.worker_addresses:
    host, _, port = address.rpartition(':')
    if not host or not port.isdigit():
      raise app.UsageError(
          f'--worker_addresses: {address!r} is not host:port')


def worker_pool():
  """The --workers / --worker_addresses workers (None: the default context
  alone); remote ones are reached now, so that an unreachable address stops
  the binary before it writes anything."""
  if FLAGS.workers == 1 and not FLAGS.worker_addresses:
    return None
  from fedcg_tff.execution import workers  # pylint: disable=g-import-not-at-top
  if not FLAGS.worker_addresses:
    return workers.Workers.local(FLAGS.workers, FLAGS.max_concurrent_clients)
  try:
    return workers.Workers.remote(
        FLAGS.worker_addresses, FLAGS.lost_worker_timeout,
        log=lambda line: print(line, flush=True))
  except ConnectionError as e:
    raise app.UsageError(f'--worker_addresses: {e}') from None


# --- Tasks -------------------------------------------------------------------


def load_task(task: str, options):
  """`tasks.registry.build(task, options)`; a missing or malformed data set
  stops the binary with a message naming the flags that point at it."""
  from tasks import registry  # pylint: disable=g-import-not-at-top
  try:
    return registry.build(task, options)
  except (FileNotFoundError, ValueError) as e:
    raise app.UsageError(
        f'--task={task} (--data_dir / --data_source / split flags): '
        f'{e}') from None


# --- Child runs --------------------------------------------------------------


def run_flags_for(algorithm: str, task: str,
                  tokens: Sequence[str]) -> list[str]:
  """`tokens` (run_fedcg flags) less those only other algorithms or tasks
  use (`names.ALGORITHM_FLAGS`, `names.TASK_FLAGS`), which run_fedcg would
  refuse: one sweep can set FedProx's mu beside FedCG, or the images per
  client beside a domain task."""
  from fedcg_tff.names import ALGORITHM_FLAGS, TASK_FLAGS  # pylint: disable=g-import-not-at-top
  kept = []
  tokens = iter(tokens)
  for token in tokens:
    name = token.lstrip('-').split('=')[0]
    if token.startswith('-') and (
        algorithm not in ALGORITHM_FLAGS.get(name, (algorithm,)) or
        task not in TASK_FLAGS.get(name, (task,))):
      if '=' not in token:
        next(tokens, None)  # Its value, given as the next word.
      continue
    kept.append(token)
  return kept


def sweep_time_left(ran: dict, left) -> float:
  """Seconds the runs `left` ((task, algorithm, seed)) of a sweep would
  take, each at the median of the runs `ran` ((task, algorithm) -> seconds
  of those trained) of its task and algorithm, else of all in `ran`: an
  algorithm's runs cost alike across seeds, FedCG's several FedAvg's."""
  every = statistics.median(s for seconds in ran.values() for s in seconds)
  return sum(statistics.median(ran[t, a]) if (t, a) in ran else every
             for t, a, _ in left)


REFUSED = 2  # run_fedcg.check_runs' exit code for a refused run.


def check_run_fedcg_flags(runs: dict) -> None:
  """Checks the flags of `run_fedcg` runs (label -> args) as each run would
  at its start, all in one child interpreter (run_fedcg's flags cannot be
  defined beside a sweep's; no TensorFlow: about a second), so that a typo
  stops a sweep before its first run rather than failing every run."""
  done = subprocess.run(
      [sys.executable, '-c',
       'import json, sys\n'
       'from binaries import run_fedcg\n'
       'run_fedcg.check_runs(json.loads(sys.stdin.read()))\n'],
      input=json.dumps(runs), env=child_env.environment(), capture_output=True,
      text=True, check=False)
  if done.returncode == REFUSED:
    # The refusal is check_runs' last line (anything before it is logging).
    raise app.UsageError(done.stderr.strip().splitlines()[-1])
  if done.returncode:
    raise RuntimeError(f'checking the runs\' flags failed (exit '
                       f'{done.returncode}): {done.stderr.strip()}')


def run_fedcg(args: Sequence[str]) -> int:
  """Runs `python -m binaries.run_fedcg *args` in this interpreter, in this
  working directory (relative paths in `args` mean what they mean here),
  with the repository importable; returns its exit code."""
  child = subprocess.Popen([sys.executable, '-m', 'binaries.run_fedcg',
                            *args], env=child_env.environment())
  try:
    return child.wait()
  except BaseException as e:
    # This process is ending first (SIGTERM or SIGHUP, which
    # `execution.runtime` turns into SystemExit, or Ctrl-C): the run ends
    # too, cleanly, rather than go on as an orphan that a rerun of the
    # sweep would meet in its directory (`run_record.OutputDirLock`).
    # Ctrl-C reached the run too: it is given time to stop on its own
    # before a SIGTERM would cut its exit short.
    _end(child, grace=CHILD_STOP_SECONDS if isinstance(
        e, KeyboardInterrupt) else 0)
    raise


CHILD_STOP_SECONDS = 60


def _end(child: subprocess.Popen, grace: float) -> None:
  """Waits `grace` seconds for `child` to end, then terminates it, and
  kills it if it is still there CHILD_STOP_SECONDS later; a further
  signal or Ctrl-C while waiting kills it at once."""
  if grace and child.poll() is None:
    print(f'waiting up to {grace:.0f} s for the run (pid {child.pid}) to '
          'stop', file=sys.stderr, flush=True)
  try:
    for stop in (None, child.terminate, child.kill):
      if stop is not None:
        print(f'stopping the run (pid {child.pid}) with '
              f'{"SIGTERM" if stop == child.terminate else "SIGKILL"}',
              file=sys.stderr, flush=True)
        stop()
      try:
        child.wait(timeout=grace)
        return
      except subprocess.TimeoutExpired:
        grace = CHILD_STOP_SECONDS
  except BaseException:
    child.kill()
    child.wait()
    raise
