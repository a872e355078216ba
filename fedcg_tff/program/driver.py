"""The driver that runs an algorithm's process round by round for
`round_loop.run`: it holds the server state, keeps the client states in a
store between rounds, samples clients and evaluates them."""

import attrs
import numpy as np
import tree

from fedcg_tff.algorithms import round_tff
from fedcg_tff.config import FedCGConfig
from fedcg_tff.execution import round_runner
from fedcg_tff.program import client_store
from fedcg_tff.program import round_loop


# Clients from this index on take seeds above every earlier seed's range.
_FIRST_WIDE_CLIENT = 1000


def client_seeds(config: FedCGConfig, num_clients: int) -> list[int]:
  """Each client's private seed, distinct for every (run seed, client).

  Clients below 1000 keep seed * 1000 + i + 1, which every run before
  2026-12-05 used; from client 1000 on that formula reaches the next run
  seed's clients (client 1000 of seed s would be client 0 of seed s + 1),
  so those clients take 2**62 + seed * 2**31 + i instead: above every
  seed * 1000 + i + 1 (< 2**41) and every run seed, inside int64 for any
  seed up to config.MAX_SEED and fewer than 2**31 clients. (Client i < 999
  of seed 0 still has run seed i + 1's number, as before.)
  """
  return [config.seed * 1000 + i + 1 if i < _FIRST_WIDE_CLIENT else
          2**62 + config.seed * 2**31 + i for i in range(num_clients)]


def _scalars(prefix: str, metrics) -> dict[str, float]:
  """The scalar fields of an attrs metrics value (`times`, a timed
  process's stamps, is not a metric)."""
  if not attrs.has(type(metrics)):
    return {}
  return {f'{prefix}/{k}': float(v) for k, v in attrs.asdict(metrics).items()
          if k != 'times'}


def flatten_round_metrics(metrics: round_tff.RoundMetrics,
                          client_ids: list[int] | None = None
                          ) -> dict[str, float]:
  """`server/<name>`, `aggregator/<path>`, `client_<i>/<name>` and
  `mean/<name>` scalars.

  `client_ids[j]` is the client whose metrics are `metrics.clients[j]`
  (default: j): with client sampling the round's clients are a subset, and
  the means are over them only.
  """
  out = _scalars('server', metrics.server)
  # The aggregator's scalar measurements (secure aggregation's clipping
  # counts; the DP and plain means report none).
  for keys, value in tree.flatten_with_path(metrics.aggregator):
    value = np.asarray(value)
    if value.shape == () and value.dtype.kind in 'iuf':
      out['aggregator/' + '/'.join(str(k) for k in keys)] = float(value)
  if client_ids is None:
    client_ids = list(range(len(metrics.clients)))
  per_client = [_scalars(f'client_{i}', m)
                for i, m in zip(client_ids, metrics.clients, strict=True)]
  for m in per_client:
    out.update(m)
  if per_client and per_client[0]:
    for key in per_client[0]:
      name = key.split('/', 1)[1]
      out[f'mean/{name}'] = float(np.mean(
          [m[f'client_{i}/{name}'] for i, m in zip(client_ids, per_client)]))
  return out


class Driver:
  """Drives an algorithm's `round_tff.RoundProcess` for `round_loop.run`:
  holds the server state, keeps the client states in a store between
  rounds, runs each round through `runner` and evaluates.

  Without `sampling` every client takes part in every round and the client
  states are a list in memory, part of `state()` (so of every checkpoint).
  With `sampling.clients_per_round` below the number of clients, each round
  runs on the sampled clients only (their states and datasets; `next`
  infers the CLIENTS cardinality) and the others' states are left
  untouched. With `sampling.states_dir`, client states live there, one file
  per client (`client_store.DiskClientStore`), and at most
  `clients_per_round` of them are loaded at a time; `state()` then holds the
  server state only, and the store rolls back to the restored round.

  Rounds run through `execution.round_runner.RoundRunner`: with `workers`
  (`execution.workers.Workers`) the clients of a round are spread over them
  (the same results as the default context); `on_timing(RoundTiming)` is
  called after each round (binaries/benchmark.py).
  """

  def __init__(self, config: FedCGConfig, num_clients: int,
               process: round_tff.RoundProcess,
               sampling: client_store.ClientSampling | None = None,
               workers=None, on_timing=None):
    sampling = sampling or client_store.ClientSampling()
    self.config = config
    self.process = process
    self.runner = round_runner.RoundRunner(process.parts, workers, on_timing)
    self.num_clients = num_clients
    self.clients_per_round = sampling.clients_per_round or num_clients
    client_store.check_clients_per_round(self.clients_per_round, num_clients)
    self.server_state = process.initialize()
    initialize_clients = process.initialize_clients
    seeds = client_seeds(config, num_clients)
    if sampling.states_dir is None:
      self._store = client_store.MemoryClientStore(initialize_clients(seeds))
    else:
      self._store = client_store.DiskClientStore(
          sampling.states_dir, num_clients,
          lambda ids: list(initialize_clients([seeds[i] for i in ids])),
          template=initialize_clients(seeds[:1])[0])
    # Per client, (val dataset, test dataset, val acc., test acc.) of its
    # current state: see `evaluate`.
    self._accuracy: dict[int, tuple] = {}

  @property
  def states_on_disk(self) -> bool:
    return isinstance(self._store, client_store.DiskClientStore)

  @property
  def client_store(self):
    return self._store

  @property
  def client_states(self) -> list:
    """Every client's state (in-memory store only: a disk store would have
    to load them all, which is what it exists to avoid)."""
    if self.states_on_disk:
      raise AttributeError(
          'client states are on disk: use load_client_states(ids)')
    return self._store.all_states()

  def load_client_states(self, ids) -> list:
    return self._store.load(ids)

  def sample_clients(self, round_num: int) -> list[int]:
    """The sorted clients of 0-based round `round_num` (all of them without
    sampling), drawn from (run seed, round) only."""
    return client_store.sample_clients(self.config.seed, round_num,
                                       self.num_clients,
                                       self.clients_per_round)

  def run_round(self, round_num: int, train_data) -> dict[str, float]:
    """One round on the sampled clients; `train_data[i]` is client i's
    dataset (only the sampled ones are read).

    The round's metrics and new states are checked for non-finite values
    before any state is stored (naming the client by its id), so a fault
    never reaches the store or a checkpoint: the round's one finiteness
    check (`round_loop.check_finite`). The metrics are the server's and, per sampled
    client, its training metrics; `mean/...` are over the sampled clients.
    """
    # `round_num` rounds are complete: a disk store drops any state written
    # by a later round whose checkpoint was never saved (in-memory stores
    # were restored whole).
    self._store.discard_after(round_num)
    ids = self.sample_clients(round_num)
    states = self._store.load(ids)
    server_state, new_states, metrics = self.runner(
        self.server_state, states, [train_data[i] for i in ids])
    del states  # Only the new states stay in memory until stored.
    new_states = list(new_states)
    flat = flatten_round_metrics(metrics, ids)
    # Leaf by leaf: packing would copy every new state once more.
    round_loop.check_finite(round_num + 1, flat,
                            (server_state, dict(zip(ids, new_states))))
    self._store.save(round_num + 1, ids, new_states)
    self.server_state = server_state
    for i in ids:
      self._accuracy.pop(i, None)
    return flat

  def state(self):
    """Everything a resumed run needs besides a disk store's files:
    (server state, every client state), or (server state, []) when the
    client states are on disk."""
    if self.states_on_disk:
      return self.server_state, []
    return self.server_state, self._store.all_states()

  def restore(self, state) -> None:
    self.server_state, client_states = state
    self._accuracy.clear()
    if self.states_on_disk:
      # The server state counts completed rounds; client files of later
      # rounds belong to a round whose checkpoint was never saved. Then
      # every client's state for this round must read back (else
      # checkpoint.DamagedState, and an older checkpoint is tried).
      rounds_done = int(self.server_state.round_num)
      if rounds_done == 0:  # Starting over: keep an earlier attempt's.
        self._store.set_aside_all()
        return
      self._store.require(self._trained_before(rounds_done), rounds_done)
      self._store.discard_after(rounds_done)
      self._store.check()
    else:
      self._store.restore_all(list(client_states))

  def _trained_before(self, rounds_done: int) -> dict[int, tuple[int, int]]:
    """Each client trained in the first `rounds_done` rounds -> the first
    and the last (1-based) round it was, from the sampling's pure
    function."""
    rounds = {}
    for round_num in range(rounds_done):
      for i in self.sample_clients(round_num):
        rounds[i] = (rounds.get(i, (round_num + 1,))[0], round_num + 1)
    return rounds

  def evaluate(self, val_data: list, test_data: list):
    """Every client's validation and test accuracy of its E_i then C_i.

    States are loaded and evaluated in chunks of at most
    `clients_per_round`, so a disk store never has more in memory. A
    client's accuracies are kept until its state changes (a round that
    samples it, or a restore) and reused while it is evaluated on the same
    dataset objects: evaluation is deterministic (fixed order, fixed noise,
    inference mode), so a reused value equals what evaluating again would
    give, and with 10 of 100 clients sampled a round evaluates 10 clients,
    not 100. Without sampling every client changes every round, and all are
    evaluated in one call as before.
    """
    def fresh(i):
      cached = self._accuracy.get(i)
      return (cached is not None and cached[0] is val_data[i] and
              cached[1] is test_data[i])

    todo = [i for i in range(self.num_clients) if not fresh(i)]
    for start in range(0, len(todo), self.clients_per_round):
      chunk = todo[start:start + self.clients_per_round]
      results = self.process.evaluate(self._store.load(chunk),
                               [val_data[i] for i in chunk],
                               [test_data[i] for i in chunk])
      for i, r in zip(chunk, results, strict=True):
        self._accuracy[i] = (val_data[i], test_data[i],
                             float(r.val_accuracy), float(r.test_accuracy))
    return ([self._accuracy[i][2] for i in range(self.num_clients)],
            [self._accuracy[i][3] for i in range(self.num_clients)])
