"""A round as two federated steps, so its clients can be spread over workers.

Every algorithm's round has the same shape: the server prepares and
broadcasts a message, each client trains on its own data, and the server
aggregates what the clients upload and updates itself. `RoundParts` holds
the round as

  clients_step(server_state@SERVER, client_states@CLIENTS,
               client_data@CLIENTS) -> ClientOutput@CLIENTS
  server_step(server_state@SERVER, uploads@CLIENTS, weights@CLIENTS)
      -> (new server state, server metrics, aggregator measurements)@SERVER

where a ClientOutput has `state`, `upload`, `weight` and `metrics`.
`compose_next` builds the process's `next` from exactly these two calls, and
`workers.ShardedRound` runs the same two calls with the clients' step split
over several TFF workers: both give the same result, bit for bit.
"""

import attrs
import tensorflow_federated as tff

from fedcg_tff import process_tff


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
    metrics = process_tff.RoundMetrics(server=server_metrics,
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
