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

import functools
from typing import Callable, Optional

import attrs
import numpy as np
import tensorflow_federated as tff

from fedcg_tff.algorithms import aggregators_tff
from fedcg_tff.algorithms import training_tf
from fedcg_tff.config import FedCGConfig
from fedcg_tff.execution import devices


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
    with devices.scope():
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
    metrics = RoundMetrics(server=server_metrics, aggregator=measurements,
                           clients=outputs.metrics)
    return new_server_state, outputs.state, metrics

  return next_fn


class RoundProcess(tff.templates.IterativeProcess):
  """An algorithm's iterative process, whose `next` is `compose_next(parts)`,
  with what a driver needs beside it: `parts` (to run the two steps apart,
  on several workers), `initialize_clients` (`seeds@CLIENTS ->
  client_states@CLIENTS`), `evaluate` (`build_evaluation`, built when first
  used: tracing it costs a network build that a process which only trains
  or is only inspected does not need) and the client state's type.
  `resources` keeps alive what the computations read (FedDF's server-image
  file)."""

  def __init__(self, initialize_fn, parts: RoundParts, parameter_types,
               initialize_clients: tff.Computation, config: FedCGConfig,
               resources: tuple = ()):
    super().__init__(initialize_fn, compose_next(parts, parameter_types))
    self.parts = parts
    self.initialize_clients = initialize_clients
    self.client_state_type = initialize_clients.type_signature.result.member
    self.resources = resources
    self._config = config

  @functools.cached_property
  def evaluate(self) -> tff.Computation:
    return build_evaluation(self._config, self.client_state_type)


def _on_training_device(fn: Callable) -> Callable:
  """`fn` traced under `devices.scope()` (--device): every algorithm's
  client and server steps, placed in this one place."""

  @functools.wraps(fn)  # TFF reads the parameters through __wrapped__.
  def placed(*args, **kwargs):
    with devices.scope():
      return fn(*args, **kwargs)

  return placed


def build_round_process(
    config: FedCGConfig,
    *,
    initial_server_state: Callable,
    initial_client_state: Callable,
    upload_example: Callable,
    client_update: Callable,
    server_update: Callable,
    server_message: Optional[Callable] = None,
    round_inputs: Optional[Callable] = None,
    collect: bool = False,
    aggregation_factory: Optional[
        tff.aggregators.WeightedAggregationFactory] = None,
    resources: tuple = (),
) -> RoundProcess:
  """The round of an algorithm given as plain-TF functions, placed: the one
  builder of FedCG, the baselines and Local.

  The functions (each traced once into a `tff.tensorflow.computation` with
  the types this builder derives):

    initial_server_state(aggregator_state) -> server state (with
        `aggregator_state` and a 0-based `round_num`)
    initial_client_state(seed) -> client state (`seed`: int64, the
        client's private seed)
    upload_example() -> tensors shaped as one client's upload (only the
        type is used: it sizes the aggregator)
    server_message(server_state[, round_inputs]) -> the broadcast message;
        None: nothing is broadcast and nothing uploaded (Local), and then
        client_update(client_state, dataset) and server_update(server_state)
        -> server_state (the round advances)
    client_update(message, client_state, dataset) -> ClientOutput (`state`,
        `upload`, `weight`, `metrics`)
    server_update(server_state, aggregator_state, aggregate[, collected]
        [, round_inputs]) -> (server state, server metrics): `aggregate` is
        the aggregator's result over the uploads; `collected` (with
        `collect`) every upload stacked with its weight
        (`aggregators_tff.build_collect`)
    round_inputs(round_num) -> values the server draws from the round
        number (FedCG's distillation noise and labels); both steps redraw
        them, so the clients' step and the server's step need not pass them.

  `aggregation_factory` (default `tff.aggregators.MeanFactory`) weighs the
  uploads by the clients' weights: DP or secure aggregation plug in here,
  for an algorithm whose server needs only that mean. With `collect` the
  server also gathers every upload as it is, which no factory protects,
  so another factory is refused rather than seeming to protect them.
  """
  client_update = _on_training_device(client_update)
  server_update = _on_training_device(server_update)
  if collect and aggregation_factory is not None:
    raise ValueError(
        'aggregation_factory: this algorithm\'s server gathers every '
        'client\'s upload as it is (FedDF\'s and FedGen\'s single models), '
        'which a DP or secure aggregator of the mean would not protect')
  config = config.validate()
  seq = data_type(config)
  init_client = tff.tensorflow.computation(initial_client_state, np.int64)
  client_state_type = init_client.type_signature.result
  upload_type = tff.tensorflow.computation(upload_example).type_signature.result
  aggregator = (aggregation_factory or tff.aggregators.MeanFactory()).create(
      upload_type, tff.TensorType(np.float32))
  aggregator_state_type = aggregator.initialize.type_signature.result.member
  init_server = tff.tensorflow.computation(initial_server_state,
                                           aggregator_state_type)
  server_state_type = init_server.type_signature.result
  parameter_types = next_parameter_types(config, server_state_type,
                                         client_state_type)

  @tff.federated_computation
  def initialize():
    return tff.federated_map(init_server, aggregator.initialize())

  inputs_types = ()
  if round_inputs is not None:
    draw_inputs = tff.tensorflow.computation(round_inputs, np.int32)
    inputs_types = (draw_inputs.type_signature.result,)

  def drawn_inputs(server_state):
    """(round inputs@SERVER,) or ()."""
    if round_inputs is None:
      return ()
    return (tff.federated_map(draw_inputs, server_state.round_num),)

  if server_message is None:
    client_comp = tff.tensorflow.computation(client_update,
                                             client_state_type, seq)
    advance = tff.tensorflow.computation(server_update, server_state_type)

    @tff.federated_computation(*parameter_types)
    def clients_step(server_state, client_states, client_data):
      del server_state  # Nothing is broadcast.
      return tff.federated_map(client_comp, (client_states, client_data))
  else:
    message_comp = tff.tensorflow.computation(
        server_message, server_state_type, *inputs_types)
    client_comp = tff.tensorflow.computation(
        client_update, message_comp.type_signature.result,
        client_state_type, seq)

    @tff.federated_computation(*parameter_types)
    def clients_step(server_state, client_states, client_data):
      inputs = drawn_inputs(server_state)
      message = tff.federated_map(
          message_comp, (server_state, *inputs) if inputs else server_state)
      return tff.federated_map(client_comp, (
          tff.federated_broadcast(message), client_states, client_data))

  outputs_type = clients_step.type_signature.result.member
  if server_message is not None:
    aggregate_type = aggregator.next.type_signature.result.result.member
    collect_types = ()
    if collect:
      gather = aggregators_tff.build_collect(upload_type)
      collect_types = (aggregators_tff.stacked_type(
          aggregators_tff.weighted_type(upload_type)),)
    server_comp = tff.tensorflow.computation(
        server_update, server_state_type, aggregator_state_type,
        aggregate_type, *collect_types, *inputs_types)

  @tff.federated_computation(
      parameter_types[0], tff.FederatedType(outputs_type.upload, tff.CLIENTS),
      tff.FederatedType(outputs_type.weight, tff.CLIENTS))
  def server_step(server_state, uploads, weights):
    if server_message is None:
      del uploads, weights  # Empty: nothing was sent.
      return tff.federated_map(advance, server_state), (), ()
    aggregated = aggregator.next(server_state.aggregator_state, uploads,
                                 weights)
    args = (server_state, aggregated.state, aggregated.result)
    if collect:
      args += (gather(uploads, weights),)
    args += drawn_inputs(server_state)
    new_server_state, server_metrics = tff.federated_map(server_comp, args)
    return new_server_state, server_metrics, aggregated.measurements

  return RoundProcess(
      initialize, RoundParts(clients_step, server_step), parameter_types,
      initialize_clients=build_client_state_initializer(init_client),
      config=config, resources=resources)
