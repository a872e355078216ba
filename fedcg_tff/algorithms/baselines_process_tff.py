"""The baselines as `tff.templates.IterativeProcess`es: placement and wiring.

One builder serves all six; the `baselines_tf.Baseline` description decides
what a round moves between placements:

  local      nothing: each client trains alone; only the server's round
             counter advances.
  fedavg     broadcast (E, C); weighted mean of the clients' (E_i, C_i).
  fedprox    same movement as fedavg.
  fedsplit   broadcast C; weighted mean of the C_i. E_i never leaves.
  feddf      as fedavg, and the server also gathers each (E_i, C_i) with its
             n_i to form the teacher ensemble on its unlabeled data.
  fedgen     broadcast C and G; weighted mean of the C_i, and each C_i with
             its n_i gathered for the generator's ensemble. E_i never leaves.

The weighted mean goes through a `tff.aggregators` factory (default
`MeanFactory`), so DP or secure aggregation plug in as for FedCG.

Every baseline's round is `round_tff.build_round_process` with
`baselines_tf`'s functions. FedDF's unlabeled server data is read inside the
server's update from a file (`baselines_tf.write_server_images`; only its
path is in the graph), so that `next` keeps the signature of every other
algorithm and the images are not re-serialised into the computation each
round.
"""

import dataclasses
import os
import tempfile
from typing import Optional

import numpy as np
import tensorflow_federated as tff

from fedcg_tff.algorithms import baselines_tf
from fedcg_tff.algorithms import round_tff
from fedcg_tff.config import FedCGConfig

ALGORITHMS = tuple(baselines_tf.BASELINES)
# The baselines that only average, which can upload updates instead of
# weights (for DP aggregation: privacy/dp.py).
UPDATE_ALGORITHMS = ('fedavg', 'fedprox', 'fedsplit')


def _baseline(algorithm: str, upload_updates: bool) -> baselines_tf.Baseline:
  if algorithm not in baselines_tf.BASELINES:
    raise ValueError(f'algorithm must be one of {ALGORITHMS}, '
                     f'got {algorithm!r}')
  baseline = baselines_tf.BASELINES[algorithm]
  if not upload_updates:
    return baseline
  if baseline.name not in UPDATE_ALGORITHMS:
    raise ValueError(f'upload_updates applies to {UPDATE_ALGORITHMS} (which '
                     f'only average), not {baseline.name!r}')
  return dataclasses.replace(baseline, upload_update=True)


def build_baseline_process(
    config: FedCGConfig,
    algorithm: str,
    aggregation_factory: Optional[
        tff.aggregators.WeightedAggregationFactory] = None,
    server_images: Optional[np.ndarray] = None,
    server_images_dir: Optional[str] = None,
    upload_updates: bool = False,
) -> round_tff.RoundProcess:
  """The baseline `algorithm` ('local', 'fedavg', ...) as an iterative process.

  `next(server_state, client_states, client_data)` returns
  `(server_state, client_states, round_tff.RoundMetrics)`, as FedCG's does.
  `server_images` (FedDF only): unlabeled server images, float32 NHWC, that
  are written to `server_images_dir` (default: a temporary directory that
  lives as long as the process) for the server's update to read.
  `upload_updates`: clients upload their round's update instead of their
  weights (`baselines_tf.Baseline.upload_update`; fedavg, fedprox and
  fedsplit), so that a DP aggregator clips and noises updates.
  """
  config = config.validate()
  baseline = _baseline(algorithm, upload_updates)
  resources = ()
  path = None
  if baseline.server_distillation:
    if server_images is None:
      raise ValueError('feddf needs server_images (unlabeled server data)')
    if server_images_dir is None:
      tmp = tempfile.TemporaryDirectory(prefix='feddf_server_')
      resources, server_images_dir = (tmp,), tmp.name
    path = baselines_tf.write_server_images(
        server_images, os.path.join(server_images_dir, 'server_images.tf'),
        config.image_size)

  def train(message, state, dataset):
    return baselines_tf.client_update(
        baselines_tf.PartyNetworks(config, baseline.client_networks),
        baseline, message, state, dataset)

  def update_server(state, aggregator_state, averaged, collected):
    values, weights = collected if collected is not None else (None, None)
    images = (baselines_tf.read_server_images(path, config)
              if baseline.server_distillation else None)
    return baselines_tf.server_update(
        baselines_tf.PartyNetworks(config, baseline.server_networks),
        baseline, state, aggregator_state, averaged, values, weights, images)

  # The argument lists `round_tff.build_round_process` calls them with.
  if not baseline.communicates:
    client_update = lambda state, dataset: train(None, state, dataset)
    server_update = baselines_tf.advance_round
  elif baseline.collects_client_models:
    client_update = train
    server_update = update_server
  else:
    client_update = train
    server_update = lambda state, aggregator_state, averaged: update_server(
        state, aggregator_state, averaged, None)

  return round_tff.build_round_process(
      config,
      initial_server_state=lambda aggregator_state: (
          baselines_tf.initial_server_state(config, baseline,
                                            aggregator_state)),
      initial_client_state=lambda seed: baselines_tf.initial_client_state(
          config, seed),
      upload_example=lambda: baselines_tf.upload_example(config, baseline),
      server_message=(baselines_tf.server_message if baseline.communicates
                      else None),
      client_update=client_update,
      server_update=server_update,
      collect=baseline.collects_client_models,
      aggregation_factory=aggregation_factory,
      resources=resources)
