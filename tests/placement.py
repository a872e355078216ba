"""What a TFF computation moves between placements, for the privacy tests.

An algorithm leaks the private extractor if any intrinsic that moves values
from one placement to another (a broadcast or an aggregation) carries a
tensor with one of the extractor's weight shapes: no other network, nor
anything else a round moves, has them.
"""

import tensorflow_federated as tff

# The LeNet extractor's weight shapes (5x5 kernels, biases of 6 and 16).
EXTRACTOR_KERNEL_SHAPES = frozenset({(5, 5, 1, 6), (6,), (5, 5, 6, 16),
                                     (16,)})


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


def crossings(comp):
  """(intrinsic uri, parameter type) of every intrinsic in `comp` that moves
  values from one placement to another (broadcasts and aggregations)."""
  found = []

  def visit(node):
    if isinstance(node, tff.framework.Intrinsic):
      fn_type = node.type_signature
      src = _placements(fn_type.parameter) if fn_type.parameter else set()
      dst = _placements(fn_type.result)
      if src and dst and src != dst:
        found.append((node.uri, fn_type.parameter))
    return node, False

  tff.framework.transform_postorder(comp.to_building_block(), visit)
  return found


def leaks(comp):
  """URIs of the crossing intrinsics that carry an extractor weight."""
  return [uri for uri, t in crossings(comp)
          if EXTRACTOR_KERNEL_SHAPES & set(tensor_shapes(t))]
