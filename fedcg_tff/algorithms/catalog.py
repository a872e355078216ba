"""Every algorithm of the paper's Table 1 by name: one place to build them."""

import functools
from typing import Optional

import numpy as np

from fedcg_tff.algorithms import baselines_process_tff
from fedcg_tff.algorithms import fedcg_process_tff
from fedcg_tff.algorithms import round_tff
from fedcg_tff.config import FedCGConfig
from fedcg_tff.execution import devices
from fedcg_tff.program import client_store
from fedcg_tff.program import driver

ALGORITHMS = (*baselines_process_tff.ALGORITHMS, 'fedcg')


def needs_server_images(algorithm: str) -> bool:
  """Whether `algorithm` distils on unlabeled server data (FedDF)."""
  return algorithm == 'feddf'


def build_process(algorithm: str, config: FedCGConfig,
                  aggregation_factory=None,
                  server_images: Optional[np.ndarray] = None,
                  server_images_dir: Optional[str] = None,
                  upload_updates: bool = False,
                  timed: bool = False) -> round_tff.RoundProcess:
  """`algorithm`'s iterative process (`round_tff.RoundProcess`).

  `upload_updates` (fedavg, fedprox, fedsplit, fedcg): clients upload
  their round's update rather than their weights, for a DP
  `aggregation_factory` (`dp.mean_factory`) that must clip and noise
  updates. `server_images`
  (FedDF): its unlabeled server data. `timed` (FedCG): phase stamps for
  binaries/benchmark.py.
  """
  if algorithm not in ALGORITHMS:
    raise ValueError(f'algorithm must be one of {ALGORITHMS}, '
                     f'got {algorithm!r}')
  if timed and algorithm != 'fedcg':
    raise ValueError(f'timed applies to fedcg, not {algorithm!r}')
  if (aggregation_factory is None and server_images is None and
      server_images_dir is None):
    return _plain_process(algorithm, config.validate(), upload_updates,
                          timed, devices.training_device())
  return _build(algorithm, config, aggregation_factory, server_images,
                server_images_dir, upload_updates, timed)


@functools.cache
def _plain_process(algorithm: str, config: FedCGConfig, upload_updates: bool,
                   timed: bool, device: Optional[str]
                   ) -> round_tff.RoundProcess:
  """A process without an aggregator or data of its own, built once per
  interpreter for an equal config: it holds computations and no state (each
  driver keeps its own), and tracing one is most of what starting a run
  costs (a tiny FedCG process: 10-15 s on the slowest host). A script or
  test that runs several runs of one config in one interpreter traces it
  once; code that patches what a process traces must build it anew
  (`fedcg_process_tff`, `baselines_process_tff`). `device` is part of the
  key: the steps are traced under `devices.scope()`."""
  del device
  return _build(algorithm, config, None, None, None, upload_updates, timed)


def _build(algorithm, config, aggregation_factory, server_images,
           server_images_dir, upload_updates, timed) -> round_tff.RoundProcess:
  if algorithm == 'fedcg':
    return fedcg_process_tff.build_fedcg_process(config, aggregation_factory,
                                                 timed, upload_updates)
  return baselines_process_tff.build_baseline_process(
      config, algorithm, aggregation_factory, server_images=server_images,
      server_images_dir=server_images_dir, upload_updates=upload_updates)


def build(algorithm: str,
          config: FedCGConfig,
          num_clients: int,
          server_images: Optional[np.ndarray] = None,
          aggregation_factory=None,
          server_images_dir: Optional[str] = None,
          sampling: Optional[client_store.ClientSampling] = None,
          upload_updates: bool = False,
          workers=None, on_timing=None, timed: bool = False
          ) -> driver.Driver:
  """The driver of `algorithm` for `round_loop.run` (`build_process`'s
  process); `sampling`: clients per round and where client states live
  (default: all clients, in memory); `workers`, `on_timing`: how rounds run
  (`driver.Driver`)."""
  process = build_process(algorithm, config, aggregation_factory,
                          server_images, server_images_dir, upload_updates,
                          timed)
  return driver.Driver(config, num_clients, process, sampling=sampling,
                       workers=workers, on_timing=on_timing)
