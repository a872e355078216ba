"""Clients of a round spread over several TFF C++ workers.

TFF's own way to split a computation over workers, the mergeable-computation
context, does not fit a round that returns CLIENTS-placed client states
(ours all do): in TFF 0.87 it re-runs the clients' work after the merge to
produce them, and it concatenates the parts of a CLIENTS-placed result in
the order the workers *finish*, so client states come back permuted
(`MergeableCompExecutionContext._run_in_async_context_pool`). So each
algorithm's round is also built as two federated computations
(`round_tff.RoundParts`): the clients' step, which needs nothing from other
clients, and the server's step, which aggregates. `Workers.map_clients`
runs the clients' step on contiguous shards of the clients, one shard per
worker and all at once, and puts the per-client outputs back in client
order; `round_runner.RoundRunner` then runs the server's step in the default
context. `next` is defined as exactly that composition, so a sharded round
gives bit-for-bit what `next` gives.

Workers are TFF's C++ `worker_binary`: local ones are started (and, through
`execution.runtime`, stopped) by this process; remote ones are reached by
address (`binaries/run_worker.py` starts one on another machine).

A worker that dies in the middle of a call costs time, not results: TFF
retries the call (with backoff up to 30 s between tries) until a worker
answers, and the call runs again from its start on the same inputs. A
local worker is restarted by TFF itself (`execution.runtime` says so); a
remote one must be restarted at its address by whoever runs it, and until
then TFF retries without end. So while a round waits for remote workers,
`Workers` checks that each still answers, says when one stops answering
and when it answers again, and with `lost_worker_timeout` gives up on one
silent for that long (`WorkerLost`).
"""

import concurrent.futures
import functools
import gc
import queue
import threading
import time
from typing import Callable, Sequence

import grpc
import numpy as np
import tensorflow_federated as tff
from tensorflow_federated.python.core.impl.context_stack import context_stack_impl
from tensorflow_federated.python.core.impl.executor_stacks import executor_factory
from tensorflow_federated.python.core.impl.executor_stacks import python_executor_stacks
from tensorflow_federated.python.core.impl.executors import remote_executor
from tensorflow_federated.python.core.impl.executors import remote_executor_grpc_stub

from fedcg_tff.execution import precision
from fedcg_tff.execution import runtime

CONNECT_TIMEOUT_SECONDS = 20.0
# How often a round that waits for remote workers checks that they answer,
# and how long one check waits for an answer.
PROBE_SECONDS = 10.0
PROBE_TIMEOUT_SECONDS = 5.0
# How long `Workers.close` waits for a context's thread; one still retrying
# a call to a lost remote worker is a daemon and is left to the exit.
CLOSE_TIMEOUT_SECONDS = 10.0
# gRPC waits up to 120 s between attempts to reconnect a channel whose
# server went away, and until it reconnects TFF's retries fail at once: a
# remote worker restarted after a long outage would be used only that
# long after. At most 10 s instead.
RECONNECT_OPTIONS = (('grpc.max_reconnect_backoff_ms', 10_000),)


class WorkerLost(ConnectionError):
  """A remote worker did not answer for `lost_worker_timeout` seconds in
  the middle of a round."""


def answers(address: str, timeout: float) -> bool:
  """Whether a gRPC server (a TFF worker, for our addresses) completes a
  connection at `address` within `timeout` seconds; on a new channel, so
  that the check shares nothing with TFF's."""
  channel = grpc.insecure_channel(address)
  try:
    grpc.channel_ready_future(channel).result(timeout=timeout)
    return True
  except grpc.FutureTimeoutError:
    return False
  finally:
    channel.close()


def local_contexts(count: int,
                   max_concurrent_computation_calls: int | None = None):
  """`count` execution contexts, each with its own local worker process
  (started on first use, stopped at exit by `fedcg_tff.runtime`) running
  at most `max_concurrent_computation_calls` clients at once (None: its
  share of this machine's cores)."""
  if max_concurrent_computation_calls is None:
    max_concurrent_computation_calls = runtime.default_concurrency(count)
  # One compilation of each computation for all of them
  # (`runtime.compiled`).
  return [runtime.local_context(max_concurrent_computation_calls)
          for _ in range(count)]


def remote_context(address: str):
  """An execution context on the worker serving at `address` ('host:port').

  Raises ConnectionError naming the address if no worker answers there
  within CONNECT_TIMEOUT_SECONDS (TFF itself would retry forever).
  """
  if not answers(address, CONNECT_TIMEOUT_SECONDS):
    raise ConnectionError(
        f'no TFF worker answered at {address!r} within '
        f'{CONNECT_TIMEOUT_SECONDS:.0f}s (start one there with '
        f'binaries/run_worker.py{precision.worker_flag()})')
  channel = grpc.insecure_channel(
      address,
      [*executor_factory._GRPC_CHANNEL_OPTIONS, *RECONNECT_OPTIONS])  # pylint: disable=protected-access
  stub = remote_executor_grpc_stub.RemoteExecutorGrpcStub(channel)

  def stack_fn(cardinalities):
    executor = remote_executor.RemoteExecutor(stub)
    executor.set_cardinalities(cardinalities)
    return executor

  return runtime.compiling_context(
      python_executor_stacks.ResourceManagingExecutorFactory(
          executor_stack_fn=stack_fn),
      secure_as_plain=False)


# A product whose bfloat16 route rounds to about 2e-3 relative where the
# worker lets oneDNN round (TF_SET_ONEDNN_FPMATH_MODE=BF16) and to about
# 1e-6 where it does not (tests/bfloat16_products_test.py).
ROUNDING_THRESHOLD = 1e-4


@functools.cache
def _rounding_probe() -> tff.Computation:
  """A computation returning, for each client value (one is enough), the
  relative error of a [64, 1024] by [1024, 512] product on
  `small_conv.matmul`'s bfloat16 route, against float64: how the worker
  that runs it treats the route. Placed on CLIENTS: a remote worker takes
  computations with a clients cardinality only."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from fedcg_tff.models import small_conv  # pylint: disable=g-import-not-at-top

  @tff.tensorflow.computation(np.float32)
  def probe(offset):
    a = tf.random.stateless_normal([64, 1024], [0, 1]) + offset
    b = tf.random.stateless_normal([1024, 512], [0, 2])
    exact = tf.matmul(tf.cast(a, tf.float64), tf.cast(b, tf.float64))
    routed = tf.cast(small_conv.matmul(a, b, bfloat16=True), tf.float64)
    return (tf.reduce_max(tf.abs(routed - exact)) /
            tf.reduce_max(tf.abs(exact)))

  @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
  def on_clients(offsets):
    return tff.federated_map(probe, offsets)

  return on_clients


def rounds_products(context) -> bool:
  """Whether the TFF worker behind `context` rounds the bfloat16 route's
  products: whether its process was started with the setting
  (`execution.precision`)."""
  with context_stack_impl.context_stack.install(context):
    (error,) = _rounding_probe()([0.0])
  return float(error) > ROUNDING_THRESHOLD


def check_precision(context, address: str) -> None:
  """Raises ConnectionError if the remote worker at `address` does not
  compute in this process's precision (a worker is set up by its own
  `binaries/run_worker --matmul_precision`, and a run's record would
  otherwise not say what computed it)."""
  wanted = bool(precision.worker_flag())
  if rounds_products(context) == wanted:
    return
  port = address.rpartition(':')[2]
  if wanted:
    raise ConnectionError(
        f'the TFF worker at {address} computes in float32, this run in '
        f'bfloat16: restart it with binaries/run_worker.py --port={port} '
        '--matmul_precision=bfloat16')
  raise ConnectionError(
      f'the TFF worker at {address} rounds products to bfloat16 '
      '(started with --matmul_precision=bfloat16), this run is float32: '
      f'restart it with binaries/run_worker.py --port={port}')


def shards(num_clients: int, num_workers: int) -> list[range]:
  """Contiguous, nearly equal client ranges, one per worker (empty ones
  dropped): client order is kept when the shards' outputs are joined."""
  bounds = np.linspace(0, num_clients, num_workers + 1).round().astype(int)
  return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


class _ContextThread:
  """One daemon thread that makes every call in one execution context, for
  the pool's whole life.

  A daemon, so that an exit (SIGTERM, Ctrl-C: `SystemExit` or
  `KeyboardInterrupt` in the main thread) does not wait for a shard in
  progress, which a `ThreadPoolExecutor`'s threads make it do (the
  interpreter joins them before its exit handlers run): the exit handler
  then stops the workers (`fedcg_tff.execution.runtime`). A local worker
  is started by TFF from its context's own event-loop thread (a daemon
  that lives as long as the context), so its parent-death signal does not
  depend on this thread."""

  def __init__(self, context):
    self.context = context
    self._calls = queue.SimpleQueue()
    self._thread = threading.Thread(target=self._serve, daemon=True,
                                    name='fedcg-worker-context')
    self._thread.start()

  def _serve(self):
    while True:
      call = self._calls.get()
      if call is None:
        return
      fn, future = call
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(self.context))
        except BaseException as e:  # pylint: disable=broad-except
          future.set_exception(e)
      # While the thread waits, it holds nothing of a round: the call's
      # arguments are every client state and dataset of it.
      del call, fn, future

  def submit(self, fn) -> concurrent.futures.Future:
    """`fn(context)` on this thread."""
    future = concurrent.futures.Future()
    self._calls.put((fn, future))
    return future

  def close(self) -> None:
    """Ends the thread after the calls submitted before, waiting at most
    CLOSE_TIMEOUT_SECONDS (a call TFF retries for a lost remote worker
    may never end)."""
    self._calls.put(None)
    self._thread.join(CLOSE_TIMEOUT_SECONDS)


class Workers:
  """A pool of execution contexts that runs one computation per client
  shard, all shards at once (one daemon thread per context,
  `_ContextThread`: TFF's context stack is thread-local, so each thread
  installs its worker's context)."""

  def __init__(self, contexts: Sequence,
               addresses: Sequence[str | None] | None = None,
               lost_worker_timeout: float = 0.0,
               log: Callable[[str], None] = print):
    """`addresses[i]`: the address of remote context i (None: a local one),
    checked while a round waits for it; `lost_worker_timeout`: seconds a
    remote worker may stay silent in a round before `WorkerLost` (0: no
    limit); `log`: where the checks report."""
    if not contexts:
      raise ValueError('Workers needs at least one execution context')
    if lost_worker_timeout < 0:
      raise ValueError(f'lost_worker_timeout must be >= 0, got '
                       f'{lost_worker_timeout}')
    self.contexts = list(contexts)
    self.addresses = list(addresses or [None] * len(self.contexts))
    if len(self.addresses) != len(self.contexts):
      raise ValueError('one address (or None) per context')
    self.lost_worker_timeout = lost_worker_timeout
    self._log = log
    # When each silent remote worker was first found silent; kept across
    # calls, so that a call after `WorkerLost` says when it answers again.
    self._silent_since = {}
    self._threads = [_ContextThread(c) for c in self.contexts]

  @classmethod
  def local(cls, count: int,
            max_concurrent_computation_calls: int | None = None):
    return cls(local_contexts(count, max_concurrent_computation_calls))

  @classmethod
  def remote(cls, addresses: Sequence[str], lost_worker_timeout: float = 0.0,
             log: Callable[[str], None] = print):
    """Workers serving at `addresses`; ConnectionError naming the first
    that does not answer or does not compute in this process's precision
    (`check_precision`)."""
    contexts = [remote_context(a) for a in addresses]
    for context, address in zip(contexts, addresses):
      check_precision(context, address)
    return cls(contexts, addresses, lost_worker_timeout, log)

  def __len__(self) -> int:
    return len(self.contexts)

  def close(self) -> None:
    """Stops the pool's threads and drops its contexts. A dropped local
    context's worker process stops (TFF stops it when the context is
    collected, bounded by `fedcg_tff.runtime`); remote workers keep serving.
    Anything left stops at exit anyway."""
    for thread in self._threads:
      thread.close()
    self._threads.clear()
    self.contexts.clear()
    gc.collect()  # Contexts sit in reference cycles.

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()

  def map_clients(self, comp: tff.Computation, shared: tuple,
                  per_client: tuple) -> list:
    """`comp(*shared, *[arg[shard] for arg in per_client])` for each shard
    on its own worker; the shards' CLIENTS-placed results (lists) joined in
    client order."""
    num_clients = len(per_client[0])

    def run(context, shard):
      with context_stack_impl.context_stack.install(context):
        return list(comp(*shared, *[[arg[i] for i in shard]
                                    for arg in per_client]))

    futures = [thread.submit(functools.partial(run, shard=shard))
               for thread, shard in zip(
                   self._threads, shards(num_clients, len(self.contexts)))]
    self._wait(futures)
    joined = []
    for future in futures:
      joined.extend(future.result())
    return joined

  def _wait(self, futures) -> None:
    """Waits for the shards; every PROBE_SECONDS, checks that the remote
    workers still computing one answer (see the module's docstring).
    A worker is given up on after `lost_worker_timeout` seconds silent in
    this call (checked at each probe, so up to about PROBE_SECONDS + 2 ×
    PROBE_TIMEOUT_SECONDS later)."""
    watched = [(f, a) for f, a in zip(futures, self.addresses) if a]
    silent_since = self._silent_since
    call_start = time.monotonic()
    while concurrent.futures.wait(futures, timeout=PROBE_SECONDS).not_done:
      for future, address in watched:
        if future.done():
          continue
        now = time.monotonic()
        if answers(address, PROBE_TIMEOUT_SECONDS):
          if address in silent_since:
            self._log(f'the TFF worker at {address} answers again after '
                      f'{now - silent_since.pop(address):.0f} s; if it had '
                      f'stopped, its clients of this round run again from '
                      f'their start (same results)')
        elif address not in silent_since:
          silent_since[address] = now
          port = address.rpartition(':')[2]
          limit = (f'; the run gives up after {self.lost_worker_timeout:g} '
                   f's (--lost_worker_timeout)'
                   if self.lost_worker_timeout else '')
          self._log(f'the TFF worker at {address} did not answer a check '
                    f'within {PROBE_TIMEOUT_SECONDS:g} s; if it has '
                    f'stopped, TFF retries its clients of this round until '
                    f'a worker serves there again (binaries/run_worker.py '
                    f'--port={port}{precision.worker_flag()} on that '
                    f'machine), with the same '
                    f'results{limit}')
        elif self.lost_worker_timeout:
          silent = now - max(silent_since[address], call_start)
          if silent >= self.lost_worker_timeout:
            raise WorkerLost(
                f'the TFF worker at {address} did not answer for '
                f'{silent:.0f} s in the middle of a round '
                f'(--lost_worker_timeout={self.lost_worker_timeout:g})')
    # A call that completed shows its worker answering.
    for future, address in watched:
      if future.exception() is None:
        silent_since.pop(address, None)
