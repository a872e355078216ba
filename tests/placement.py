"""What a TFF computation moves between placements, for the privacy tests.

An algorithm leaks the private extractor if any intrinsic that moves values
from one placement to another (a broadcast or an aggregation) carries one of
the extractor's kernels: a tensor of a kernel's shape, or a vector of a
kernel's number of elements (a flattened kernel). (Other shapes of the
same size are not flagged: FedCG's [24, 100] distillation noise has the
size of LeNet's second conv kernel.) No other
network's tensor, nor anything else a round moves, matches them (the tests
check that FedAvg's and a deliberately leaky computation's crossings do).
Biases and batch-norm vectors are left out: their sizes (6, 16, 64, 128)
are too common to tell networks apart.

A type can only show shapes: an extractor concatenated into one vector, or
reshaped to another shape of the same size, has no kernel's shape. So the
tests also look at values (`shared_fractions`): what a round's clients
actually upload is searched for the extractors' kernel values, whatever
shape carries them.
"""

import functools

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.proto.v0 import computation_pb2
from tensorflow_federated.python.core.impl.types import type_serialization

from fedcg_tff.config import FedCGConfig


@functools.lru_cache
def extractor_kernels(model: str = 'lenet', channels: int = 1
                      ) -> frozenset[tuple[int, ...]]:
  """The shapes of the kernels (rank >= 2) of `model`'s extractor."""
  from fedcg_tff.models import families  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    extractor = families.build_extractor(model, channels)
    return frozenset(tuple(v.shape) for v in extractor.trainable_weights
                     if len(v.shape) >= 2)


# The LeNet extractor's kernel shapes (5x5 kernels of 6 and 16 filters).
EXTRACTOR_KERNEL_SHAPES = frozenset({(5, 5, 1, 6), (5, 5, 6, 16)})


def tensor_shapes(type_spec):
  """Every tensor shape inside a TFF type (without a leading client axis of
  unknown size, which gathering adds)."""
  if isinstance(type_spec, tff.TensorType):
    shape = tuple(type_spec.shape)
    return [shape[1:] if shape and shape[0] is None else shape]
  if isinstance(type_spec, tff.StructType):
    return [s for t in type_spec for s in tensor_shapes(t)]
  if isinstance(type_spec, tff.FederatedType):
    return tensor_shapes(type_spec.member)
  if isinstance(type_spec, tff.SequenceType):
    return tensor_shapes(type_spec.element)
  if isinstance(type_spec, tff.FunctionType):
    return ((tensor_shapes(type_spec.parameter) if type_spec.parameter
             else []) + tensor_shapes(type_spec.result))
  return []


def _placements(type_spec):
  if isinstance(type_spec, tff.FederatedType):
    return {type_spec.placement}
  if isinstance(type_spec, tff.StructType):
    return set().union(*[_placements(t) for t in type_spec])
  return set()


# The fields of a computation proto that hold no computation (a TF graph,
# a type, data): the walk below skips them.
_LEAF_FIELDS = frozenset({'type', 'tensorflow', 'xla', 'data', 'literal',
                          'placement', 'reference'})


def _intrinsic_protos(message):
  """Every intrinsic inside a computation proto, in no particular order.

  Walks the proto itself: `to_building_block` would rebuild (and
  type-check) every node of a process (0.7 s for FedCG's LeNet `next` on
  Zen 1, against 0.1 s for this walk), where only the intrinsics' types are
  needed."""
  for field, value in message.ListFields():
    if (field.type != field.TYPE_MESSAGE or field.name in _LEAF_FIELDS):
      continue
    for child in (value if field.label == field.LABEL_REPEATED else [value]):
      if (isinstance(child, computation_pb2.Computation)
          and child.WhichOneof('computation') == 'intrinsic'):
        yield child
      else:
        yield from _intrinsic_protos(child)


def crossings(comp):
  """(intrinsic uri, parameter type) of every intrinsic in `comp` that moves
  values from one placement to another (broadcasts and aggregations)."""
  found = []
  for proto in _intrinsic_protos(comp.get_proto(comp)):
    fn_type = type_serialization.deserialize_type(proto.type)
    src = _placements(fn_type.parameter) if fn_type.parameter else set()
    dst = _placements(fn_type.result)
    if src and dst and src != dst:
      found.append((proto.intrinsic.uri, fn_type.parameter))
  return found


def carries_kernel(type_spec, kernels=EXTRACTOR_KERNEL_SHAPES) -> bool:
  """Whether a type holds a tensor of one of `kernels`' shapes, or a
  vector of one of their sizes."""
  sizes = {int(np.prod(k)) for k in kernels}
  shapes = tensor_shapes(type_spec)
  return bool(kernels & set(shapes)) or any(
      len(s) == 1 and s[0] in sizes for s in shapes)


def leaks(comp, config: FedCGConfig | None = None):
  """URIs of the crossing intrinsics that carry a kernel of the extractor
  (of `config`'s model family; default LeNet, one channel)."""
  kernels = (EXTRACTOR_KERNEL_SHAPES if config is None else
             extractor_kernels(config.model, config.image_channels))
  return [uri for uri, t in crossings(comp) if carries_kernel(t, kernels)]


def _float_values(structure) -> np.ndarray:
  """Every float32 value in `structure` (nested tensors or arrays), as
  their bit patterns."""
  arrays = [np.asarray(x, np.float32).ravel()
            for x in tf.nest.flatten(structure)
            if np.asarray(x).dtype.kind == 'f']
  if not arrays:
    return np.zeros(0, np.uint32)
  return np.concatenate(arrays).view(np.uint32)


def shared_fractions(uploads, extractors) -> np.ndarray:
  """For each kernel of the extractors (each weight of rank >= 2: random
  draws, so distinct values), the fraction of its values found anywhere in
  `uploads`, bit for bit: 1 for a kernel uploaded in any shape, flattened,
  concatenated or permuted; near 0 for one that is not. Not exactly 0:
  other networks' values equal some of the extractor's by chance (about
  1.5% of LeNet's kernel values turn up in a FedCG upload of about 900 000
  values), so callers compare the largest with 0.1. Per kernel, so that one
  small kernel uploaded (LeNet's first convolution: 150 of its 2550 kernel
  values) is not lost among the others."""
  found = _float_values(uploads)
  fractions = []
  for kernel in tf.nest.flatten(extractors):
    if np.ndim(kernel) < 2:
      continue
    wanted = np.unique(_float_values(kernel))
    wanted = wanted[wanted != 0]  # +0.0: a weight's value never drawn.
    if wanted.size:
      fractions.append(np.isin(wanted, found).mean())
  if not fractions:
    raise ValueError('no extractor kernel values to look for')
  return np.array(fractions)


_MAPS = ('federated_map', 'federated_apply', 'federated_map_all_equal')


def _graph_ops(compiled) -> set:
  graph = tf.compat.v1.GraphDef()
  compiled.proto.tensorflow.graph_def.Unpack(graph)
  ops = {node.op for node in graph.node}
  for function in graph.library.function:
    ops |= {node.op for node in function.node_def}
  return ops


def tf_ops_by_placement(comp) -> dict:
  """{placement: the TF op types of every computation `comp` maps at that
  placement}: which ops run on the clients and which at the server."""
  found = {}

  def visit(node):
    if (isinstance(node, tff.framework.Call) and
        isinstance(node.function, tff.framework.Intrinsic) and
        node.function.uri in _MAPS):
      fn, value = node.argument[0], node.argument[1]
      ops = found.setdefault(value.type_signature.placement, set())

      def inner(n):
        if isinstance(n, tff.framework.CompiledComputation):
          ops.update(_graph_ops(n))
        return n, False

      tff.framework.transform_postorder(fn, inner)
    return node, False

  tff.framework.transform_postorder(comp.to_building_block(), visit)
  return found
