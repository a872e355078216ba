"""The round every algorithm runs, in TFF: its types, its two federated
steps and their composition, the client-state initializer and the
evaluation (placement and wiring only; the TF they place is in the
algorithms' `*_tf.py`).

Every algorithm is a `tff.templates.IterativeProcess` whose `next` has the
shape `next(server_state@SERVER, client_states@CLIENTS, client_data@CLIENTS)
-> (server_state@SERVER, client_states@CLIENTS, RoundMetrics)`; client states
come from a `seeds@CLIENTS -> client_states@CLIENTS` initializer and hold at
least the `extractor` and `classifier` that the shared evaluation scores.

A round is held as two federated steps (`RoundParts`):

  clients_step(server_state@SERVER, client_states@CLIENTS,
               client_data@CLIENTS) -> ClientOutput@CLIENTS
  server_step(server_state@SERVER, uploads@CLIENTS, weights@CLIENTS)
      -> (new server state, server metrics, aggregator measurements)@SERVER

where a ClientOutput has `state`, `upload`, `weight` and `metrics`.
`compose_next` builds `next` from exactly these two calls, and
`execution.workers` runs the same two calls with the clients' step split
over several TFF workers: both give the same result, bit for bit.
"""

import attrs
import numpy as np
import tensorflow_federated as tff

from fedcg_tff.algorithms import training_tf
from fedcg_tff.config import FedCGConfig


@attrs.define(frozen=True)
class RoundMetrics:
  server: object  # The algorithm's server metrics (attrs) @ SERVER, or ().
  aggregator: object  # The aggregation process's measurements @ SERVER.
  clients: object  # The algorithm's client metrics (attrs) @ CLIENTS.


def batch_type(config: FedCGConfig) -> tff.types.StructType:
  """The type of one (images, labels) batch of a client dataset."""
  return tff.types.to_type((
      tff.TensorType(np.float32, [None, config.image_size, config.image_size,
                                  config.image_channels]),
      tff.TensorType(np.int32, [None]),
  ))


def data_type(config: FedCGConfig) -> tff.SequenceType:
  return tff.SequenceType(batch_type(config))


def next_parameter_types(config: FedCGConfig,
                         server_state_type: tff.types.Type,
                         client_state_type: tff.types.Type) -> tuple:
  """The parameter types of every algorithm's `next`: server state @SERVER,
  client states @CLIENTS, client datasets @CLIENTS."""
  return (tff.FederatedType(server_state_type, tff.SERVER),
          tff.FederatedType(client_state_type, tff.CLIENTS),
          tff.FederatedType(data_type(config), tff.CLIENTS))


def build_client_state_initializer(
    init_client: tff.Computation) -> tff.Computation:
  """`(seeds@CLIENTS) -> client_states@CLIENTS` from an unplaced
  `seed -> client_state` computation: each client draws its own state."""

  @tff.federated_computation(tff.FederatedType(np.int64, tff.CLIENTS))
  def initialize_clients(seeds):
    return tff.federated_map(init_client, seeds)

  return initialize_clients


def build_evaluation(config: FedCGConfig,
                     client_state_type: tff.types.Type) -> tff.Computation:
  """`(client_states, val_data, test_data)@CLIENTS -> EvalMetrics@CLIENTS`:
  each client's accuracy of its E_i followed by its C_i."""
  seq = data_type(config)

  @tff.tensorflow.computation(client_state_type, seq, seq)
  def evaluate_client(state, val_data, test_data):
    return training_tf.evaluate_classifier(
        training_tf.PartyNetworks(config, ('extractor', 'classifier')),
        state.extractor, state.classifier,
        val_data, test_data)

  @tff.federated_computation(
      tff.FederatedType(client_state_type, tff.CLIENTS),
      tff.FederatedType(seq, tff.CLIENTS),
      tff.FederatedType(seq, tff.CLIENTS))
  def evaluate(client_states, val_data, test_data):
    return tff.federated_map(evaluate_client,
                             (client_states, val_data, test_data))

  return evaluate


@attrs.define(frozen=True)
class RoundParts:
  clients_step: tff.Computation
  server_step: tff.Computation


def compose_next(parts: RoundParts, parameter_types) -> tff.Computation:
  """`next(server_state, client_states, client_data) -> (server_state,
  client_states, RoundMetrics)` as the clients' step then the server's."""

  @tff.federated_computation(*parameter_types)
  def next_fn(server_state, client_states, client_data):
    outputs = parts.clients_step(server_state, client_states, client_data)
    new_server_state, server_metrics, measurements = parts.server_step(
        server_state, outputs.upload, outputs.weight)
    metrics = RoundMetrics(server=server_metrics,
                                       aggregator=measurements,
                                       clients=outputs.metrics)
    return new_server_state, outputs.state, metrics

  return next_fn


class RoundProcess(tff.templates.IterativeProcess):
  """An iterative process whose `next` is `compose_next(parts)`; drivers
  that spread clients over workers use `parts`."""

  def __init__(self, initialize_fn, parts: RoundParts, parameter_types):
    super().__init__(initialize_fn, compose_next(parts, parameter_types))
    self.parts = parts
