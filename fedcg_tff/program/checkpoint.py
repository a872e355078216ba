"""Each completed round's whole state on disk, through
`tff.program.FileProgramStateManager`, so that a rerun resumes.

The state of a run is the algorithm's server state and every client state
(attrs structures, dicts and tuples of numpy arrays, as TFF returns them)
plus the round loop's bookkeeping. TFF's manager stores a structure as a
SavedModel with one variable per leaf, which for FedCG's ~1000 leaves is
slow; so leaves are packed here into one flat vector per dtype and unpacked
against a template of the same structure (the freshly initialised state).

The manager writes each version to a temporary directory and renames it, so
a crash while saving leaves the previous round's state intact.
"""

import asyncio
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff


def pack(structure: Any) -> dict[str, np.ndarray]:
  """All leaves of `structure`, concatenated into one 1-D array per dtype."""
  groups: dict[str, list[np.ndarray]] = {}
  for leaf in tf.nest.flatten(structure):
    leaf = np.asarray(leaf)
    groups.setdefault(leaf.dtype.name, []).append(leaf.ravel())
  return {dtype: np.concatenate(parts) for dtype, parts in groups.items()}


def unpack(packed: dict[str, np.ndarray], template: Any) -> Any:
  """The inverse of `pack`, with shapes, dtypes and containers from
  `template` (a structure like the one that was packed)."""
  offsets = {dtype: 0 for dtype in packed}
  leaves = []
  for leaf in tf.nest.flatten(template):
    leaf = np.asarray(leaf)
    dtype = leaf.dtype.name
    if dtype not in packed:
      raise ValueError(f'checkpoint holds no {dtype} values')
    start = offsets[dtype]
    offsets[dtype] = start + leaf.size
    if offsets[dtype] > packed[dtype].size:
      raise ValueError('checkpoint is smaller than the state it restores '
                       '(was it written with other flags?)')
    leaves.append(packed[dtype][start:offsets[dtype]].reshape(leaf.shape)
                  .astype(leaf.dtype))
  for dtype, used in offsets.items():
    if used != packed[dtype].size:
      raise ValueError(f'checkpoint holds {packed[dtype].size} {dtype} '
                       f'values, the state needs {used} (was it written '
                       'with other flags?)')
  return tf.nest.pack_sequence_as(template, leaves)


class Checkpoints:
  """Round states in `directory`, version = number of completed rounds."""

  def __init__(self, directory: str, keep: int = 2):
    self.directory = directory
    self._manager = tff.program.FileProgramStateManager(
        directory, prefix='round_', keep_total=keep, keep_first=False)

  def latest_round(self) -> int:
    versions = asyncio.run(self._manager.get_versions())
    return max(versions) if versions else 0

  def save(self, rounds_done: int, state: dict[str, Any]) -> None:
    asyncio.run(self._manager.save(state, rounds_done))

  def load_latest(self, template: dict[str, Any]
                  ) -> tuple[dict[str, Any] | None, int]:
    """(state, completed rounds) of the latest save, or (None, 0).

    `template` has the saved state's structure (any values)."""
    versions = asyncio.run(self._manager.get_versions())
    if not versions:
      return None, 0
    version = max(versions)
    state = asyncio.run(self._manager.load(version, template))
    return tf.nest.map_structure(np.asarray, state), version
