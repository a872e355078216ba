"""FedCG as a `tff.templates.IterativeProcess`: placement and wiring only.

The math lives in `fedcg_tf.py`; this module wraps those functions in
`tff.tensorflow.computation`s and places them:

  server: draw (z, y) for this round's distillation from the round number
  broadcast: G_g, C_g, round number, (z, y)                  SERVER -> CLIENTS
  clients: stage 1, stage 2, teacher logits C_i(G_i(z, y))
  aggregate: weighted mean of (G_i, C_i, teacher logits)     CLIENTS -> SERVER
  server: distil the mean teacher into the averaged (G_g, C_g)

The private extractor E_i lives in the CLIENTS-placed client state, which is
an input and an output of `next` and never an argument of a broadcast or an
aggregation (`tests/fedcg_tff_test.py` checks the type signatures).

Since the teacher `softmax(sum_i w_i C_i(G_i(z, y)))` is a weighted mean of
per-client logits on server-chosen (z, y), it is computed by the clients and
aggregated like the weights: the server never holds one client's generator.
"""

import functools
from typing import Optional

import attrs
import numpy as np
import tensorflow_federated as tff

from fedcg_tff import fedcg_tf
from fedcg_tff.config import FedCGConfig
from fedcg_tff.networks import IMAGE_SIZE


@attrs.define(frozen=True)
class RoundMetrics:
  server: object  # fedcg_tf.ServerMetrics @ SERVER
  aggregator: object  # the aggregation process's measurements @ SERVER
  clients: object  # fedcg_tf.ClientMetrics @ CLIENTS


def batch_type(config: FedCGConfig) -> tff.types.StructType:
  """The type of one (images, labels) batch of a client dataset."""
  return tff.types.to_type((
      tff.TensorType(np.float32,
                     [None, IMAGE_SIZE, IMAGE_SIZE, config.image_channels]),
      tff.TensorType(np.int32, [None]),
  ))


@functools.lru_cache
def _init_client_computation(config: FedCGConfig) -> tff.Computation:
  """`seed -> ClientState` (unplaced); its result type is the client state's."""
  return tff.tensorflow.computation(
      lambda seed: fedcg_tf.initial_client_state(config, seed), np.int64)


@functools.lru_cache
def _evaluate_client_computation(config: FedCGConfig) -> tff.Computation:
  state_type = _init_client_computation(config).type_signature.result
  data_type = tff.SequenceType(batch_type(config))

  @tff.tensorflow.computation(state_type, data_type, data_type)
  def evaluate_client(state, val_data, test_data):
    return fedcg_tf.evaluate_client(
        fedcg_tf.Networks(config), state, val_data, test_data)

  return evaluate_client


class FedCGComputations:
  """The TF computations of FedCG for one config, and the types they fix."""

  def __init__(self, config: FedCGConfig,
               aggregation_factory: tff.aggregators.WeightedAggregationFactory):
    self.config = config.validate()
    self.data_type = tff.SequenceType(batch_type(config))

    self.client_state_type = (
        _init_client_computation(config).type_signature.result)

    @tff.tensorflow.computation(np.int32)
    def distill_inputs(round_num):
      return fedcg_tf.distillation_inputs(config, round_num)

    self.distill_inputs = distill_inputs
    zy_type = distill_inputs.type_signature.result

    @tff.tensorflow.computation
    def init_server_weights():
      return fedcg_tf.initial_server_state(config, aggregator_state=())

    weights_state = init_server_weights.type_signature.result
    upload_type = tff.types.to_type(fedcg_tf.ClientUpload(
        generator=weights_state.generator,
        classifier=weights_state.classifier,
        teacher_logits=tff.TensorType(
            np.float32, [config.distill_samples, config.num_classes]),
    ))
    self.aggregator = aggregation_factory.create(
        upload_type, tff.TensorType(np.float32))
    aggregator_state_type = self.aggregator.initialize.type_signature.result

    @tff.tensorflow.computation(aggregator_state_type.member)
    def init_server(aggregator_state):
      return fedcg_tf.initial_server_state(config, aggregator_state)

    self.init_server = init_server
    self.server_state_type = init_server.type_signature.result

    @tff.tensorflow.computation(self.server_state_type, zy_type)
    def server_message(state, zy):
      noise, labels = zy
      return fedcg_tf.ServerMessage(
          generator=state.generator, classifier=state.classifier,
          round_num=state.round_num, distill_noise=noise,
          distill_labels=labels)

    self.server_message = server_message

    @tff.tensorflow.computation(server_message.type_signature.result,
                                self.client_state_type, self.data_type)
    def client_update(message, state, dataset):
      return fedcg_tf.client_update(
          fedcg_tf.Networks(config), message, state, dataset)

    self.client_update = client_update

    @tff.tensorflow.computation(
        self.server_state_type, aggregator_state_type.member, upload_type,
        zy_type)
    def server_update(state, aggregator_state, averaged, zy):
      noise, labels = zy
      return fedcg_tf.server_update(
          fedcg_tf.Networks(config), state, aggregator_state, averaged, noise,
          labels)

    self.server_update = server_update


def build_fedcg_process(
    config: FedCGConfig,
    aggregation_factory: Optional[
        tff.aggregators.WeightedAggregationFactory] = None,
) -> tff.templates.IterativeProcess:
  """FedCG as an iterative process.

  `initialize()` returns the server state (G_g, C_g, server optimizer state,
  aggregator state, round number). `next(server_state, client_states,
  client_data)` runs one round and returns `(server_state, client_states,
  RoundMetrics)`; client states come from `build_client_state_initializer`.
  `aggregation_factory` (default: weighted mean) aggregates what the clients
  share, so DP or secure aggregation from `tff.aggregators` plug in here.
  """
  comps = FedCGComputations(
      config, aggregation_factory or tff.aggregators.MeanFactory())
  aggregator = comps.aggregator

  @tff.federated_computation
  def initialize():
    return tff.federated_map(comps.init_server, aggregator.initialize())

  @tff.federated_computation(
      tff.FederatedType(comps.server_state_type, tff.SERVER),
      tff.FederatedType(comps.client_state_type, tff.CLIENTS),
      tff.FederatedType(comps.data_type, tff.CLIENTS))
  def next_fn(server_state, client_states, client_data):
    zy = tff.federated_map(comps.distill_inputs, server_state.round_num)
    message = tff.federated_broadcast(
        tff.federated_map(comps.server_message, (server_state, zy)))
    outputs = tff.federated_map(comps.client_update,
                                (message, client_states, client_data))
    aggregated = aggregator.next(server_state.aggregator_state,
                                 outputs.upload, outputs.weight)
    new_server_state, server_metrics = tff.federated_map(
        comps.server_update,
        (server_state, aggregated.state, aggregated.result, zy))
    metrics = RoundMetrics(server=server_metrics,
                           aggregator=aggregated.measurements,
                           clients=outputs.metrics)
    return new_server_state, outputs.state, metrics

  return tff.templates.IterativeProcess(initialize, next_fn)


def build_client_state_initializer(
    config: FedCGConfig) -> tff.Computation:
  """`(seeds@CLIENTS) -> client_states@CLIENTS`: each client's E, C, D and
  optimizer states drawn from its own int64 seed, on the client."""
  init_client = _init_client_computation(config.validate())

  @tff.federated_computation(tff.FederatedType(np.int64, tff.CLIENTS))
  def initialize_clients(seeds):
    return tff.federated_map(init_client, seeds)

  return initialize_clients


def build_evaluation(config: FedCGConfig) -> tff.Computation:
  """`(client_states, val_data, test_data)@CLIENTS -> EvalMetrics@CLIENTS`:
  each client's accuracy of E_i then C_i on its validation and test data."""
  evaluate_client = _evaluate_client_computation(config.validate())
  state_type, data_type, _ = evaluate_client.type_signature.parameter

  @tff.federated_computation(
      tff.FederatedType(state_type, tff.CLIENTS),
      tff.FederatedType(data_type, tff.CLIENTS),
      tff.FederatedType(data_type, tff.CLIENTS))
  def evaluate(client_states, val_data, test_data):
    return tff.federated_map(evaluate_client,
                             (client_states, val_data, test_data))

  return evaluate


def client_seeds(config: FedCGConfig, num_clients: int) -> list[int]:
  """Each client's private seed, derived from the run's seed."""
  return [config.seed * 1000 + i + 1 for i in range(num_clients)]


class FedCGAlgorithm:
  """Drives the FedCG process for `experiment.run`: holds the server state
  and (in this simulation) the list of client states between rounds."""

  def __init__(self, config: FedCGConfig, num_clients: int,
               aggregation_factory=None):
    self.config = config.validate()
    self.process = build_fedcg_process(config, aggregation_factory)
    self._evaluate = build_evaluation(config)
    self.server_state = self.process.initialize()
    self.client_states = build_client_state_initializer(config)(
        client_seeds(config, num_clients))

  def run_round(self, round_num: int, train_data: list) -> dict[str, float]:
    del round_num  # The server state counts rounds.
    self.server_state, self.client_states, metrics = self.process.next(
        self.server_state, self.client_states, train_data)
    out = {f'server/{k}': float(v)
           for k, v in attrs.asdict(metrics.server).items()}
    per_client = [attrs.asdict(m) for m in metrics.clients]
    for i, m in enumerate(per_client):
      for k, v in m.items():
        out[f'client_{i}/{k}'] = float(v)
    for k in per_client[0]:
      out[f'mean/{k}'] = float(np.mean([m[k] for m in per_client]))
    return out

  def evaluate(self, val_data: list, test_data: list):
    results = self._evaluate(self.client_states, val_data, test_data)
    return ([float(r.val_accuracy) for r in results],
            [float(r.test_accuracy) for r in results])
