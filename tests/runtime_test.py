"""No TFF worker_binary outlives the process that started it.

Each case runs a small script in a subprocess whose stdout is a pipe: if a
worker survived, it would hold the pipe open and `communicate` would time out
(the CI hang this guards against), and `worker_binary` would still be found.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from fedcg_tff.execution import runtime
from tests import binary_runs
from tests import build_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent('''
    import os, sys, time
    sys.path.insert(0, {root!r})
    from fedcg_tff.execution import runtime
    import numpy as np
    import tensorflow_federated as tff
    runtime.set_local_cpp_context()

    @tff.tensorflow.computation(np.float32)
    def add_one(x):
      return x + 1.0

    assert add_one(1.0) == 2.0
    print('WORKERS', ' '.join(str(p.pid) for p in runtime.worker_processes()),
          flush=True)
    mode = {mode!r}
    if mode == 'raise':
      raise RuntimeError('crash on purpose')
    if mode == 'wait':
      time.sleep(120)
    if mode == 'drop':  # A context dropped before exit stops its worker.
      import gc
      import psutil
      from tensorflow_federated.python.core.impl.context_stack import context_stack_impl
      from fedcg_tff.execution import workers
      default = {{p.pid for p in runtime.worker_processes()}}
      context = workers.local_contexts(1)[0]
      with context_stack_impl.context_stack.install(context):
        assert add_one(2.0) == 3.0
      for p in runtime.worker_processes():
        with open(f'/proc/{{p.pid}}/status') as f:
          ignored = [l.split()[1] for l in f if l.startswith('SigIgn')][0]
        print('SIGINT_IGNORED', p.pid, bool(int(ignored, 16) & 2), flush=True)
      dropped = [p for p in runtime.worker_processes() if p.pid not in default]
      assert dropped
      del context
      gc.collect()
      # Stopped by the drop itself, before the exit's cleanup could.
      _, alive = psutil.wait_procs(dropped, timeout=10)
      print('DROPPED', len(alive), 'alive', flush=True)
''')


def _run(mode, send=None, sigint_ignored=False):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  command = [sys.executable, '-c', _SCRIPT.format(root=ROOT, mode=mode)]
  if sigint_ignored:  # As a non-interactive shell starts background jobs.
    command = ['/bin/sh', '-c', 'trap "" INT; exec "$@"', 'sh', *command]
  proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env)
  worker_pids = []
  if send is not None:
    for line in proc.stdout:  # Wait until the worker is up.
      if line.startswith(b'WORKERS'):
        worker_pids = [int(p) for p in line.split()[1:]]
        break
    time.sleep(0.5)
    proc.send_signal(send)
  try:
    out, _ = proc.communicate(timeout=120)
  except subprocess.TimeoutExpired:
    proc.kill()
    pytest.fail('the script hung, or a worker_binary outlived it and held '
                'the output pipe open')
  for line in out.splitlines():
    if line.startswith(b'WORKERS'):
      worker_pids = [int(p) for p in line.split()[1:]]
  return proc.returncode, worker_pids, out.decode()


# A normal exit (rc 0) is the 'drop' script's end: see the test after this.
# A hard crash (os.abort) runs no Python, as SIGKILL: the parent-death
# signal stops the worker in both, so SIGKILL stands for both.
@pytest.mark.parametrize('mode,send,expect_rc', [
    ('raise', None, 1),
    ('wait', signal.SIGTERM, 128 + signal.SIGTERM),
    ('wait', signal.SIGKILL, -signal.SIGKILL),
    # Ctrl-C: KeyboardInterrupt, which Python reports by dying of SIGINT.
    ('wait', signal.SIGINT, -signal.SIGINT),
])
def test_worker_stopped_with_parent(mode, send, expect_rc):
  rc, worker_pids, _ = _run(mode, send)
  assert worker_pids, 'the script should have started a worker'
  assert rc == expect_rc
  deadline = time.time() + 10
  while any(binary_runs.alive(p) for p in worker_pids) and time.time() < deadline:
    time.sleep(0.2)
  assert not any(binary_runs.alive(p) for p in worker_pids)


def test_dropped_context_stops_its_worker_when_sigint_is_ignored():
  """CI starts the suite with SIGINT ignored; TFF stops a dropped context's
  worker with SIGINT and waits without limit, so a worker that inherited
  the ignored SIGINT hung the binary at its end. The script then exits
  normally: the default context's worker (in WORKERS) stops with it."""
  rc, worker_pids, out = _run('drop', sigint_ignored=True)
  assert rc == 0 and 'DROPPED 0 alive' in out, out
  flags = [line.split()[2] for line in out.splitlines()
           if line.startswith('SIGINT_IGNORED')]
  assert flags and set(flags) == {'False'}
  assert not any(binary_runs.alive(p) for p in worker_pids)


def test_a_context_left_unused_is_collected_quietly_at_exit():
  """TFF's worker handle (`ServiceManager`) stops its worker in `__del__`,
  which fails when it is collected at exit, on torn-down modules ("'NoneType'
  object has no attribute 'Popen'", printed as an exception ignored):
  runtime switches that `__del__` off. A binary that sets its context and
  then stops at bad input leaves such a handle."""
  script = (f'import sys; sys.path.insert(0, {ROOT!r})\n'
            'from fedcg_tff.execution import runtime\n'
            'runtime.set_local_cpp_context()\n')
  done = subprocess.run([sys.executable, '-c', script], capture_output=True,
                        text=True, timeout=120,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'Exception ignored' not in done.stderr, done.stderr[-3000:]


def _reached(path: str) -> tuple[set[str], set[str]]:
  """(local files, third-party requirements) `path` imports, transitively."""
  seen, third, todo = set(), set(), [path]
  while todo:
    current = todo.pop()
    if current not in seen:
      seen.add(current)
      local, packages = build_graph.imports(current)
      third |= packages
      todo += local
  return seen, third


def test_every_entry_point_that_loads_tff_loads_this_module():
  """A binary or benchmark whose imports reach TFF imports `runtime` too:
  its exit hook stops the workers and quiets TFF's `ServiceManager.__del__`
  (the test above), which otherwise prints a traceback at every exit, as
  `benchmarks/small_conv_benchmark.py` did. Read off the import graph
  `tests/build_graph` builds BUILD from."""
  loads_tff = []
  for path in build_graph.source_files():
    if build_graph.kind(path) == 'py_binary':
      seen, third = _reached(path)
      if 'tensorflow-federated' in third:
        loads_tff.append(path)
        assert 'fedcg_tff/execution/runtime.py' in seen, path
  assert 'benchmarks/small_conv_benchmark.py' in loads_tff


def test_shutdown_workers_is_idempotent_without_workers():
  runtime.shutdown_workers()
  assert runtime.shutdown_workers() == 0
  assert runtime.worker_processes() == []


def test_a_binary_stopped_at_its_time_limit_leaves_no_process():
  """The tests' time limit kills a binary's whole tree: a training run it
  started (run_privacy_attack --train_dir) or its TFF workers would
  otherwise run on into the rest of the suite."""
  code = ('import subprocess, sys, time\n'
          'child = subprocess.Popen([sys.executable, "-c", '
          '"import time; time.sleep(60)"])\n'
          'print(child.pid, flush=True)\n'
          'time.sleep(60)\n')
  proc = subprocess.Popen([sys.executable, '-c', code],
                          stdout=subprocess.PIPE, text=True)
  child = psutil.Process(int(proc.stdout.readline()))
  binary_runs.kill_tree(proc)
  # Killed, the orphan is a zombie until whatever init reaps it (if one
  # does): dead either way.
  deadline = time.monotonic() + 5
  while time.monotonic() < deadline and binary_runs.alive(child.pid):
    time.sleep(0.05)
  assert not binary_runs.alive(child.pid)
  assert proc.returncode is not None


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))


def test_stopping_a_worker_pid_spares_other_processes(tmp_path):
  """TFF stops a worker by pid, maybe one reaped long ago and reused: only a
  worker this process started is signalled, not a child of ours that is
  no worker, nor a worker of another process (here a grandchild)."""
  fake_worker = tmp_path / runtime.WORKER_NAME  # `sleep` by a worker's name.
  fake_worker.symlink_to(shutil.which('sleep'))
  other = subprocess.Popen(['sleep', '30'])
  shell = subprocess.Popen(['sh', '-c', f'{fake_worker} 30 & wait'])
  ours = subprocess.Popen([str(fake_worker), '30'])
  try:
    deadline = time.time() + 10
    while not psutil.Process(shell.pid).children() and time.time() < deadline:
      time.sleep(0.05)
    grandchild, = psutil.Process(shell.pid).children()
    for pid in (other.pid, grandchild.pid, ours.pid):
      runtime.stop_worker_pid(pid, signal.SIGKILL)
    assert binary_runs.alive(other.pid) and grandchild.is_running()
    assert ours.wait(timeout=10) == -signal.SIGKILL
  finally:
    for proc in (other, shell, ours):
      binary_runs.kill_tree(proc)
      proc.wait()


def test_workers_start_without_setpriv_when_it_fails(monkeypatch):
  """A `setpriv` without --pdeathsig (util-linux before 2.33) would make
  every worker fail to start: the command then runs without it."""
  monkeypatch.setattr(runtime, '_SETPRIV', '/bin/false')
  runtime._setpriv_works.cache_clear()  # pylint: disable=protected-access
  try:
    assert runtime._worker_command(['w', '--port=1']) == ['w', '--port=1']  # pylint: disable=protected-access
  finally:
    monkeypatch.undo()
    runtime._setpriv_works.cache_clear()  # pylint: disable=protected-access
  # Where setpriv works (as here: checked by the test itself, not by the
  # code under test), workers get the parent-death signal.
  command = runtime._worker_command(['w'])  # pylint: disable=protected-access
  setpriv = shutil.which('setpriv')
  works = setpriv is not None and subprocess.run(
      [setpriv, '--pdeathsig', 'KILL', '--', 'true'],
      capture_output=True, check=False).returncode == 0
  if works:
    assert command == [setpriv, '--pdeathsig', 'KILL', '--', 'w']
  else:
    assert command == ['w']


def test_a_computation_compiles_once_for_every_context(monkeypatch):
  """TFF compiles per context; `runtime.compiled` once per interpreter:
  the default context made again (as each in-process run does) and two
  `--workers` contexts calling at once reuse the first compilation, and
  still compute."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from fedcg_tff.execution import workers  # pylint: disable=g-import-not-at-top

  native = tff.backends.native.desugar_and_transform_to_native
  compiled = []

  def counted(comp):
    compiled.append(comp)
    return native(comp)

  monkeypatch.setattr(tff.backends.native, 'desugar_and_transform_to_native',
                      counted)

  @tff.tensorflow.computation(np.int32)
  def plus_41(x):  # A computation no other test compiles.
    return x + 41

  @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
  def on_clients(x):
    return tff.federated_map(plus_41, x)

  for _ in range(2):
    runtime.set_local_cpp_context()
    assert on_clients([1, 2]) == [42, 43]
  assert len(compiled) == 1
  # The workers' contexts compile natively (secure sums kept): one more
  # compilation, shared by both shards' threads.
  with workers.Workers.local(2) as pool:
    assert pool.map_clients(on_clients, (), ([1, 2, 3],)) == [42, 43, 44]
  assert len(compiled) == 2
