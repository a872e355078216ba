"""Clients spread over several TFF workers: same round, bit for bit."""

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
import tensorflow as tf
import tensorflow_federated as tff
import tree

from fedcg_tff.execution import precision
from fedcg_tff.execution import round_runner
from fedcg_tff.execution import runtime
from fedcg_tff.execution import workers
from fedcg_tff.program import driver
from tests import binary_runs
from tests import built

TINY = built.TINY
NUM_CLIENTS = 3  # Uneven shards on two workers: 1 + 2 (or 2 + 1).


def _data(seed, n=16):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 32, 32, 1)).astype(np.float32)
  y = rng.integers(0, 10, n).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


def _leaves(structure):
  return [np.asarray(v) for v in tree.flatten(structure)]


def _assert_identical(a, b):
  left, right = _leaves(a), _leaves(b)
  assert len(left) == len(right)
  for x, y in zip(left, right):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)


def test_shards_are_contiguous_and_cover_every_client():
  assert workers.shards(5, 2) in ([range(0, 2), range(2, 5)],
                                  [range(0, 3), range(3, 5)])
  assert workers.shards(2, 4) == [range(0, 1), range(1, 2)]
  for n, w in ((7, 3), (100, 8), (1, 1)):
    parts = workers.shards(n, w)
    assert [i for p in parts for i in p] == list(range(n))


@pytest.fixture(scope='module')
def two_workers():
  pool = workers.Workers.local(2)
  yield pool
  started = runtime.worker_processes()
  pool.close()
  # The pool's two workers stopped with it (the default context's did not).
  deadline = time.time() + 10
  while len(_running(started)) > len(started) - 2 and time.time() < deadline:
    time.sleep(0.1)
  assert len(_running(started)) == len(started) - 2, started


def _running(processes):
  return [p for p in processes if binary_runs.alive(p.pid)]


def _cpu_by_pid():
  """CPU seconds used so far by each TFF worker of this process."""
  return {p.pid: sum(p.cpu_times()[:2]) for p in runtime.worker_processes()}


def _grew(before, after, minimum=0.1):
  """The workers that used `minimum` CPU seconds more (new ones: in all)."""
  return {pid for pid, t in after.items() if t - before.get(pid, 0.0) >
          minimum}


def _pool_workers_that_ran_clients(start, before, after):
  """The pool's workers that ran clients between `before` and `after`,
  where the default context's one worker ran the same round's clients
  alone between `start` and `before`. A worker counts when it used half
  of one client's CPU time in that single-worker round, not a fixed
  number of seconds: a one-client shard of 384 images used 0.07 CPU s on
  an AMD EPYC host with AVX-512 (one of 128 used 0.09 s on an AVX2 host),
  while an idle worker uses 0.01-0.02 s."""
  default_context = _grew(start, before)
  assert len(default_context) == 1, default_context  # Its one worker.
  per_client = sum(before[p] - start.get(p, 0.0)
                   for p in default_context) / NUM_CLIENTS
  return _grew(before, after, minimum=per_client / 2) - default_context


@pytest.mark.parametrize('name', ['fedcg', 'local'])
def test_two_workers_give_the_single_worker_round(name, two_workers):
  algorithm = built.built_driver(name, TINY, NUM_CLIENTS)
  process = algorithm.process
  server, clients = algorithm.state()
  data = [_data(i) for i in range(NUM_CLIENTS)]
  sharded = round_runner.RoundRunner(process.parts, two_workers)

  start = _cpu_by_pid()
  expected = process.next(server, clients, data)
  before = _cpu_by_pid()
  got = sharded(server, clients, data)
  if name == 'fedcg':  # Seconds of work per client: clearly measurable.
    # Both of the pool's workers trained clients: a pool that ran every
    # shard on one worker (or in the default context) fails this.
    ran = _pool_workers_that_ran_clients(start, before, _cpu_by_pid())
    assert len(ran) == 2, ran
  _assert_identical(expected, got)
  # The round did something: client states moved.
  assert any(not np.array_equal(a, b) for a, b in
             zip(_leaves(clients), _leaves(got[1])))
  # Two rounds in a row stay identical too.
  _assert_identical(process.next(*expected[:2], data),
                    sharded(*got[:2], data))


@pytest.fixture(scope='module')
def fedavg_process():
  return built.process('fedavg', TINY)


def test_driver_spreads_its_rounds_over_the_workers(two_workers,
                                                    fedavg_process):
  single = driver.Driver(TINY, NUM_CLIENTS, fedavg_process)
  spread = driver.Driver(TINY, NUM_CLIENTS, fedavg_process,
                         workers=two_workers)
  assert spread.runner.workers is two_workers
  # 1024 images a client: half a client's CPU time stays well above an
  # idle worker's (`_pool_workers_that_ran_clients`).
  data = [_data(i, n=1024) for i in range(NUM_CLIENTS)]
  start = _cpu_by_pid()
  metrics = single.run_round(0, data)
  before = _cpu_by_pid()
  assert spread.run_round(0, data) == metrics
  # Both of the pool's workers ran clients: a driver that kept the pool
  # but ran its rounds in the default context fails this.
  ran = _pool_workers_that_ran_clients(start, before, _cpu_by_pid())
  assert len(ran) == 2, ran
  _assert_identical(single.state(), spread.state())


def _free_port():
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def test_remote_worker_by_address(fedavg_process):
  port = _free_port()
  server = subprocess.Popen(
      [sys.executable, '-m', 'binaries.run_worker', f'--port={port}'],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    pool = workers.Workers.remote([f'localhost:{port}'])
    served_by = runtime.worker_processes(server.pid)
    assert len(served_by) == 1, served_by
    algorithm = driver.Driver(TINY, NUM_CLIENTS, fedavg_process)
    server_state, clients = algorithm.state()
    # Enough images that a round's CPU time stands well above an idle
    # worker's (0.01-0.02 s) and the clock's 0.01 s ticks.
    data = [_data(i, n=256) for i in range(NUM_CLIENTS)]
    # The round here first (a second time: the default context's worker
    # started and warm), then on the remote worker, which must have done
    # about that much work: the same results alone would not show that the
    # round ran there.
    fedavg_process.next(server_state, clients, data)
    start = _cpu_by_pid()
    expected = fedavg_process.next(server_state, clients, data)
    here = sum(t - start.get(p, 0.0) for p, t in _cpu_by_pid().items())
    remote_cpu = lambda: sum(served_by[0].cpu_times()[:2])
    before = remote_cpu()
    _assert_identical(expected, round_runner.RoundRunner(
        fedavg_process.parts, pool)(server_state, clients, data))
    there = remote_cpu() - before
    assert there > here / 2, (there, here)
  finally:
    server.terminate()
    assert server.wait(timeout=20) is not None
  # The worker binary run_worker started went with it (its pid was taken
  # while run_worker lived: a worker left behind would no longer be its).
  deadline = time.time() + 10
  while _running(served_by) and time.time() < deadline:
    time.sleep(0.2)
  assert not _running(served_by)


def test_a_local_worker_computes_in_float32_here():
  """This process's default context: its worker inherits no fpmath setting
  (conftest keeps it so), so the probe finds float32 products there."""
  from tensorflow_federated.python.core.impl.context_stack import context_stack_impl  # pylint: disable=g-import-not-at-top
  assert not workers.rounds_products(
      context_stack_impl.context_stack.current)


@pytest.mark.skipif(not precision.has_bfloat16_arithmetic(),
                    reason='this host has no bfloat16 arithmetic')
def test_remote_worker_of_the_other_precision_is_refused():
  """A worker started with --matmul_precision=bfloat16, reached from this
  float32 process: refused, naming the address and what to restart."""
  port = _free_port()
  server = subprocess.Popen(
      [sys.executable, '-m', 'binaries.run_worker', f'--port={port}',
       '--matmul_precision=bfloat16'],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    with pytest.raises(ConnectionError, match=(
        f'the TFF worker at localhost:{port} rounds products to bfloat16 '
        r'\(started with --matmul_precision=bfloat16\), this run is '
        f'float32: restart it with binaries/run_worker.py --port={port}$')):
      workers.Workers.remote([f'localhost:{port}'])
  finally:
    server.terminate()
    assert server.wait(timeout=20) is not None


def test_unreachable_address_is_named(monkeypatch):
  monkeypatch.setattr(workers, 'CONNECT_TIMEOUT_SECONDS', 0.5)
  address = f'localhost:{_free_port()}'
  with pytest.raises(ConnectionError, match=address):
    workers.remote_context(address)


COUNT_TO = 300_000  # About a second of a scalar loop in a worker.


@pytest.fixture(scope='module')
def counting():
  """Each client counts to its number, in a scalar loop (seconds)."""

  @tff.tensorflow.computation(np.int32)
  def count(n):
    return tf.while_loop(lambda i: i < n, lambda i: (i + 1,), (0,))[0]

  @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
  def each(ns):
    return tff.federated_map(count, ns)

  return each


def _serve(port, popen=runtime.WorkerPopen):
  """A bare TFF worker serving at `port` (a remote worker, without
  run_worker's interpreter start). `WorkerPopen` gives it the parent-death
  signal of the calling thread: started from a thread that ends, use
  `subprocess.Popen`."""
  return popen([
      os.path.join(os.path.dirname(tff.__file__), 'data', 'worker_binary'),
      f'--port={port}', '--max_concurrent_computation_calls=2'])


def _kill_when_computing(pid):
  """SIGKILLs process `pid`, from another thread, once it has used 0.2 CPU
  seconds more than now: it is in the middle of a call."""
  process = psutil.Process(pid)
  start = _cpu(process)

  def kill():
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      if _cpu(process) - start > 0.2:
        process.kill()
        return
      time.sleep(0.02)

  thread = threading.Thread(target=kill, daemon=True)
  thread.start()
  return thread


def _cpu(process):
  try:
    return sum(process.cpu_times()[:2])
  except psutil.NoSuchProcess:
    return 0.0


def test_remote_worker_lost_mid_round_is_said_and_named_then_rejoins(
    counting, monkeypatch):
  """A remote worker killed in the middle of a call: the pool says so,
  gives up after lost_worker_timeout naming the address, and once a worker
  serves there again the next call gives the right results and the pool
  says the worker answers again."""
  monkeypatch.setattr(workers, 'PROBE_SECONDS', 0.2)
  monkeypatch.setattr(workers, 'PROBE_TIMEOUT_SECONDS', 1.5)
  monkeypatch.setattr(workers, 'CLOSE_TIMEOUT_SECONDS', 0.5)
  port = _free_port()
  address = f'localhost:{port}'
  first = _serve(port)
  second = None
  rescued = []
  lines = []
  pool = workers.Workers.remote([address], lost_worker_timeout=1.0,
                                log=lines.append)
  try:
    assert pool.map_clients(counting, (), ([5, 7],)) == [5, 7]
    killer = _kill_when_computing(first.pid)
    # Should the pool never give up, a worker started after 60 s ends the
    # call: the test then fails instead of hanging.
    rescue = threading.Timer(
        60, lambda: rescued.append(_serve(port, subprocess.Popen)))
    rescue.start()
    with pytest.raises(workers.WorkerLost, match=address):
      pool.map_clients(counting, (), ([COUNT_TO, COUNT_TO + 1],))
    rescue.cancel()
    killer.join()
    assert len(lines) == 1, lines
    assert f'the TFF worker at {address} did not answer' in lines[0]
    assert f'--port={port}' in lines[0]
    assert 'gives up after 1 s' in lines[0]
    second = _serve(port)
    assert workers.answers(address, 60)
    assert pool.map_clients(counting, (), ([COUNT_TO + 2, 3],)) == [
        COUNT_TO + 2, 3]
    assert len(lines) == 2, lines
    assert f'the TFF worker at {address} answers again after' in lines[1]
  finally:
    pool.close()
    for process in (first, second, *rescued):
      if process is not None and process.poll() is None:
        process.kill()
        process.wait()


def test_silence_is_counted_within_a_call_and_forgotten_after_one_ends(
    monkeypatch):
  """A check that fails while a call ends leaves nothing behind (no
  'answers again' in a later call), and a worker silent since an earlier
  call is given up on only lost_worker_timeout into this one."""
  monkeypatch.setattr(workers, 'PROBE_SECONDS', 0.05)
  lines = []
  pool = workers.Workers([object()], ['host:1'], lost_worker_timeout=0.5,
                         log=lines.append)
  try:
    ending = concurrent.futures.Future()

    def fails_as_the_call_ends(address, timeout):
      del address, timeout
      ending.set_result([])
      return False

    monkeypatch.setattr(workers, 'answers', fails_as_the_call_ends)
    pool._wait([ending])  # pylint: disable=protected-access
    assert len(lines) == 1 and 'did not answer' in lines[0], lines
    monkeypatch.setattr(workers, 'answers', lambda address, timeout: True)
    later = concurrent.futures.Future()
    threading.Timer(0.3, later.set_result, ([],)).start()
    pool._wait([later])  # pylint: disable=protected-access
    assert len(lines) == 1, lines

    monkeypatch.setattr(workers, 'answers', lambda address, timeout: False)
    pool._silent_since['host:1'] = time.monotonic() - 100  # pylint: disable=protected-access
    start = time.monotonic()
    with pytest.raises(workers.WorkerLost, match='host:1'):
      pool._wait([concurrent.futures.Future()])  # pylint: disable=protected-access
    assert time.monotonic() - start >= 0.5
  finally:
    pool.close()


def test_local_worker_killed_mid_call_is_replaced_with_the_same_results(
    counting, capfd):
  """TFF replaces a local worker that dies in the middle of a call and
  runs the call again; runtime says which worker died and how."""
  before = {p.pid for p in runtime.worker_processes()}
  pool = workers.Workers.local(1)
  try:
    assert pool.map_clients(counting, (), ([5],)) == [5]
    ours = [p for p in runtime.worker_processes() if p.pid not in before]
    assert len(ours) == 1, ours
    capfd.readouterr()
    killer = _kill_when_computing(ours[0].pid)
    assert pool.map_clients(counting, (), ([COUNT_TO],)) == [COUNT_TO]
    killer.join()
    assert not binary_runs.alive(ours[0].pid)
    err = capfd.readouterr().err
    assert (f'the local TFF worker (pid {ours[0].pid}) was killed by '
            'SIGKILL') in err, err
  finally:
    pool.close()


_SLOW_SHARDS = textwrap.dedent('''
    import sys
    sys.path.insert(0, {root!r})
    import numpy as np
    import tensorflow as tf
    import tensorflow_federated as tff
    from fedcg_tff.execution import runtime
    from fedcg_tff.execution import workers
    runtime.set_local_cpp_context()

    @tff.tensorflow.computation(np.float32)
    def slow(x):  # Minutes of a scalar loop.
      return tf.while_loop(lambda i, v: i < 10**9,
                           lambda i, v: (i + 1, v + 1.0), (0, x))[1]

    @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
    def each(xs):
      return tff.federated_map(slow, xs)

    pool = workers.Workers.local(2, max_concurrent_computation_calls=1)
    print('STARTED', flush=True)
    pool.map_clients(each, (), ([1.0, 2.0],))
''')


def test_sigterm_mid_round_on_two_workers_stops_at_once():
  """SIGTERM while both workers run a shard: the process exits within
  seconds and its workers with it, not when the shards end (a
  ThreadPoolExecutor's threads made the exit wait for them)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  proc = subprocess.Popen(
      [sys.executable, '-c', _SLOW_SHARDS.format(root=binary_runs.ROOT)],
      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
  try:
    assert proc.stdout.readline() == b'STARTED\n'
    deadline = time.time() + 60
    while len(runtime.worker_processes(proc.pid)) < 2:
      assert time.time() < deadline, 'the workers did not start'
      time.sleep(0.2)
    started = runtime.worker_processes(proc.pid)
    time.sleep(2)  # Both shards are computing.
    stop = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert time.monotonic() - stop < 15
  finally:
    binary_runs.kill_tree(proc)
  assert not _running(started)
