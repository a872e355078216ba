"""Gathering every client's value at the server (FedDF's and FedGen's
ensembles), in TFF: types and the `federated_aggregate` that places the TF
accumulator of `aggregators_tf`."""

import attrs
import numpy as np
import tensorflow_federated as tff

from fedcg_tff.algorithms import aggregators_tf


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


def _python_structure(type_spec: tff.types.Type):
  """The Python containers of a (nested) struct type with its tensor types
  as leaves: the structure TF code builds values of."""
  if isinstance(type_spec, tff.TensorType):
    return type_spec
  items = [(name, _python_structure(t))
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
    return aggregators_tf.empty_stack(_python_structure(acc_type))

  accumulate = tff.tensorflow.computation(aggregators_tf.append, acc_type,
                                          pair_type)
  merge = tff.tensorflow.computation(aggregators_tf.concat, acc_type,
                                     acc_type)

  @tff.tensorflow.computation(acc_type)
  def report(acc):
    return acc

  def collect(values, weights):
    return tff.federated_aggregate(tff.federated_zip((values, weights)),
                                   zero(), accumulate, merge, report)

  return collect
