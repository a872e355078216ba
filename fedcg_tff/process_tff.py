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
        training_tf.Networks(config), state.extractor, state.classifier,
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


def flatten_round_metrics(metrics: RoundMetrics) -> dict[str, float]:
  """`server/<name>`, `client_<i>/<name>` and `mean/<name>` scalars."""
  out = _scalars('server', metrics.server)
  per_client = [_scalars(f'client_{i}', m)
                for i, m in enumerate(metrics.clients)]
  for i, m in enumerate(per_client):
    out.update(m)
  if per_client and per_client[0]:
    for key in per_client[0]:
      name = key.split('/', 1)[1]
      out[f'mean/{name}'] = float(np.mean(
          [m[f'client_{i}/{name}'] for i, m in enumerate(per_client)]))
  return out


class ProcessAlgorithm:
  """Drives an algorithm's process for `experiment.run`: holds the server
  state and (in this simulation) the list of client states between rounds."""

  def __init__(self, config: FedCGConfig, num_clients: int,
               process: tff.templates.IterativeProcess,
               init_client: tff.Computation):
    self.config = config
    self.process = process
    state_type = init_client.type_signature.result
    self._evaluate = build_evaluation(config, state_type)
    self.server_state = process.initialize()
    self.client_states = build_client_state_initializer(init_client)(
        client_seeds(config, num_clients))

  def run_round(self, round_num: int, train_data: list) -> dict[str, float]:
    del round_num  # The server state counts rounds.
    self.server_state, self.client_states, metrics = self.process.next(
        self.server_state, self.client_states, train_data)
    return flatten_round_metrics(metrics)

  def state(self):
    """Everything a resumed run needs: (server state, client states)."""
    return self.server_state, list(self.client_states)

  def restore(self, state) -> None:
    self.server_state, client_states = state
    self.client_states = list(client_states)

  def evaluate(self, val_data: list, test_data: list):
    results = self._evaluate(self.client_states, val_data, test_data)
    return ([float(r.val_accuracy) for r in results],
            [float(r.test_accuracy) for r in results])

