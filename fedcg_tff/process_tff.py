"""TFF plumbing every algorithm shares: types, client-state initialisation,
evaluation, collecting client values at the server, and the driver that runs
an algorithm's process round by round for `experiment.run`.

Every algorithm is a `tff.templates.IterativeProcess` whose `next` has the
shape `next(server_state@SERVER, client_states@CLIENTS, client_data@CLIENTS)
-> (server_state@SERVER, client_states@CLIENTS, RoundMetrics)`; client states
come from a `seeds@CLIENTS -> client_states@CLIENTS` initializer and hold at
least the `extractor` and `classifier` that the shared evaluation scores.
"""

import attrs
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from fedcg_tff import client_store
from fedcg_tff import experiment
from fedcg_tff import training_tf
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
        training_tf.Networks(config, ('extractor', 'classifier')),
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


def _map_type(fn, type_spec: tff.types.Type):
  """`fn` applied to each tensor type of a (nested) struct type, keeping the
  Python containers, so TF code sees the same dicts and tuples."""
  if isinstance(type_spec, tff.TensorType):
    return fn(type_spec)
  elements = [(name, _map_type(fn, t))
              for name, t in tff.structure.iter_elements(type_spec)]
  container = getattr(type_spec, 'python_container', None)
  if container is None:
    return tff.types.StructType(elements)
  return tff.types.StructWithPythonType(elements, container)


def _empty_value(type_spec: tff.types.Type):
  """Python structure of `[0, ...]` tensors for a stacked type: static shape
  `[None, ...]`, so an accumulator keeps one type however many clients it
  has seen."""
  if isinstance(type_spec, tff.TensorType):
    return tf.raw_ops.PlaceholderWithDefault(
        input=tf.zeros([0, *type_spec.shape[1:]], type_spec.dtype),
        shape=type_spec.shape)
  items = [(name, _empty_value(t))
           for name, t in tff.structure.iter_elements(type_spec)]
  container = getattr(type_spec, 'python_container', None) or tuple
  if container is dict or (isinstance(container, type) and
                           issubclass(container, dict)):
    return container(items)
  if attrs.has(container):
    return container(**dict(items))
  return container(v for _, v in items)


def weighted_type(value_type: tff.types.Type) -> tff.types.Type:
  """The `(value, weight)` pairs that `build_collect` gathers."""
  return tff.types.StructWithPythonType(
      [(None, value_type), (None, tff.TensorType(np.float32))], tuple)


def stacked_type(type_spec: tff.types.Type) -> tff.types.Type:
  """`type_spec` with a leading client axis of unknown size on each tensor:
  the type of what `build_collect` returns."""
  return _map_type(lambda t: tff.TensorType(t.dtype, [None, *t.shape]),
                   type_spec)


def build_collect(value_type: tff.types.Type):
  """A federated function `(values@CLIENTS, weights@CLIENTS) ->
  (stacked values, weights)@SERVER` gathering every client's value.

  FedDF and FedGen need the ensemble of the clients' networks at the server,
  which a mean cannot give; `tff.aggregators` has no gathering factory, so
  this is a `federated_aggregate` whose accumulator concatenates along a
  leading client axis of unknown size (order: whatever order the runtime
  accumulates in, the same for values and weights).
  """
  pair_type = weighted_type(value_type)
  acc_type = stacked_type(pair_type)

  @tff.tensorflow.computation
  def zero():
    return _empty_value(acc_type)

  @tff.tensorflow.computation(acc_type, pair_type)
  def accumulate(acc, pair):
    return tf.nest.map_structure(lambda a, v: tf.concat([a, v[None]], 0),
                                 acc, pair)

  @tff.tensorflow.computation(acc_type, acc_type)
  def merge(a, b):
    return tf.nest.map_structure(lambda x, y: tf.concat([x, y], 0), a, b)

  @tff.tensorflow.computation(acc_type)
  def report(acc):
    return acc

  def collect(values, weights):
    return tff.federated_aggregate(tff.federated_zip((values, weights)),
                                   zero(), accumulate, merge, report)

  return collect


def client_seeds(config: FedCGConfig, num_clients: int) -> list[int]:
  """Each client's private seed, derived from the run's seed."""
  return [config.seed * 1000 + i + 1 for i in range(num_clients)]


def _scalars(prefix: str, metrics) -> dict[str, float]:
  if not attrs.has(type(metrics)):
    return {}
  return {f'{prefix}/{k}': float(v) for k, v in attrs.asdict(metrics).items()}


def flatten_round_metrics(metrics: RoundMetrics,
                          client_ids: list[int] | None = None
                          ) -> dict[str, float]:
  """`server/<name>`, `client_<i>/<name>` and `mean/<name>` scalars.

  `client_ids[j]` is the client whose metrics are `metrics.clients[j]`
  (default: j): with client sampling the round's clients are a subset, and
  the means are over them only.
  """
  out = _scalars('server', metrics.server)
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


class ProcessAlgorithm:
  """Drives an algorithm's process for `experiment.run`: holds the server
  state, and keeps the client states in a store between rounds.

  Without `sampling` every client takes part in every round and the client
  states are a list in memory, part of `state()` (so of every checkpoint).
  With `sampling.clients_per_round` below the number of clients, each round
  runs `process.next` on the sampled clients only (their states and
  datasets; `next` infers the CLIENTS cardinality) and the others' states
  are left untouched. With `sampling.states_dir`, client states live there,
  one file per client (`client_store.DiskClientStore`), and at most
  `clients_per_round` of them are loaded at a time; `state()` then holds the
  server state only, and the store rolls back to the restored round.
  """

  def __init__(self, config: FedCGConfig, num_clients: int,
               process: tff.templates.IterativeProcess,
               init_client: tff.Computation,
               sampling: client_store.ClientSampling | None = None):
    sampling = sampling or client_store.ClientSampling()
    self.config = config
    self.process = process
    # What runs a round: `process.next`, or a `workers.ShardedRound` that
    # spreads the clients over several TFF workers (same results).
    self.next_round = process.next
    self.num_clients = num_clients
    self.clients_per_round = sampling.clients_per_round or num_clients
    if not 1 <= self.clients_per_round <= num_clients:
      raise ValueError(
          f'clients_per_round must be in [1, {num_clients}] (the number of '
          f'clients), got {self.clients_per_round}')
    state_type = init_client.type_signature.result
    self._evaluate = build_evaluation(config, state_type)
    self.server_state = process.initialize()
    initialize_clients = build_client_state_initializer(init_client)
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
    never reaches the store. The metrics are the server's and, per sampled
    client, its training metrics; `mean/...` are over the sampled clients.
    """
    # `round_num` rounds are complete: a disk store drops any state written
    # by a later round whose checkpoint was never saved (in-memory stores
    # were restored whole).
    self._store.discard_after(round_num)
    ids = self.sample_clients(round_num)
    states = self._store.load(ids)
    server_state, new_states, metrics = self.next_round(
        self.server_state, states, [train_data[i] for i in ids])
    del states  # Only the new states stay in memory until stored.
    new_states = list(new_states)
    flat = flatten_round_metrics(metrics, ids)
    # Leaf by leaf: packing would copy every new state once more.
    experiment.check_finite(round_num + 1, flat,
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
      # rounds belong to a round whose checkpoint was never saved.
      self._store.discard_after(int(self.server_state.round_num))
    else:
      self._store.restore_all(list(client_states))

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
      results = self._evaluate(self._store.load(chunk),
                               [val_data[i] for i in chunk],
                               [test_data[i] for i in chunk])
      for i, r in zip(chunk, results, strict=True):
        self._accuracy[i] = (val_data[i], test_data[i],
                             float(r.val_accuracy), float(r.test_accuracy))
    return ([self._accuracy[i][2] for i in range(self.num_clients)],
            [self._accuracy[i][3] for i in range(self.num_clients)])
