"""A run's output directory before any training: `run.json` (the flags
that decide the results), whether the directory already holds this run or a
finished one, the lock a run holds on it, and files written atomically.

Plain Python, no TensorFlow: a binary asked to rerun a finished run, or to
put other flags into a run's directory, answers in well under a second
instead of after TensorFlow's import (a sweep restarted over finished runs
passes over them at once)."""

import errno
import fcntl
import json
import os
import re
import time

RUN_FILE = 'run.json'  # What defines the run in a directory: see below.
RESULTS_FILE = 'results.json'  # Written when a run has finished.
LOCK_FILE = '.lock'  # Held by the process training there: OutputDirLock.
# A DP run's every round start, across its resumes (`RoundsStarted`).
ROUNDS_STARTED_FILE = 'rounds_started.json'


def duration(seconds: float) -> str:
  """'1h02m03s' or '2m03s': how progress lines give times left."""
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f'{h}h{m:02d}m{s:02d}s' if h else f'{m}m{s:02d}s'


def write_text_atomically(path: str, text: str) -> None:
  """Writes `text` to a temporary file, syncs it, renames it over `path`
  and syncs the directory: a crash, or a machine that ends, never leaves a
  half-written or empty file (a rename alone may reach the disk before the
  data it names), and the file is on disk when this returns."""
  tmp = f'{path}.tmp'
  try:
    with open(tmp, 'w') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    # A full disk, say: the part written would only hold on to space.
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  sync_directory(os.path.dirname(os.path.abspath(path)))


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def out_of_space(error: BaseException) -> bool:
  """Whether `error` is a file system out of space (or of quota): an
  OSError's errno, or the system's message inside a TensorFlow error,
  which carries no errno (a checkpoint's variables: `ResourceExhaustedError:
  ...; No space left on device [Op:SaveV2]`)."""
  if isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS:
    return True
  return any(os.strerror(number) in str(error) for number in NO_SPACE_ERRNOS)


def out_of_space_line(error: BaseException) -> str:
  """The line of `error`'s message that says it is out of space, without
  the `{{function_node ...}}` that TF puts before it (a multi-line TF
  message ends with a graph node, not with the cause)."""
  lines = str(error).strip().splitlines() or ['']
  line = next((l for l in lines if any(os.strerror(n) in l
                                       for n in NO_SPACE_ERRNOS)), lines[-1])
  return re.sub(r'\{\{function_node [^}]*\}\}\s*', '', line).strip()


def directory_bytes(path: str) -> int:
  """The bytes of the files under `path` (0 if it does not exist)."""
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(path) for name in names)


def earlier_attempt_dir(parent: str) -> str:
  """A new `earlier_attempt_<date>_<time>` directory in `parent`, for what
  a run that starts over moves aside rather than overwrite."""
  aside = os.path.join(parent, time.strftime('earlier_attempt_%Y%m%d_%H%M%S'))
  while os.path.exists(aside):
    aside += '_'
  os.makedirs(aside)
  return aside


def sync_directory(directory: str) -> None:
  """Makes the renames and new files in `directory` durable (fsync)."""
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_json_atomically(path: str, value) -> None:
  """`value` as indented JSON, written as `write_text_atomically` does."""
  write_text_atomically(path, json.dumps(value, indent=2, default=str))


class OutputDirLock:
  """An exclusive lock on a run's output directory (`flock` on its
  `.lock` file), held while a run trains there: a second process on the
  same directory (the same command started twice, or a sweep rerun while
  an orphaned run of it goes on) would truncate the first one's metrics
  and delete its newer client files. Raises FileExistsError naming the
  directory and the holder's pid. The kernel releases the lock when the
  process ends, however it ends."""

  def __init__(self, output_dir: str):
    path = os.path.join(output_dir, LOCK_FILE)
    self._file = open(path, 'a+')  # pylint: disable=consider-using-with
    try:
      fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self._file.seek(0)
      holder = self._file.read().strip() or 'unknown'
      self._file.close()
      raise FileExistsError(
          f'--output_dir {output_dir!r} is in use by another run (pid '
          f'{holder}): wait for it to end, or stop it, before resuming '
          'there') from None
    try:
      self._file.truncate(0)
      self._file.write(str(os.getpid()))
      self._file.flush()
    except BaseException:  # A full disk, say: not held by a lost object.
      self._file.close()
      raise

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._file.close()  # Releases the lock.


def claim_output_dir(output_dir: str,
                     run_definition: dict) -> tuple[bool, OutputDirLock]:
  """`prepare_output_dir` under the directory's lock: returns (whether the
  directory already held this run, the lock, held). The lock comes first:
  of two runs started on one directory at the same instant, the one
  refused has written no run.json (at most the directory and the lock
  file, if it came first); with run.json written before the lock, the run
  that trains could find there the other's flags. A directory that
  is not a run's is refused before anything, even the lock file, is
  written into it."""
  _refuse_foreign(output_dir)
  os.makedirs(output_dir, exist_ok=True)
  lock = OutputDirLock(output_dir)
  try:
    return prepare_output_dir(output_dir, run_definition), lock
  except BaseException:
    lock.__exit__(None, None, None)
    raise


def _refuse_foreign(output_dir: str) -> None:
  """Raises FileExistsError if `output_dir` holds files but no run (its
  lock file alone is not a run's file: a start stopped before run.json)."""
  if (os.path.isdir(output_dir) and
      set(os.listdir(output_dir)) - {LOCK_FILE} and
      not os.path.exists(os.path.join(output_dir, RUN_FILE))):
    raise FileExistsError(
        f'--output_dir {output_dir!r} is not empty and holds no {RUN_FILE}: '
        'choose a new directory so that nothing there is overwritten')


def prepare_output_dir(output_dir: str, run_definition: dict) -> bool:
  """Creates `output_dir` for a run, or accepts it for resuming.

  `run_definition` (JSON-able: the flags that decide the results) is written
  to `<output_dir>/run.json`. A directory that already holds a run is
  accepted only if its definition is the same (the run then resumes, or is
  already finished); one with another definition, or with files that are
  not a run's, is refused with the differences named. Returns True if the
  directory already held this run.
  """
  path = os.path.join(output_dir, RUN_FILE)
  _refuse_foreign(output_dir)
  if os.path.exists(path):
    stored = _load(path)
    normalise = lambda d: json.loads(json.dumps(d, default=str))
    if normalise(stored) != normalise(run_definition):
      raise FileExistsError(
          f'--output_dir {output_dir!r} holds a run with other flags '
          f'({differences(normalise(stored), normalise(run_definition))}); '
          'rerun with the same flags to resume it, or choose a new directory')
    return True
  os.makedirs(output_dir, exist_ok=True)
  write_json_atomically(path, run_definition)
  return False


class _Missing:
  def __repr__(self):
    return '(not set)'


_MISSING = _Missing()


def differences(stored: dict, wanted: dict) -> str:
  """'--name: stored x, given y' for each differing (nested) entry."""
  out = []
  for key in sorted(set(stored) | set(wanted)):
    a, b = stored.get(key, _MISSING), wanted.get(key, _MISSING)
    if isinstance(a, dict) and isinstance(b, dict):
      inner = differences(a, b)
      if inner:
        out.append(inner)
    elif a != b:
      out.append(f'--{key}: stored {a!r}, given {b!r}')
  return '; '.join(out)


def finished_run(output_dir: str, run_definition) -> dict | None:
  """The results of the finished run `output_dir` holds, if it holds one.

  `run_definition(stored)` gives the definition of the run the flags ask
  for, from the stored one (for entries the flags alone do not give, such
  as those read from the data). A run, finished or not, with another
  definition is refused as `prepare_output_dir` refuses it; None when the
  directory holds no finished run (nothing there, or a run to resume).
  """
  path = os.path.join(output_dir, RUN_FILE)
  if not os.path.exists(path):
    return None
  prepare_output_dir(output_dir, run_definition(_load(path)))
  results = os.path.join(output_dir, RESULTS_FILE)
  return _load(results) if os.path.exists(results) else None


def _load(path: str) -> dict:
  try:
    with open(path) as f:
      value = json.load(f)
  except ValueError as e:
    raise ValueError(f'{path} is not valid JSON ({e}): restore it, or '
                     'choose a new --output_dir') from None
  if not isinstance(value, dict) or (
      os.path.basename(path) == RUN_FILE and
      not all(isinstance(v, dict) for v in value.values())):
    raise ValueError(f'{path} does not hold what a run writes there: '
                     'restore it, or choose a new --output_dir')
  return value


class RoundsStarted:
  """Every round a run has started, in `rounds_started.json`, kept across
  its resumes and fallbacks.

  A round's noised uploads reach the server in its server step, before the
  round's state is saved: a run interrupted in between redoes the round on
  resume (and a fallback past a damaged checkpoint redoes several), so the
  server has seen that round's uploads twice, with independent noise. A
  DP run's accounting charges each start (`extra_releases`). Each start is
  on disk before the round runs; a round started and stopped before its
  server step is charged too (the count errs on the safe side).

  `partial`: the record began after the run had already run (a run
  resumed from before this file existed): starts before it are not known,
  and are counted as the rounds run.
  """

  def __init__(self, output_dir: str, ran_before: bool):
    """`ran_before`: rounds ran in `output_dir` before; read only when it
    has no record yet, which is then `partial`."""
    self.path = os.path.join(output_dir, ROUNDS_STARTED_FILE)
    self.rounds, self.partial = [], ran_before
    try:
      if os.path.exists(self.path):
        stored = _load(self.path)
        self.rounds = stored.get('rounds')
        self.partial = stored.get('partial', False)
    except OSError as e:
      raise ValueError(f'{self.path} cannot be read ({e}): make it readable '
                       'or restore it, or choose a new --output_dir') from None
    if not (isinstance(self.rounds, list) and isinstance(self.partial, bool)
            and all(type(r) is int and r >= 1 for r in self.rounds)):  # pylint: disable=unidiomatic-typecheck
      raise ValueError(f'{self.path} does not hold the rounds a run '
                       'started: restore it, or choose a new --output_dir')

  def start(self, round_number: int) -> None:
    """Records that round `round_number` (from 1) starts; on disk when this
    returns."""
    self.rounds.append(round_number)
    write_json_atomically(self.path, {'rounds': self.rounds,
                                      'partial': self.partial})

  def extra_releases(self, rounds_run: int) -> int:
    """The starts beyond one for each of rounds 1..`rounds_run`: rounds run
    again, and rounds started past `rounds_run` by an attempt that a
    fallback or a start-over then undid."""
    counted = {r for r in self.rounds if r <= rounds_run}
    return len(self.rounds) - len(counted)
