"""Every algorithm of the paper's Table 1 by name: one place to build them."""

from typing import Optional

import numpy as np

from fedcg_tff.algorithms import baselines_process_tff
from fedcg_tff.algorithms import fedcg_process_tff
from fedcg_tff.config import FedCGConfig
from fedcg_tff.program import client_store
from fedcg_tff.program import driver

ALGORITHMS = (*baselines_process_tff.ALGORITHMS, 'fedcg')


def needs_server_images(algorithm: str) -> bool:
  """Whether `algorithm` distils on unlabeled server data (FedDF)."""
  return algorithm == 'feddf'


def build(algorithm: str,
          config: FedCGConfig,
          num_clients: int,
          server_images: Optional[np.ndarray] = None,
          aggregation_factory=None,
          server_images_dir: Optional[str] = None,
          sampling: Optional[client_store.ClientSampling] = None,
          upload_updates: bool = False
          ) -> driver.ProcessAlgorithm:
  """The driver of `algorithm` for `round_loop.run`; `sampling`: clients per
  round and where client states live (default: all clients, in memory).

  `upload_updates` (fedavg, fedprox, fedsplit): clients upload their
  round's update rather than their weights, for a DP `aggregation_factory`
  (`dp.mean_factory`) that must clip and noise updates.
  """
  if algorithm not in ALGORITHMS:
    raise ValueError(f'algorithm must be one of {ALGORITHMS}, '
                     f'got {algorithm!r}')
  if algorithm == 'fedcg':
    if upload_updates:
      raise ValueError('upload_updates applies to '
                       f'{baselines_process_tff.UPDATE_ALGORITHMS}, not fedcg')
    return fedcg_process_tff.FedCGAlgorithm(config, num_clients, aggregation_factory,
                                    sampling=sampling)
  return baselines_process_tff.BaselineAlgorithm(
      config, algorithm, num_clients, aggregation_factory,
      server_images=server_images, server_images_dir=server_images_dir,
      sampling=sampling, upload_updates=upload_updates)
