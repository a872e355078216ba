"""Processes built once per test process and shared by the tests that need
the same one.

Tracing a process is most of what a test of it costs (FedCG's tiny process:
about 14 s on this machine kind), and several modules build the same
algorithm with an equal config. A process holds computations only, no
state, so sharing one changes no result: each test makes its own driver
and states. Processes built with extra arguments (aggregators, server data)
are not cached.
"""

import functools

from fedcg_tff.algorithms import catalog
from fedcg_tff.config import FedCGConfig
from fedcg_tff.program import driver


# The tiny config of the process tests (baselines, FedCG, workers, client
# sampling): one config, so that they share the processes.
TINY = FedCGConfig(batch_size=8, local_epochs=1, gan_epochs=1,
                   server_epochs=1, server_steps_per_epoch=3)


@functools.cache
def process(algorithm: str, config: FedCGConfig):
  """`catalog.build_process(algorithm, config)`, built once."""
  return catalog.build_process(algorithm, config)


def built_driver(algorithm: str, config: FedCGConfig, num_clients: int,
                 **driver_args) -> driver.Driver:
  """A fresh driver (fresh states) on the shared process: what
  `catalog.build(algorithm, config, num_clients)` gives."""
  return driver.Driver(config, num_clients, process(algorithm, config),
                       **driver_args)
