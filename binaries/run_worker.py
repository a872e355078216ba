r"""Serves TFF's C++ worker on a port, for runs on other machines to use.

On each worker machine (same pinned stack: ./setup.sh):

  .venv/bin/python -m binaries.run_worker --port=8000

(add --matmul_precision=bfloat16 for the workers of a bfloat16 run: the
setting is the worker process's; a driver of the other precision refuses
the worker when it connects)

then on the machine that drives the run:

  .venv/bin/python -m binaries.run_fedcg --worker_addresses=host1:8000,host2:8000 ...

The worker runs the clients' TensorFlow computations it is sent; the data,
client states and results travel over gRPC without encryption or
authentication (TFF's insecure channel), so use it on a trusted network or
through an SSH tunnel (`ssh -L 8000:localhost:8000 host1`). The worker stops
on Ctrl-C or SIGTERM.
"""

import os
import signal
import sys

from absl import app
from absl import flags

from binaries import common
from fedcg_tff.execution import runtime

flags.DEFINE_integer('port', 8000, 'Port the worker serves on.')
common.define_concurrency_flag()
common.define_precision_flag()
FLAGS = flags.FLAGS


def worker_binary_path() -> str:
  """The `worker_binary` shipped inside the tensorflow_federated package."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.dirname(tff.__file__), 'data', 'worker_binary')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'no TFF worker binary at {path}')
  return path


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not 0 < FLAGS.port < 65536:
    raise app.UsageError(f'--port must be in [1, 65535], got {FLAGS.port}')
  common.configure_precision()  # The worker inherits its environment.
  concurrency = FLAGS.max_concurrent_clients
  if concurrency is None:
    concurrency = runtime.default_concurrency()
  command = [worker_binary_path(), f'--port={FLAGS.port}',
             f'--max_concurrent_computation_calls={concurrency}']
  print(f'TFF worker serving on port {FLAGS.port}, '
        f'{FLAGS.matmul_precision} products', flush=True)
  worker = runtime.WorkerPopen(command)
  try:
    sys.exit(worker.wait())
  finally:
    if worker.poll() is None:  # Stopped as TFF stops its own workers.
      runtime.stop_worker_pid(worker.pid, signal.SIGINT)
      worker.wait()


if __name__ == '__main__':
  app.run(main)
