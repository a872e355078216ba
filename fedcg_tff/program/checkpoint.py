"""Each completed round's whole state on disk, through
`tff.program.FileProgramStateManager`, so that a rerun resumes.

The state of a run is the algorithm's server state and every client state
(attrs structures, dicts and tuples of numpy arrays, as TFF returns them)
plus the round loop's bookkeeping. TFF's manager stores a structure as a
SavedModel with one variable per leaf, which for FedCG's ~1000 leaves is
slow; so leaves are packed here into one flat vector per dtype and unpacked
against a template of the same structure (the freshly initialised state).

The manager writes each version to a temporary directory and renames it, so
a crash while saving leaves the previous round's state intact. A version
damaged later (a bad disk, a truncated copy) is detected when a run resumes
(`Checkpoints.resume`): its directory is set aside as `damaged_round_<n>`,
the message names it, and the run resumes from the newest intact version.
"""

import asyncio
import os
import re
import shutil
import zipfile
from typing import Any, Callable

from google.protobuf import message as protobuf_message

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
import tree


class DamagedState(Exception):
  """Saved state that cannot be read back (the message names the file).

  `rounds_done`: the completed rounds the damaged state belongs to, when it
  is one client's (a client not sampled since round v keeps its state of
  round v): every checkpoint from that round on needs it, so none of them
  can be resumed from."""

  def __init__(self, message: str, rounds_done: int | None = None):
    super().__init__(message)
    self.rounds_done = rounds_done


class StateMismatch(ValueError):
  """A save that reads back intact but holds another state than the one it
  should restore (other sizes or dtypes): written by another version of the
  code, or for other networks. Not damage, so nothing is set aside: the run
  stops, naming the file (`resume`, `client_store`). It is a ValueError,
  which READ_ERRORS holds: catch it before them. A save of another
  *structure* (another set of dtypes, other bookkeeping keys), which TFF's
  load against the template refuses with a plain ValueError, is one too
  when the save reads back intact on its own and its keys differ from this
  code's by more than a garbled byte would make them (`_garbled`)."""


# What reading a damaged file raises: TF's checksum and format errors
# (DataLossError and the other OpErrors), a broken protobuf or zip (a
# garbled compression-method byte: NotImplementedError), short or garbled
# arrays (a garbled shape: OverflowError or MemoryError), a SavedModel
# whose object names no longer bind to its variables (a garbled byte in
# the proto, which TF does not checksum: AssertionError).
READ_ERRORS = (tf.errors.OpError, protobuf_message.DecodeError, ValueError,
               OSError, KeyError, EOFError, zipfile.BadZipFile,
               NotImplementedError, OverflowError, MemoryError, AssertionError,
               DamagedState)


# Errors of the machine, not of the file: memory running out inside TF,
# a permission, an interrupted or cancelled call. Reading again later may
# succeed, so the save is left where it is (nothing set aside, nothing
# after it discarded) and the error propagates. Catch these before
# READ_ERRORS, which holds all of them (MemoryError stays damage: a garbled
# shape asks numpy for an impossible array).
NOT_DAMAGE = (tf.errors.ResourceExhaustedError, tf.errors.PermissionDeniedError,
              tf.errors.UnavailableError, tf.errors.CancelledError,
              tf.errors.DeadlineExceededError, tf.errors.AbortedError,
              PermissionError, InterruptedError)


def set_aside(path: str, prefix: str = 'damaged_') -> str:
  """Renames the damaged save or file `path` to `<prefix><its name>` beside
  it, or `<prefix><its name>.2`, `.3`, ... if that is taken (an earlier
  copy is never replaced); returns the new path."""
  parent, name = os.path.split(path)
  aside = os.path.join(parent, f'{prefix}{name}')
  taken, n = aside, 1
  while os.path.exists(taken):
    n += 1
    taken = f'{aside}.{n}'
  os.replace(path, taken)
  return taken


def describe_error(error: BaseException) -> str:
  """'DataLossError: <its first line>' for a message."""
  text = str(error).strip().splitlines()
  return f'{type(error).__name__}: {text[0] if text else ""}'.rstrip(': ')


def pack(structure: Any) -> dict[str, np.ndarray]:
  """All leaves of `structure`, concatenated into one 1-D array per dtype."""
  groups: dict[str, list[np.ndarray]] = {}
  for leaf in tf.nest.flatten(structure):
    leaf = np.asarray(leaf)
    groups.setdefault(leaf.dtype.name, []).append(leaf.ravel())
  return {dtype: np.concatenate(parts) for dtype, parts in groups.items()}


_OTHER_CODE = ': was it written by another version of the code?'


def unpack(packed: dict[str, np.ndarray], template: Any) -> Any:
  """The inverse of `pack`, with shapes, dtypes and containers from
  `template` (a structure like the one that was packed). Raises
  `StateMismatch` if `packed` holds other sizes or dtypes."""
  offsets = {dtype: 0 for dtype in packed}
  leaves = []
  for leaf in tf.nest.flatten(template):
    leaf = np.asarray(leaf)
    dtype = leaf.dtype.name
    if dtype not in packed:
      raise StateMismatch(f'it holds no {dtype} values, the state needs '
                          'some' + _OTHER_CODE)
    start = offsets[dtype]
    offsets[dtype] = start + leaf.size
    if offsets[dtype] > packed[dtype].size:
      raise StateMismatch(f'it holds {packed[dtype].size} {dtype} values, '
                          'fewer than the state needs' + _OTHER_CODE)
    leaves.append(packed[dtype][start:offsets[dtype]].reshape(leaf.shape)
                  .astype(leaf.dtype))
  for dtype, used in offsets.items():
    if used != packed[dtype].size:
      raise StateMismatch(f'it holds {packed[dtype].size} {dtype} values, '
                          f'the state needs {used}' + _OTHER_CODE)
  return tf.nest.pack_sequence_as(template, leaves)


# How many round saves a run keeps (the newest and the one before it, to
# fall back on when the newest is damaged). `client_store.DiskClientStore`
# keeps one client version more, for the round in flight.
KEPT_SAVES = 2


def _garbled(saved: Any, template: Any) -> bool:
  """Whether the keys of `saved` (a save's structure read back on its own)
  differ from `template`'s only as damage would make them. TF does not
  check a SavedModel's own proto when it loads it, so a garbled byte in a
  key reads back as another key: each unexpected key then has the length
  of a missing one and differs from it in a byte or two, and is no dtype
  name (the packed groups' keys are: other dtype names, like a renamed,
  added or dropped key, are another version's state)."""
  def dtype_name(key):
    try:
      np.dtype(key)
    except TypeError:
      return False
    return True

  def near(a, b):
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) <= 2

  if not (isinstance(saved, dict) and isinstance(template, dict)):
    return False
  extra = [k for k in saved if k not in template]
  missing = [k for k in template if k not in saved]
  if len(extra) != len(missing) or any(
      dtype_name(k) or not any(near(k, m) for m in missing) for k in extra):
    return False
  differs = bool(extra)
  for key, value in saved.items():
    if key in template and isinstance(value, dict):
      if value.keys() != template[key].keys():
        if not _garbled(value, template[key]):
          return False
        differs = True
  return differs


# TFF's name for a save being written (file_utils.write_saved_model).
_UNFINISHED_SAVE = re.compile(r'round_\d+_temp\d{4}')


class Checkpoints:
  """Round states in `directory`, version = number of completed rounds."""

  def __init__(self, directory: str, keep: int = KEPT_SAVES):
    self.directory = directory
    self._manager = tff.program.FileProgramStateManager(
        directory, prefix='round_', keep_total=keep, keep_first=False)

  def latest_round(self) -> int:
    versions = self.kept_rounds()
    return max(versions) if versions else 0

  def kept_rounds(self) -> list[int]:
    """The completed-round counts of the saves kept, ascending."""
    return sorted(asyncio.run(self._manager.get_versions()) or [])

  def had_saves(self) -> bool:
    """Whether this run saved a round: a save is kept (one that `resume`
    may yet set aside), or an earlier resume set one aside as damaged (and
    may have stopped before the run moved its record aside). A run that
    then starts over moves its metrics aside: at worst an extra
    `earlier_attempt_*` directory, never a record lost."""
    return bool(self.kept_rounds()) or (
        os.path.isdir(self.directory) and
        any(n.startswith('damaged_') for n in os.listdir(self.directory)))

  def save(self, rounds_done: int, state: dict[str, Any]) -> None:
    asyncio.run(self._manager.save(state, rounds_done))

  def path(self, rounds_done: int) -> str:
    return os.path.join(self.directory, f'round_{rounds_done}')

  def resume(self, template: dict[str, Any],
             restore: Callable[[int, dict[str, Any]], None],
             log: Callable[[str], None] = print) -> int:
    """Restores the newest intact save; returns its completed rounds (0:
    nothing to resume).

    `template` has the saved state's structure (any values); `restore(
    rounds_done, state)` applies a loaded state and raises `DamagedState`
    if what it needs beside the checkpoint, such as client-state files, is
    damaged for that round. A save that cannot be read, or that `restore`
    finds damaged, is set aside as `damaged_round_<n>` (nothing is
    deleted), named in a message, and the next older one is tried; if none
    is intact the run starts over, saying so (`round_loop.run` then moves
    the earlier metrics aside). Any other error of `restore`
    is a fault of the caller, not of the save: it propagates, with the save
    left in place; so does a save of another state (`StateMismatch`, the
    message naming it).
    """
    self._remove_unfinished_saves(log)
    versions = asyncio.run(self._manager.get_versions()) or []
    limit = None  # Saves from this round on need a damaged client state.
    for version in sorted(versions, reverse=True):
      if limit is not None and version >= limit:
        aside = set_aside(self.path(version))
        log(f'the saved state of round {version} needs a client state of '
            f'round {limit}, which is damaged; set aside as {aside}')
        continue
      try:
        state = self._read(version, template)
      except DamagedState as e:
        error = e.__cause__  # What reading raised, for the message below.
      else:
        try:
          restore(version, state)
          return version
        except DamagedState as e:
          error = e
        except StateMismatch as e:
          raise StateMismatch(f'{self.path(version)}: {e}') from None
      aside = set_aside(self.path(version))
      if isinstance(error, DamagedState) and error.rounds_done is not None:
        limit = min(error.rounds_done, version if limit is None else limit)
      older = [v for v in versions if v < version]
      then = (f'trying the save of round {max(older)}' if older else
              'no older save is kept')
      log(f'the saved state of round {version} ({self.path(version)}) is '
          f'damaged ({describe_error(error)}); set aside as {aside}; {then}')
    if versions:
      log('no intact saved state: the run starts over from round 1')
    return 0

  def _other_structure(self, version: int, template: Any,
                       error: BaseException) -> str | None:
    """Why the save of `version` does not fit `template` if, read back on
    its own (no template), it is intact but of another structure; None if
    it cannot be read (damage) or `error` was not about its structure."""
    if type(error) is not ValueError:  # pylint: disable=unidiomatic-typecheck
      return None
    try:
      saved = tf.saved_model.load(self.path(version))()
      saved = tf.nest.map_structure(
          lambda v: v.read_value() if isinstance(v, tf.Variable) else v,
          saved)
    except NOT_DAMAGE:
      raise
    except READ_ERRORS:
      return None
    paths = lambda s: ', '.join(
        '/'.join(str(k) for k in path) for path, _ in
        tree.flatten_with_path(s))
    if paths(saved) == paths(template) or _garbled(saved, template):
      return None
    return (f'it holds {paths(saved)}; the state needs {paths(template)}'
            + _OTHER_CODE)

  def load(self, rounds_done: int, template: dict[str, Any]
           ) -> dict[str, Any]:
    """The state saved after `rounds_done` rounds, read against
    `template`, for tools that inspect a run (nothing is set aside).
    Raises ValueError naming the kept rounds if that save is not kept,
    `StateMismatch` if it holds a state of another structure, and
    `DamagedState` naming its directory if it cannot be read."""
    versions = self.kept_rounds()
    if rounds_done not in versions:
      raise ValueError(f'{self.directory} keeps no save of round '
                       f'{rounds_done} (kept: {versions})')
    return self._read(rounds_done, template)

  def _read(self, version: int, template: dict[str, Any]) -> dict[str, Any]:
    """The save of `version` read against `template`, with numpy leaves.
    Raises `StateMismatch` if it holds a state of another structure,
    `DamagedState` naming it (caused by what reading raised) if it cannot
    be read, and an error of the machine (`NOT_DAMAGE`) as it came."""
    try:
      state = asyncio.run(self._manager.load(version, template))
      return tf.nest.map_structure(np.asarray, state)
    except NOT_DAMAGE:
      raise
    except READ_ERRORS as e:
      other = self._other_structure(version, template, e)
      if other is not None:
        raise StateMismatch(f'{self.path(version)}: {other}') from None
      raise DamagedState(f'{self.path(version)}: {describe_error(e)}') from e

  def _remove_unfinished_saves(self, log: Callable[[str], None]) -> None:
    """Deletes what a save cut short left: TFF writes a save into
    `round_<n>_temp<4 digits>` and renames it when complete, so such a
    directory never holds a whole save (the manager does not list it) and
    would otherwise stay, as large as a save, for the run's life."""
    if not os.path.isdir(self.directory):
      return
    for name in sorted(os.listdir(self.directory)):
      if _UNFINISHED_SAVE.fullmatch(name):
        shutil.rmtree(os.path.join(self.directory, name))
        log(f'removed {os.path.join(self.directory, name)}, a save cut '
            'short (TFF renames a save when it is complete)')
