"""The tests' tiny config, and drivers on the processes built for it.

Tracing a process is most of what a test of it costs (FedCG's tiny process:
about 14 s on this machine kind), and several modules build the same
algorithm with an equal config. `catalog.build_process` builds a process
without an aggregator or data of its own once per interpreter (one pytest
worker); sharing it changes no result, as a process holds computations
only, no state, and each test makes its own driver and states. Processes
built with extra arguments (aggregators, server data) are not shared.
"""

from fedcg_tff.algorithms import catalog
from fedcg_tff.config import FedCGConfig
from fedcg_tff.program import driver


# The tiny config of the process tests (baselines, FedCG, workers, client
# sampling): one config, so that they share the processes.
TINY = FedCGConfig(batch_size=8, local_epochs=1, gan_epochs=1,
                   server_epochs=1, server_steps_per_epoch=3)


def process(algorithm: str, config: FedCGConfig):
  """`catalog.build_process(algorithm, config)`: built once per
  interpreter."""
  return catalog.build_process(algorithm, config)


def built_driver(algorithm: str, config: FedCGConfig, num_clients: int,
                 **driver_args) -> driver.Driver:
  """A fresh driver (fresh states) on the shared process: what
  `catalog.build(algorithm, config, num_clients)` gives."""
  return driver.Driver(config, num_clients, process(algorithm, config),
                       **driver_args)
