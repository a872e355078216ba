"""FedCG as a `tff.templates.IterativeProcess`: placement and wiring only.

The math lives in `fedcg_tf.py`; `round_tff.build_round_process` places it:

  server: draw (z, y) for this round's distillation from the round number
  broadcast: G_g, C_g, round number, (z, y)                  SERVER -> CLIENTS
  clients: stage 1, stage 2, teacher logits C_i(G_i(z, y))
  aggregate: weighted mean of (G_i, C_i, teacher logits)     CLIENTS -> SERVER
  server: distil the mean teacher into the averaged (G_g, C_g)

The server's step redraws the same (z, y) from the round number, so the two
steps of the round (`round_tff.RoundParts`) need not pass them.

The private extractor E_i lives in the CLIENTS-placed client state, which is
an input and an output of `next` and never an argument of a broadcast or an
aggregation (`tests/fedcg_process_tff_test.py` checks the type signatures).

Since the teacher `softmax(sum_i w_i C_i(G_i(z, y)))` is a weighted mean of
per-client logits on server-chosen (z, y), it is computed by the clients and
aggregated like the weights: the server needs no client's generator for it
beyond the mean it already receives. (Each G_i is still an upload: with the
default plain mean the server can read it; only `--aggregation=secure`
keeps a single client's G_i from the server.)
"""

from typing import Optional

import tensorflow_federated as tff

from fedcg_tff.algorithms import fedcg_tf
from fedcg_tff.algorithms import round_tff
from fedcg_tff.config import FedCGConfig


def build_fedcg_process(
    config: FedCGConfig,
    aggregation_factory: Optional[
        tff.aggregators.WeightedAggregationFactory] = None,
    timed: bool = False,
    upload_updates: bool = False,
) -> round_tff.RoundProcess:
  """FedCG as an iterative process (`round_tff.build_round_process`).

  `initialize()` returns the server state (G_g, C_g, server optimizer state,
  aggregator state, round number). `next(server_state, client_states,
  client_data)` runs one round and returns `(server_state, client_states,
  round_tff.RoundMetrics)`; client states come from
  `process.initialize_clients(seeds)`. `aggregation_factory` (default:
  weighted mean) aggregates what the clients share. `timed`
  (binaries/benchmark.py) adds wall-clock stamps of the clients' phases
  (`fedcg_tf.ClientOutput.times`) and of the distillation
  (`fedcg_tf.ServerMetrics.times`). `upload_updates` (DP-FedCG): clients
  upload their round's update of G and C rather than the networks, so a DP
  `aggregation_factory` (`dp.fedcg_mean_factory`) clips and noises updates.
  """
  config = config.validate()

  def client_update(message, state, dataset):
    return fedcg_tf.client_update(fedcg_tf.PartyNetworks(config), message,
                                  state, dataset, timed, upload_updates)

  def server_update(state, aggregator_state, averaged, distill_inputs):
    noise, labels = distill_inputs
    return fedcg_tf.server_update(
        fedcg_tf.PartyNetworks(config, fedcg_tf.SERVER_NETWORKS), state,
        aggregator_state, averaged, noise, labels, timed, upload_updates)

  return round_tff.build_round_process(
      config,
      initial_server_state=lambda aggregator_state: (
          fedcg_tf.initial_server_state(config, aggregator_state)),
      initial_client_state=lambda seed: fedcg_tf.initial_client_state(
          config, seed),
      upload_example=lambda: fedcg_tf.upload_example(config),
      server_message=fedcg_tf.server_message,
      client_update=client_update,
      server_update=server_update,
      round_inputs=lambda round_num: fedcg_tf.distillation_inputs(
          config, round_num),
      aggregation_factory=aggregation_factory)
