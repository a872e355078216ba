"""TFF's local C++ runtime, started and — unlike TFF's own — always stopped.

Each TFF execution context runs computations in a C++ `worker_binary`
subprocess that inherits our stdout and stderr. TFF stops it only from a
`__del__` that fails at interpreter exit, so the worker outlives us and holds
the parent's output pipe open (`python run.py | tail` then never returns, and
CI hangs to its time limit). Importing this module arranges that every
`worker_binary` child of this process is stopped at exit, on SIGTERM/SIGHUP,
and after Ctrl-C (KeyboardInterrupt unwinds into the same atexit hook).
A hard crash (abort, SIGKILL) runs no Python at all, so the worker is also
started with Linux's parent-death signal set (through `setpriv`): the kernel
stops it when the thread that started it dies.

TFF stops a worker with SIGINT and then waits for it without a time limit
(when its context is garbage-collected, and when it restarts a worker it
finds unresponsive). A process started in the background by a
non-interactive shell (CI, `nohup cmd &`) inherits SIGINT *ignored*, and so
did the workers: a run then hung for ever at its end, in TFF's
`ServiceManager.__del__`. So workers start with SIGINT at its default
action (`install_handlers`), and TFF's SIGINT is followed by SIGKILL if the
worker is still alive after STOP_TIMEOUT_SECONDS.
"""

import atexit
import functools
import gc
import os
import shutil
import signal
import sys
import subprocess
import threading
import time
import types

import psutil

from fedcg_tff.execution import devices

WORKER_NAME = 'worker_binary'


def _is_worker(process: psutil.Process) -> bool:
  try:
    return process.name() == WORKER_NAME or any(
        os.path.basename(arg) == WORKER_NAME for arg in process.cmdline()[:1])
  except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
    return False


def worker_processes(pid: int | None = None) -> list[psutil.Process]:
  """The TFF worker processes descended from `pid` (default: this process)."""
  try:
    children = psutil.Process(pid or os.getpid()).children(recursive=True)
  except psutil.NoSuchProcess:
    return []
  return [p for p in children if _is_worker(p)]


STOP_TIMEOUT_SECONDS = 5.0
# True while `shutdown_workers` runs: workers that die then are its.
_stopping = False


def shutdown_workers(timeout: float = STOP_TIMEOUT_SECONDS) -> int:
  """Stops this process's TFF workers (SIGINT, then SIGKILL) and reaps them.

  Returns how many were stopped. Safe to call any number of times. The next
  TFF computation call starts a fresh worker if one is needed: TFF notices
  the dead stub and restarts the service.
  """
  global _stopping
  _stopping = True
  try:
    workers = worker_processes()
    for w in workers:
      try:
        w.send_signal(signal.SIGINT)
      except psutil.NoSuchProcess:
        pass
    _, alive = psutil.wait_procs(workers, timeout=timeout)
    for w in alive:
      try:
        w.kill()
      except psutil.NoSuchProcess:
        pass
    psutil.wait_procs(alive, timeout=timeout)
  finally:
    _stopping = False
  if workers:
    _disarm_service_managers()
  return len(workers)


# The kernel's parent-death signal is set by util-linux's `setpriv`, which
# then execs the worker. Setting it from Python (`preexec_fn`) would make
# `subprocess` fork this multi-threaded process and run Python in the child
# before exec: a child doing that aborted during a test run (gRPC's and
# Python's at-fork handlers run in it), and the parent then waited for ever
# for a worker that never started. Without `preexec_fn` the child only
# execs. Without `setpriv` (not Linux), the atexit and signal handlers
# still stop workers; only a hard crash can leave one behind.
_SETPRIV = shutil.which('setpriv')


@functools.cache
def _setpriv_works() -> bool:
  """Whether `setpriv --pdeathsig` runs here (util-linux before 2.33 has
  no such option: every worker would fail to start, and TFF waits for a
  worker that never answers without end)."""
  if _SETPRIV is None:
    return False
  try:
    return subprocess.run([_SETPRIV, '--pdeathsig', 'KILL', '--', 'true'],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          timeout=10, check=False).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


def _worker_command(command):
  if not _setpriv_works():
    return command
  return [_SETPRIV, '--pdeathsig', 'KILL', '--', *command]


# A worker runs a round's clients concurrently (one inter-op thread per
# core); each client's ops are small (batch 8, LeNet), and one intra-op
# thread per op measured faster than TensorFlow's default of one per core
# (binaries/benchmark.py, 4 FMNIST clients: 30.5 s against 38.3 s a round).
# Set TF_NUM_INTRAOP_THREADS to override.
WORKER_ENV_DEFAULTS = {'TF_NUM_INTRAOP_THREADS': '1'}


class WorkerPopen(subprocess.Popen):
  """`subprocess.Popen` of a worker command (a list) with the parent-death
  signal set (`_worker_command`) and WORKER_ENV_DEFAULTS for what the
  environment does not set."""

  def __init__(self, args, **kwargs):
    env = dict(kwargs.get('env') or os.environ)
    for name, value in WORKER_ENV_DEFAULTS.items():
      env.setdefault(name, value)
    kwargs['env'] = env
    super().__init__(_worker_command(list(args)), **kwargs)


def patch_worker_launcher():
  """Makes TFF's local executor factory start workers with `WorkerPopen`.

  TFF offers no hook for how its worker is launched; its factory module calls
  `subprocess.Popen`, so that module's `subprocess` name is pointed at a copy
  whose `Popen` is ours (everything else is the real module's). Likewise its
  `os.kill`, which TFF calls only to stop a worker (SIGINT) right before
  waiting for it with no time limit: ours (`stop_worker_pid`) makes sure
  the worker is dead when it returns, and ignores a process already reaped
  (stopped by `shutdown_workers`; TFF's would raise ProcessLookupError).
  """
  from tensorflow_federated.python.core.impl.executor_stacks import executor_factory  # pylint: disable=g-import-not-at-top
  if getattr(executor_factory.subprocess, 'Popen', None) is WorkerPopen:
    return
  shim = types.ModuleType('subprocess')
  shim.__dict__.update(subprocess.__dict__)
  shim.Popen = WorkerPopen
  executor_factory.subprocess = shim
  os_shim = types.ModuleType('os')
  os_shim.__dict__.update(os.__dict__)
  os_shim.kill = stop_worker_pid
  executor_factory.os = os_shim


def stop_worker_pid(pid: int, sig: int,
                     timeout: float = STOP_TIMEOUT_SECONDS) -> None:
  """`os.kill(pid, sig)`, then SIGKILL if the process has not died (is not
  a zombie or gone) within `timeout`. Does not reap it: TFF's `wait` does.
  Signals nothing unless `pid` is a worker started by this process: TFF
  may call this with the pid of a worker `shutdown_workers` stopped and
  reaped, which the system may since have given to another process."""
  try:
    process = psutil.Process(pid)
    if process.ppid() != os.getpid() or not _is_worker(process):
      return
    if process.status() == psutil.STATUS_ZOMBIE:
      # Dead before TFF stopped it. Said only when TFF is replacing a
      # worker it found unresponsive (its `get_stub`), to retry the call
      # that worker was running: not when a context is collected (its
      # thread's end may have killed the worker: the parent-death signal)
      # or while `shutdown_workers` stops everything.
      if _stopping or sys._getframe(1).f_code.co_name != 'get_stub':  # pylint: disable=protected-access
        return
      print(f'the local TFF worker (pid {pid}) {_how_it_ended(pid)}; TFF '
            'starts a new one, and the call it was running runs again from '
            'its start (same results, more time)', file=sys.stderr,
            flush=True)
      return
    os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while process.status() != psutil.STATUS_ZOMBIE:
      if time.monotonic() > deadline:
        os.kill(pid, signal.SIGKILL)
        return
      time.sleep(0.05)
  except (ProcessLookupError, psutil.NoSuchProcess):
    pass


def _how_it_ended(pid: int) -> str:
  """How a child that is a zombie ended, from the wait status the kernel
  keeps for it (the last field of /proc/<pid>/stat, Linux 3.5 on), read
  without reaping it: TFF's `wait` does that."""
  try:
    with open(f'/proc/{pid}/stat', encoding='ascii') as f:
      status = int(f.read().rsplit(None, 1)[-1])
    if status & 0x7f:
      number = status & 0x7f
      name = signal.Signals(number).name
      cause = (" (as the kernel's out-of-memory killer does)"
               if number == signal.SIGKILL else '')
      return f'was killed by {name}{cause}'
    return f'exited with status {status >> 8}'
  except (OSError, ValueError):
    return 'ended'


def _exit_on_signal(signum, frame):
  del frame
  # SystemExit unwinds like an exception, so `finally` blocks and atexit
  # hooks (shutdown_workers among them) run before the interpreter exits.
  sys.exit(128 + signum)


def _shutdown_at_exit() -> None:
  """Stops the workers, then switches off TFF's own cleanup of them.

  TFF's worker handle (`ServiceManager`) stops its worker in `__del__`, which
  at interpreter teardown runs after module globals are cleared and fails
  noisily (`'NoneType' object has no attribute 'Popen'`). The workers are
  gone by then, so that `__del__` is switched off here.

  Last, the garbage collector's objects are frozen (`gc.freeze`): with
  TensorFlow and TFF loaded, the interpreter's final collections over their
  millions of objects took 2.5-3 s of every process's exit (measured here:
  a `python -c 'import tensorflow_federated'` left 2.5 s after its atexit
  hooks, 0.3 s with the freeze). Nothing is lost: objects still reachable
  are released as modules are cleared, as before; only cyclic garbage is
  left to the OS, and our files are written and closed (atomically, most)
  before exit, never by a finaliser (TensorBoard's events too: TF flushes
  its writer after every release, tests/round_loop_test.py).
  """
  shutdown_workers()
  _disarm_service_managers()
  gc.freeze()


def _disarm_service_managers() -> None:
  """Replaces the `__del__` of TFF's live `ServiceManager`s (one class per
  TFF context) with a no-op: their workers are stopped by us, and theirs
  fails when collected at exit, on torn-down modules ("'NoneType' object
  has no attribute 'Popen'", printed as an exception ignored).

  The class is local to TFF's executor factory, one per factory call, with
  no base: it is found among `object`'s live subclasses (3000, 1 ms), not
  by walking every object the collector tracks (0.33 s for the 600 000 of
  a process that had built FedCG and FedAvg, Zen 1; more in a test
  process that has built dozens)."""
  if 'tensorflow_federated' not in sys.modules:
    return
  for cls in object.__subclasses__():
    if (cls.__name__ == 'ServiceManager' and '__del__' in cls.__dict__
        and cls.__module__.startswith('tensorflow_federated')):
      cls.__del__ = lambda self: None


def _ignore(signum, frame):
  del signum, frame


def install_handlers() -> None:
  """Stop workers at exit and turn SIGTERM/SIGHUP into a clean exit.

  An ignored SIGINT (background start) becomes a handler that does
  nothing: this process still ignores it, but an exec resets a handled
  signal to its default action while it keeps an ignored one ignored, so
  workers start with SIGINT at its default and TFF can stop them with it.
  """
  atexit.register(_shutdown_at_exit)
  if threading.current_thread() is not threading.main_thread():
    return  # Signal handlers can only be set from the main thread.
  for sig in (signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(sig) in (signal.SIG_DFL, None):
      signal.signal(sig, _exit_on_signal)
  if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, _ignore)


def default_concurrency(workers_on_this_machine: int = 1) -> int:
  """Client computations a local worker runs at once unless told: its share
  of the CPU cores. Unbounded, a worker ran 8 FMNIST clients (500 images)
  in 49 s a round against 19 s two at a time (binaries/benchmark.py)."""
  return max(1, devices.usable_cpus() // workers_on_this_machine)


# How many compiled computations `compiled` keeps alive (a process has five
# or six): the last few processes an interpreter ran, so that one building
# process after process (a notebook) does not keep every compilation.
COMPILED_KEPT = 32


_COMPILING = threading.Lock()


def compiled(comp, secure_as_plain: bool):
  """`comp` compiled for TFF's C++ worker, once per interpreter.

  TFF caches a compilation per execution context only, so every new context
  compiled each computation again at its first call (TFF's native compiler
  runs Grappler on each of its TF graphs: 6.0 s for the `next` of the tests'
  tiny FedCG process on the Zen 1 host, 3.5 s for its clients' step alone),
  although the result depends on the computation alone: each of
  `--workers`' contexts, and each run of one process in an interpreter
  that runs several (`catalog.build_process` builds a process once per
  config: run_inversion_attack's calls, the tests' in-process runs).
  Every context this module makes shares this cache. A process traced
  again is another computation (TF's graph names differ) and compiles
  anew. Equal computations (equal protos, TFF's own cache key) share an
  entry; the context keeps the caller's type signature for its result's
  containers.

  `secure_as_plain`: TFF's test compiler, which lowers the secure-sum
  intrinsics (`--aggregation=secure`) to their plain-TF bodies, which the
  native compiler cannot run ("Cannot embed a federated value"); a
  computation without a secure sum compiles as with the native compiler.

  One compilation at a time: `--workers`' threads ask for the same
  computation at once, and the later ones then wait for the first's result
  instead of compiling it again beside it.
  """
  with _COMPILING:
    return _compiled(comp, secure_as_plain)


@functools.lru_cache(maxsize=COMPILED_KEPT)
def _compiled(comp, secure_as_plain: bool):
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  if secure_as_plain:
    comp = tff.backends.test.replace_secure_intrinsics_with_bodies(comp)
  return tff.backends.native.desugar_and_transform_to_native(comp)


def compiling_context(executor_fn, secure_as_plain: bool):
  """A TFF synchronous context on `executor_fn` whose compilations are
  `compiled`'s: what TFF's `create_sync_local_cpp_execution_context`
  (`secure_as_plain=False`) and its test backend's (True) build, but with
  the compiler output shared by every context of this interpreter."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  return tff.framework.SyncExecutionContext(
      executor_fn=executor_fn,
      compiler_fn=functools.partial(compiled,
                                    secure_as_plain=secure_as_plain),
      transform_args=tff.tensorflow.transform_args,
      transform_result=tff.tensorflow.transform_result)


def local_context(max_concurrent_computation_calls: int,
                  secure_as_plain: bool = False):
  """A context on its own local C++ worker (started on first use, stopped
  as this module arranges), running at most
  `max_concurrent_computation_calls` client computations at once
  (non-positive: no bound)."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  patch_worker_launcher()
  return compiling_context(
      tff.framework.local_cpp_executor_factory(
          max_concurrent_computation_calls=max_concurrent_computation_calls),
      secure_as_plain)


def set_local_cpp_context(
    max_concurrent_computation_calls: int | None = None) -> None:
  """Makes TFF's local C++ runtime the default context, with clean shutdown.

  `max_concurrent_computation_calls` bounds how many client computations the
  worker runs at once (None: `default_concurrency()`; non-positive: no
  bound). The context compiles as TFF's test backend does
  (`secure_as_plain`), so that `--aggregation=secure` runs here.
  """
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  shutdown_workers()
  if max_concurrent_computation_calls is None:
    max_concurrent_computation_calls = default_concurrency()
  tff.framework.set_default_context(
      local_context(max_concurrent_computation_calls, secure_as_plain=True))


install_handlers()
