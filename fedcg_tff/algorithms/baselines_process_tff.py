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

FedDF's unlabeled server data is read inside the server's computation from a
file written by `write_server_images` (only its path is in the graph), so
that `next` keeps the signature of every other algorithm and the images are
not re-serialised into the computation each round.
"""

import dataclasses
import functools
import os
import tempfile
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from fedcg_tff.algorithms import aggregators_tff
from fedcg_tff.algorithms import baselines_tf
from fedcg_tff.algorithms import round_tff
from fedcg_tff.config import FedCGConfig
from fedcg_tff.execution import devices
from fedcg_tff.program import client_store
from fedcg_tff.program import driver

ALGORITHMS = tuple(baselines_tf.BASELINES)


@functools.lru_cache
def init_client_computation(config: FedCGConfig) -> tff.Computation:
  """`seed -> ClientState` (unplaced), the same for every baseline."""
  return tff.tensorflow.computation(
      lambda seed: baselines_tf.initial_client_state(config, seed), np.int64)


def _baseline(algorithm: str) -> baselines_tf.Baseline:
  if algorithm not in baselines_tf.BASELINES:
    raise ValueError(f'algorithm must be one of {ALGORITHMS}, '
                     f'got {algorithm!r}')
  return baselines_tf.BASELINES[algorithm]


# The baselines that only average, which can upload updates instead of
# weights (for DP aggregation: privacy/dp.py).
UPDATE_ALGORITHMS = ('fedavg', 'fedprox', 'fedsplit')


def _with_updates(baseline: baselines_tf.Baseline, upload_updates: bool
                  ) -> baselines_tf.Baseline:
  if not upload_updates:
    return baseline
  if baseline.name not in UPDATE_ALGORITHMS:
    raise ValueError(f'upload_updates applies to {UPDATE_ALGORITHMS} (which '
                     f'only average), not {baseline.name!r}')
  return dataclasses.replace(baseline, upload_update=True)


def write_server_images(images: np.ndarray, path: str,
                        image_size: int = 32) -> str:
  """Writes FedDF's server images (float32 NHWC, preprocessed as the
  clients' inputs) where the server's computation reads them
  (`tf.io.serialize_tensor` format); returns `path`."""
  images = np.asarray(images, np.float32)
  if images.ndim != 4 or images.shape[1:3] != (image_size, image_size):
    raise ValueError(f'server images must be [n, {image_size}, {image_size}, '
                     f'channels], got shape {images.shape}')
  if not len(images):
    raise ValueError('FedDF needs at least one server image')
  tmp = path + '.tmp'
  tf.io.write_file(tmp, tf.io.serialize_tensor(images))
  os.replace(tmp, path)
  return path


def _read_server_images(path: str, config: FedCGConfig):
  images = tf.io.parse_tensor(tf.io.read_file(path), tf.float32)
  images.set_shape([None, config.image_size, config.image_size,
                    config.image_channels])
  return images


def build_baseline_process(
    config: FedCGConfig,
    algorithm: str,
    aggregation_factory: Optional[
        tff.aggregators.WeightedAggregationFactory] = None,
    server_images_path: Optional[str] = None,
    upload_updates: bool = False,
) -> tff.templates.IterativeProcess:
  """The baseline `algorithm` ('local', 'fedavg', ...) as an iterative process.

  `next(server_state, client_states, client_data)` returns
  `(server_state, client_states, round_tff.RoundMetrics)`, as FedCG's does.
  `server_images_path` (FedDF only): a file from `write_server_images`.
  `upload_updates`: clients upload their round's update instead of their
  weights (`baselines_tf.Baseline.upload_update`; fedavg, fedprox and
  fedsplit), so that a DP aggregator clips and noises updates.
  """
  config = config.validate()
  baseline = _with_updates(_baseline(algorithm), upload_updates)
  if baseline.server_distillation and not server_images_path:
    raise ValueError('feddf needs server_images_path (unlabeled server data)')
  client_nets = lambda: baselines_tf.PartyNetworks(config, baseline.client_networks)
  server_nets = lambda: baselines_tf.PartyNetworks(config, baseline.server_networks)
  data_type = round_tff.data_type(config)
  client_state_type = init_client_computation(config).type_signature.result

  @tff.tensorflow.computation
  def init_weights():
    return baselines_tf.initial_server_state(config, baseline, ())

  upload_type = init_weights.type_signature.result.shared
  aggregator = (aggregation_factory or tff.aggregators.MeanFactory()).create(
      upload_type, tff.TensorType(np.float32))
  aggregator_state_type = aggregator.initialize.type_signature.result.member

  @tff.tensorflow.computation(aggregator_state_type)
  def init_server(aggregator_state):
    return baselines_tf.initial_server_state(config, baseline,
                                             aggregator_state)

  server_state_type = init_server.type_signature.result

  @tff.federated_computation
  def initialize():
    return tff.federated_map(init_server, aggregator.initialize())

  if not baseline.communicates:
    return _build_local_process(config, baseline, initialize,
                                server_state_type, client_state_type)

  @tff.tensorflow.computation(server_state_type)
  def server_message(state):
    return baselines_tf.ServerMessage(shared=state.shared,
                                      generator=state.generator,
                                      round_num=state.round_num)

  @tff.tensorflow.computation(server_message.type_signature.result,
                              client_state_type, data_type)
  def client_update(message, state, dataset):
    with devices.scope():
      return baselines_tf.client_update(client_nets(), baseline, message,
                                        state, dataset)

  collect = (aggregators_tff.build_collect(upload_type)
             if baseline.collects_client_models else None)
  if collect is None:

    @tff.tensorflow.computation(server_state_type, aggregator_state_type,
                                upload_type)
    def server_update(state, aggregator_state, averaged):
      return baselines_tf.server_update(server_nets(), baseline, state,
                                        aggregator_state, averaged)

  else:
    stacked_type = aggregators_tff.stacked_type(
        aggregators_tff.weighted_type(upload_type))

    @tff.tensorflow.computation(server_state_type, aggregator_state_type,
                                upload_type, stacked_type)
    def server_update(state, aggregator_state, averaged, collected):
      values, weights = collected
      images = (_read_server_images(server_images_path, config)
                if baseline.server_distillation else None)
      return baselines_tf.server_update(
          server_nets(), baseline, state, aggregator_state, averaged, values,
          weights, images)

  parameter_types = round_tff.next_parameter_types(
      config, server_state_type, client_state_type)

  @tff.federated_computation(*parameter_types)
  def clients_step(server_state, client_states, client_data):
    message = tff.federated_broadcast(
        tff.federated_map(server_message, server_state))
    return tff.federated_map(client_update,
                             (message, client_states, client_data))

  outputs_type = clients_step.type_signature.result.member

  @tff.federated_computation(
      parameter_types[0], tff.FederatedType(outputs_type.upload, tff.CLIENTS),
      tff.FederatedType(outputs_type.weight, tff.CLIENTS))
  def server_step(server_state, uploads, weights):
    aggregated = aggregator.next(server_state.aggregator_state, uploads,
                                 weights)
    update_args = (server_state, aggregated.state, aggregated.result)
    if collect is not None:
      update_args += (collect(uploads, weights),)
    new_server_state, server_metrics = tff.federated_map(server_update,
                                                         update_args)
    return new_server_state, server_metrics, aggregated.measurements

  return round_tff.RoundProcess(
      initialize, round_tff.RoundParts(clients_step, server_step),
      parameter_types)


def _build_local_process(config, baseline, initialize, server_state_type,
                         client_state_type):
  """Local: the clients train alone; no value crosses a placement."""
  data_type = round_tff.data_type(config)

  @tff.tensorflow.computation(client_state_type, data_type)
  def client_update(state, dataset):
    with devices.scope():
      output = baselines_tf.client_update(
          baselines_tf.PartyNetworks(config, baseline.client_networks), baseline,
          None, state, dataset)
    # Nothing is uploaded: the round's parts keep the common shape with an
    # empty upload and a zero weight that the server's step ignores.
    return baselines_tf.ClientOutput(state=output.state, upload=(),
                                     weight=tf.constant(0.0),
                                     metrics=output.metrics)

  @tff.tensorflow.computation(server_state_type)
  def advance_round(state):
    return baselines_tf.ServerState(
        shared=state.shared, generator=state.generator,
        optimizer_state=state.optimizer_state,
        aggregator_state=state.aggregator_state,
        round_num=state.round_num + 1)

  parameter_types = round_tff.next_parameter_types(
      config, server_state_type, client_state_type)

  @tff.federated_computation(*parameter_types)
  def clients_step(server_state, client_states, client_data):
    del server_state  # Local clients get nothing from the server.
    return tff.federated_map(client_update, (client_states, client_data))

  outputs_type = clients_step.type_signature.result.member

  @tff.federated_computation(
      parameter_types[0], tff.FederatedType(outputs_type.upload, tff.CLIENTS),
      tff.FederatedType(outputs_type.weight, tff.CLIENTS))
  def server_step(server_state, uploads, weights):
    del uploads, weights  # Empty: see client_update.
    return tff.federated_map(advance_round, server_state), (), ()

  return round_tff.RoundProcess(
      initialize, round_tff.RoundParts(clients_step, server_step),
      parameter_types)


class BaselineAlgorithm(driver.ProcessAlgorithm):
  """A baseline driven round by round for `round_loop.run`.

  `server_images` (FedDF only): unlabeled server images, float32 NHWC; they
  are written to `server_images_dir` (default: a temporary directory removed
  when this object is) for the server's computation to read.
  """

  def __init__(self, config: FedCGConfig, algorithm: str, num_clients: int,
               aggregation_factory=None, server_images=None,
               server_images_dir: Optional[str] = None,
               sampling: Optional[client_store.ClientSampling] = None,
               upload_updates: bool = False):
    config = config.validate()
    baseline = _baseline(algorithm)
    path = None
    if baseline.server_distillation:
      if server_images is None:
        raise ValueError('feddf needs server_images (unlabeled server data)')
      if server_images_dir is None:
        self._tmp = tempfile.TemporaryDirectory(prefix='feddf_server_')
        server_images_dir = self._tmp.name
      path = write_server_images(
          server_images, os.path.join(server_images_dir, 'server_images.tf'),
          config.image_size)
    process = build_baseline_process(config, algorithm, aggregation_factory,
                                     path, upload_updates)
    super().__init__(config, num_clients, process,
                     init_client_computation(config), sampling)
