"""The one way to run a round from Python: an algorithm's clients' step (in
the default execution context, or spread over `workers.Workers`), then its
server's step, timed.

`next` is defined as exactly this composition (`round_tff.compose_next`),
so every way of running gives the same result, bit for bit; running the two
steps apart is what lets the clients be spread over workers and the phases
be timed (binaries/benchmark.py).
"""

import dataclasses
import time
from typing import Callable, Optional

import numpy as np

from fedcg_tff.algorithms import round_tff


@dataclasses.dataclass(frozen=True)
class RoundTiming:
  """Wall-clock seconds of a round's two steps, seen from Python, and the
  stamps a timed process records inside them (`ClientOutput.times` per
  client, the server metrics' `times`; empty unless the process is timed)."""
  clients_step_s: float
  server_step_s: float
  client_stamps: list
  server_stamps: tuple

  def phase_seconds(self) -> dict[str, float]:
    """The phases of a timed FedCG round (binaries/benchmark.py): the
    in-worker client phases summed over clients (between each client's
    stamps), the clients' wall time in the workers (first stamp to last),
    the rest of the clients' step (TFF's serialisation and dispatch), the
    distillation (stamped in the server's update) and the rest of the
    server's step (aggregation)."""
    stamps = np.asarray(self.client_stamps, np.float64)
    phases = np.diff(stamps, axis=1).sum(axis=0)
    in_workers = float(stamps[:, -1].max() - stamps[:, 0].min())
    start, end = self.server_stamps
    distillation = float(end - start)
    return {
        'client_stage1_s': float(phases[0]),
        'client_stage2_s': float(phases[1]),
        'client_teacher_s': float(phases[2]),
        'clients_in_workers_s': in_workers,
        'tff_overhead_s': float(self.clients_step_s - in_workers),
        'aggregation_s': float(self.server_step_s - distillation),
        'distillation_s': distillation,
        'round_s': float(self.clients_step_s + self.server_step_s),
    }


class RoundRunner:
  """Runs rounds of a `round_tff.RoundProcess`: `runner(server_state,
  client_states, client_data)` returns what the process's `next` returns.

  `workers` (a `workers.Workers`): the clients' step runs on its workers,
  one contiguous shard of clients each; None: in the default context.
  `on_timing(RoundTiming)` is called after each round.
  """

  def __init__(self, parts: round_tff.RoundParts, workers=None,
               on_timing: Optional[Callable[[RoundTiming], None]] = None):
    self.parts = parts
    self.workers = workers
    self.on_timing = on_timing

  def __call__(self, server_state, client_states, client_data):
    start = time.perf_counter()
    if self.workers is None:
      outputs = list(self.parts.clients_step(server_state, client_states,
                                             client_data))
    else:
      outputs = self.workers.map_clients(
          self.parts.clients_step, (server_state,),
          (list(client_states), list(client_data)))
    clients_done = time.perf_counter()
    new_server_state, server_metrics, measurements = self.parts.server_step(
        server_state, [o.upload for o in outputs], [o.weight for o in outputs])
    server_done = time.perf_counter()
    if self.on_timing is not None:
      self.on_timing(RoundTiming(
          clients_step_s=clients_done - start,
          server_step_s=server_done - clients_done,
          client_stamps=[tuple(getattr(o, 'times', ())) for o in outputs],
          server_stamps=tuple(getattr(server_metrics, 'times', ()))))
    metrics = round_tff.RoundMetrics(
        server=server_metrics, aggregator=measurements,
        clients=[o.metrics for o in outputs])
    return new_server_state, [o.state for o in outputs], metrics
