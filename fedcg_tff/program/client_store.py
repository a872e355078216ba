"""Where the driver keeps client states between rounds, and which clients
take part in a round.

With every client in every round (the paper's 4-client setting) the states
simply stay in memory (`MemoryClientStore`). At cross-device scale (many
clients, `clients_per_round` of them sampled each round) holding every
client's state in RAM does not scale: FedCG's client state (E_i, C_i, D_i and
three Adam states) is megabytes, so `DiskClientStore` keeps one file per
client and holds none in memory; the driver loads the few states a round or
an evaluation chunk needs and writes the sampled clients' new states back.

On-disk states must stay consistent with the round checkpoints
(`checkpoint.Checkpoints`, which then hold the server state and the loop's
bookkeeping but no client state): a crash after some client files of round r
were written but before the round-r checkpoint was saved must resume from
round r - 1 exactly. So files are versioned by the number of completed
rounds they belong to (`client_00042.r000007.npz`: client 42's state after
round 7), and `discard_after(k)` deletes every file newer than k completed
rounds, exposing the older one. Each client keeps its newest
`checkpoint.KEPT_SAVES + 1` files: every kept checkpoint may be the one a
resume falls back on (the newest damaged), and one round, the one in
flight, may be uncommitted. With one file fewer, a client trained in rounds
r - 1, r and r + 1 that crashed before round r + 1's checkpoint would have
lost its round r - 1 file, which the fallback from a damaged round-r
checkpoint needs.
"""

import dataclasses
import os
import re
import zipfile
from typing import Any, Callable, Sequence

import numpy as np

from fedcg_tff.program import checkpoint
from fedcg_tff.program import run_record


class ForeignStates(ValueError):
  """The client-state directory holds a state of a client the run does not
  have: written by another run (the run stops before touching it)."""


class MissingState(RuntimeError):
  """A client trained before the round a run resumes from has no stored
  state: resuming would silently give it its initial one. Not damage that
  an older checkpoint could mend (its states would be older still): the run
  stops, naming the client, before any client file is deleted."""


@dataclasses.dataclass(frozen=True)
class ClientSampling:
  """How a driver picks and stores clients.

  `clients_per_round`: clients sampled each round (None: every client, in
  order, as in the paper). `states_dir`: keep client states there, one file
  per client (None: in memory).
  """
  clients_per_round: int | None = None
  states_dir: str | None = None


def check_clients_per_round(clients_per_round: int, num_clients: int) -> None:
  if not 1 <= clients_per_round <= num_clients:
    raise ValueError(f'clients_per_round must be in [1, {num_clients}] '
                     f'(the number of clients), got {clients_per_round}')


def sample_clients(seed: int, round_num: int, num_clients: int,
                   clients_per_round: int) -> list[int]:
  """The clients of 0-based round `round_num`, sorted.

  A pure function of (run seed, round), so a resumed run samples the same
  clients as an uninterrupted one; with every client taking part it is all
  of them in order, exactly the driver's behaviour without sampling.
  (`tff.simulation.build_uniform_sampling_fn` is such a function too, but
  it returns the clients unsorted and, when all take part, in a shuffled
  order; switching now would also change the clients that runs already
  made sampled, and so their resumption.)
  """
  check_clients_per_round(clients_per_round, num_clients)
  if clients_per_round == num_clients:
    return list(range(num_clients))
  rng = np.random.default_rng([seed, round_num])
  return sorted(int(i) for i in rng.choice(num_clients, clients_per_round,
                                           replace=False))


class MemoryClientStore:
  """Every client's state in a list (the behaviour without sampling)."""

  def __init__(self, states: Sequence[Any]):
    self._states = list(states)

  @property
  def num_clients(self) -> int:
    return len(self._states)

  def load(self, ids: Sequence[int]) -> list[Any]:
    return [self._states[i] for i in ids]

  def save(self, rounds_done: int, ids: Sequence[int],
           states: Sequence[Any]) -> None:
    del rounds_done  # Checkpoints hold these states: nothing to version.
    for i, state in zip(ids, states, strict=True):
      self._states[i] = state

  def discard_after(self, rounds_done: int) -> None:
    del rounds_done  # `restore_all` replaces the states instead.

  def all_states(self) -> list[Any]:
    return list(self._states)

  def restore_all(self, states: Sequence[Any]) -> None:
    if len(states) != len(self._states):
      raise ValueError(f'restoring {len(states)} client states into a store '
                       f'of {len(self._states)} clients')
    self._states = list(states)


_FILE = re.compile(r'^client_(\d+)\.r(\d+)\.npz$')


def _intact_zip(path: str) -> bool:
  """Whether every member of the zip (.npz) at `path` passes its checksum."""
  try:
    with zipfile.ZipFile(path) as z:
      return z.testzip() is None
  except checkpoint.NOT_DAMAGE:
    raise
  except checkpoint.READ_ERRORS:
    return False


class DiskClientStore:
  """One file per client version in `directory`; no state held in memory.

  A client with no file yet has its initial state, drawn by `initialize`
  (client ids -> their initial states, seeded per client, so drawing it
  again gives the same state) when it is first needed. `template` is a state
  of the right structure (any client's initial state): files hold the
  leaves packed per dtype (`checkpoint.pack`) and are unpacked against it.

  Only an index of which versions exist (a few integers per client) is kept
  in memory; `max_loaded` records the most states one `load` returned, for
  callers and tests to check the memory bound.
  """

  KEEP = checkpoint.KEPT_SAVES + 1  # See the module docstring.

  def __init__(self, directory: str, num_clients: int,
               initialize: Callable[[list[int]], list[Any]], template: Any):
    self.directory = directory
    self.num_clients = num_clients
    self._initialize = initialize
    self._template = template
    self.max_loaded = 0
    os.makedirs(directory, exist_ok=True)
    self._versions: dict[int, list[int]] = {}
    for name in os.listdir(directory):
      match = _FILE.match(name)
      if match is None:
        if name.endswith('.tmp'):  # A write that a crash interrupted.
          os.remove(os.path.join(directory, name))
        continue
      client, version = int(match.group(1)), int(match.group(2))
      if client >= num_clients:
        raise ForeignStates(
            f'{directory} holds a state of client {client}, but the run has '
            f'{num_clients} clients: was it written by another run?')
      self._versions.setdefault(client, []).append(version)
    for versions in self._versions.values():
      versions.sort()

  def path(self, client: int, rounds_done: int) -> str:
    return os.path.join(self.directory,
                        f'client_{client:05d}.r{rounds_done:06d}.npz')

  def versions(self, client: int) -> list[int]:
    """The completed-round counts of the client's stored states, oldest
    first (empty: never trained, so its initial state)."""
    return list(self._versions.get(client, []))

  def load(self, ids: Sequence[int]) -> list[Any]:
    """The newest stored state of each client (initial if it has none)."""
    ids = list(ids)
    for i in ids:
      if not 0 <= i < self.num_clients:
        raise IndexError(f'client {i} is not in [0, {self.num_clients})')
    fresh = [i for i in ids if not self._versions.get(i)]
    initial = dict(zip(fresh, self._initialize(fresh))) if fresh else {}
    states = []
    for i in ids:
      if i in initial:
        states.append(initial[i])
        continue
      path = self.path(i, self._versions[i][-1])
      try:
        states.append(self._read(path))
      except checkpoint.StateMismatch as e:
        raise checkpoint.StateMismatch(f'{path}: {e}') from None
    self.max_loaded = max(self.max_loaded, len(states))
    return states

  def _read(self, path: str) -> Any:
    """The client state in the file at `path` (`StateMismatch` if it holds
    another state; what reading raised if it cannot be read)."""
    with np.load(path) as f:
      return checkpoint.unpack({dtype: f[dtype] for dtype in f.files},
                               self._template)

  def save(self, rounds_done: int, ids: Sequence[int],
           states: Sequence[Any]) -> None:
    """Writes each client's state as its version `rounds_done`.

    Each file is written to a temporary name, flushed to disk and renamed,
    and the directory is synced before returning: the files of a round are
    durable before that round's checkpoint can be written, so a checkpoint
    never refers to client states a power loss could take back. Versions
    older than the newest `KEEP` are then deleted.

    A state written again (its round redone after a resume fell back from
    a damaged copy) renames that copy `redone_damaged_<file>`: still kept,
    but no longer taken by `require` for damage of the state now stored
    (a later loss of this file would otherwise make a resume fall back,
    perhaps to round 1, instead of stopping at `MissingState`).
    """
    damaged = [n for n in os.listdir(self.directory)
               if n.startswith('damaged_')]
    for i, state in zip(ids, states, strict=True):
      path = self.path(i, rounds_done)
      tmp = f'{path}.tmp'
      with open(tmp, 'wb') as f:
        np.savez(f, **checkpoint.pack(state))
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
      versions = self._versions.setdefault(i, [])
      if rounds_done not in versions:
        versions.append(rounds_done)
        versions.sort()
      name = os.path.basename(path)
      for stale in (n for n in damaged if n.startswith(f'damaged_{name}')):
        checkpoint.set_aside(os.path.join(self.directory, stale), 'redone_')
    run_record.sync_directory(self.directory)
    for i in ids:
      versions = self._versions[i]
      while len(versions) > self.KEEP:
        os.remove(self.path(i, versions.pop(0)))

  def check(self) -> None:
    """Reads back every client's newest stored state. One that cannot be
    read is set aside (`damaged_<file>`, out of the index, nothing deleted)
    and `checkpoint.DamagedState` names it: its round must be redone from
    an older checkpoint, against which its older version (or, if it had
    none, its initial state) is the right one."""
    for client, versions in sorted(self._versions.items()):
      if not versions:
        continue
      path = self.path(client, versions[-1])
      try:
        self._read(path)
      except checkpoint.StateMismatch as e:
        # Intact but not this code's, unless the zip says otherwise: a
        # garbled shape in a member's header reads short, before the
        # member's checksum would be checked.
        if _intact_zip(path):
          raise checkpoint.StateMismatch(f'{path}: {e}') from None
        error = e
      except checkpoint.NOT_DAMAGE:
        raise
      except checkpoint.READ_ERRORS as e:
        error = e
      else:
        continue
      aside = checkpoint.set_aside(path)
      version = versions.pop()
      raise checkpoint.DamagedState(
          f'client {client}\'s state after round {version} ({path}, set '
          f'aside as {aside}) is damaged: {checkpoint.describe_error(error)}',
          rounds_done=version) from error

  def require(self, trained: dict[int, tuple[int, int]],
              rounds_done: int) -> None:
    """Checks that every client of `trained` (client -> the first and the
    last round, 1-based, it was trained in among the first `rounds_done`)
    has its state of that last round stored. Deletes nothing: call it
    before `discard_after`.

    Raises `checkpoint.DamagedState` (for round `last`: the resume falls
    back to a save before it) if that file was set aside as damaged, by a
    resume that a crash stopped before it set the checkpoint aside too (a
    copy whose round was redone since is no longer `damaged_`: `save`);
    else `MissingState` naming the client (its files deleted or moved):
    resuming would silently give it an older or its initial state."""
    for client, (first, last) in sorted(trained.items()):
      stored = [v for v in self._versions.get(client, []) if v <= rounds_done]
      if last in stored:
        continue
      path = self.path(client, last)
      parent, name = os.path.split(path)
      aside = sorted(n for n in os.listdir(parent)
                     if n.startswith(f'damaged_{name}'))
      if aside:
        raise checkpoint.DamagedState(
            f'client {client}\'s state after round {last} ({path}) was set '
            f'aside as damaged ({os.path.join(parent, aside[-1])})',
            rounds_done=last)
      has = (f'only its state of round {stored[-1]}' if stored else
             'no state of it')
      raise MissingState(
          f'client {client} was trained in rounds {first} to {last}, but '
          f'{self.directory} holds {has} for the checkpoint of round '
          f'{rounds_done} (files deleted or moved?); resuming would give it '
          f'{"an older" if stored else "its initial"} state')

  def set_aside_all(self) -> str | None:
    """Moves every stored state into a new `earlier_attempt_<time>`
    directory beside them (every client then starts afresh) and returns
    its path (None: nothing stored). For a run that starts over: the
    states an earlier attempt wrote are kept, not deleted."""
    if not any(self._versions.values()):
      return None
    aside = run_record.earlier_attempt_dir(self.directory)
    for i, versions in self._versions.items():
      for version in versions:
        name = os.path.basename(self.path(i, version))
        os.replace(self.path(i, version), os.path.join(aside, name))
    self._versions.clear()
    run_record.sync_directory(self.directory)
    return aside

  def discard_after(self, rounds_done: int) -> None:
    """Deletes every state newer than `rounds_done` completed rounds: those
    of a round whose checkpoint was never saved."""
    for i, versions in self._versions.items():
      while versions and versions[-1] > rounds_done:
        os.remove(self.path(i, versions.pop()))
