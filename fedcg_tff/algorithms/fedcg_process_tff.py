"""FedCG as a `tff.templates.IterativeProcess`: placement and wiring only.

The math lives in `fedcg_tf.py`; this module wraps those functions in
`tff.tensorflow.computation`s and places them:

  server: draw (z, y) for this round's distillation from the round number
  broadcast: G_g, C_g, round number, (z, y)                  SERVER -> CLIENTS
  clients: stage 1, stage 2, teacher logits C_i(G_i(z, y))
  aggregate: weighted mean of (G_i, C_i, teacher logits)     CLIENTS -> SERVER
  server: distil the mean teacher into the averaged (G_g, C_g)

`next` is built as two federated computations, the clients' step (the
server's draw, the broadcast and the clients' training) and the server's
step (aggregation and distillation; it redraws the same (z, y) from the
round number), composed by `round_parts`, so that `workers.ShardedRound`
can spread the clients over several TFF workers with the same results.

The private extractor E_i lives in the CLIENTS-placed client state, which is
an input and an output of `next` and never an argument of a broadcast or an
aggregation (`tests/fedcg_process_tff_test.py` checks the type signatures).

Since the teacher `softmax(sum_i w_i C_i(G_i(z, y)))` is a weighted mean of
per-client logits on server-chosen (z, y), it is computed by the clients and
aggregated like the weights: the server never holds one client's generator.
"""

import functools
from typing import Optional

import numpy as np
import tensorflow_federated as tff

from fedcg_tff.algorithms import fedcg_tf
from fedcg_tff.algorithms import round_tff
from fedcg_tff.config import FedCGConfig
from fedcg_tff.execution import devices
from fedcg_tff.program import client_store
from fedcg_tff.program import driver


@functools.lru_cache
def init_client_computation(config: FedCGConfig) -> tff.Computation:
  """`seed -> ClientState` (unplaced); its result type is the client state's."""
  return tff.tensorflow.computation(
      lambda seed: fedcg_tf.initial_client_state(config, seed), np.int64)


class FedCGComputations:
  """The TF computations of FedCG for one config, and the types they fix."""

  def __init__(self, config: FedCGConfig,
               aggregation_factory: tff.aggregators.WeightedAggregationFactory,
               timed: bool = False):
    self.config = config.validate()
    self.data_type = round_tff.data_type(config)
    self.client_state_type = (
        init_client_computation(config).type_signature.result)

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
      with devices.scope():
        return fedcg_tf.client_update(
            fedcg_tf.PartyNetworks(config), message, state, dataset, timed)

    self.client_update = client_update

    @tff.tensorflow.computation(
        self.server_state_type, aggregator_state_type.member, upload_type,
        zy_type)
    def server_update(state, aggregator_state, averaged, zy):
      noise, labels = zy
      with devices.scope():
        return fedcg_tf.server_update(
            fedcg_tf.PartyNetworks(config, fedcg_tf.SERVER_NETWORKS), state,
            aggregator_state, averaged, noise, labels)

    self.server_update = server_update


def build_fedcg_process(
    config: FedCGConfig,
    aggregation_factory: Optional[
        tff.aggregators.WeightedAggregationFactory] = None,
    timed: bool = False,
) -> tff.templates.IterativeProcess:
  """FedCG as an iterative process.

  `initialize()` returns the server state (G_g, C_g, server optimizer state,
  aggregator state, round number). `next(server_state, client_states,
  client_data)` runs one round and returns `(server_state, client_states,
  round_tff.RoundMetrics)`; client states come from
  `round_tff.build_client_state_initializer(init_client_computation(...))`.
  `aggregation_factory` (default: weighted mean) aggregates what the clients
  share, so DP or secure aggregation from `tff.aggregators` plug in here.
  `timed` (binaries/benchmark.py) adds phase timestamps to the clients'
  outputs (`fedcg_tf.ClientOutput.times`).
  """
  comps = FedCGComputations(
      config, aggregation_factory or tff.aggregators.MeanFactory(), timed)
  aggregator = comps.aggregator

  @tff.federated_computation
  def initialize():
    return tff.federated_map(comps.init_server, aggregator.initialize())

  parameter_types = round_tff.next_parameter_types(
      config, comps.server_state_type, comps.client_state_type)
  server_state_type, client_states_type, data_type = parameter_types

  @tff.federated_computation(server_state_type, client_states_type, data_type)
  def clients_step(server_state, client_states, client_data):
    zy = tff.federated_map(comps.distill_inputs, server_state.round_num)
    message = tff.federated_broadcast(
        tff.federated_map(comps.server_message, (server_state, zy)))
    return tff.federated_map(comps.client_update,
                             (message, client_states, client_data))

  outputs_type = clients_step.type_signature.result.member

  @tff.federated_computation(
      server_state_type, tff.FederatedType(outputs_type.upload, tff.CLIENTS),
      tff.FederatedType(outputs_type.weight, tff.CLIENTS))
  def server_step(server_state, uploads, weights):
    # The same (z, y) as the clients' step drew: keyed by the round number.
    zy = tff.federated_map(comps.distill_inputs, server_state.round_num)
    aggregated = aggregator.next(server_state.aggregator_state, uploads,
                                 weights)
    new_server_state, server_metrics = tff.federated_map(
        comps.server_update,
        (server_state, aggregated.state, aggregated.result, zy))
    return new_server_state, server_metrics, aggregated.measurements

  return round_tff.RoundProcess(
      initialize, round_tff.RoundParts(clients_step, server_step),
      parameter_types)


class FedCGAlgorithm(driver.ProcessAlgorithm):
  """FedCG driven round by round for `round_loop.run`."""

  def __init__(self, config: FedCGConfig, num_clients: int,
               aggregation_factory=None,
               sampling: Optional[client_store.ClientSampling] = None):
    config = config.validate()
    super().__init__(config, num_clients,
                     build_fedcg_process(config, aggregation_factory),
                     init_client_computation(config), sampling)
