"""What a run leaves in its output directory besides checkpoints: each
round's scalars (TensorBoard and CSV, through `tff.program` release
managers), `run.json` (what defines the run) and JSON written atomically."""

import asyncio
import csv
import json
import os
import shutil

import numpy as np
import tensorflow_federated as tff


class MetricsWriter:
  """Each round's scalars to TensorBoard (`<dir>/tensorboard`) and CSV,
  through `tff.program` release managers."""

  def __init__(self, output_dir: str):
    self.csv_path = os.path.join(output_dir, 'metrics.csv')
    self.tensorboard_dir = os.path.join(output_dir, 'tensorboard')
    self._managers = None

  def _open(self):
    if self._managers is None:
      self._managers = [
          tff.program.TensorBoardReleaseManager(self.tensorboard_dir),
          tff.program.CSVFileReleaseManager(self.csv_path,
                                            key_fieldname='round'),
      ]
    return self._managers

  def write(self, round_num: int, scalars: dict[str, float]) -> None:
    value = {k: np.float32(v) for k, v in scalars.items()}

    async def release_all():
      await asyncio.gather(*(m.release(value, key=round_num)
                             for m in self._open()))

    asyncio.run(release_all())

  def resume_after(self, rounds_done: int) -> None:
    """Keeps the metrics of rounds 1..`rounds_done` only, once each.

    The CSV is the record: its rows of later rounds (released before a crash
    that lost their state) are dropped by rewriting it to a temporary file
    that replaces it, so an interruption here loses nothing. TensorBoard's
    event files, which cannot be edited, are then rebuilt from those rows
    (again on the next resume if this one is interrupted).
    """
    self._managers = None
    if not os.path.exists(self.csv_path):
      shutil.rmtree(self.tensorboard_dir, ignore_errors=True)
      return
    with open(self.csv_path, newline='') as f:
      reader = csv.DictReader(f)
      fieldnames = reader.fieldnames or ['round']
      rows = [r for r in reader
              if r.get('round') and int(r['round']) <= rounds_done]
    tmp = f'{self.csv_path}.tmp'
    with open(tmp, 'w', newline='') as f:
      writer = csv.DictWriter(f, fieldnames=fieldnames)
      writer.writeheader()
      writer.writerows(rows)
    os.replace(tmp, self.csv_path)
    shutil.rmtree(self.tensorboard_dir, ignore_errors=True)
    tensorboard = tff.program.TensorBoardReleaseManager(self.tensorboard_dir)

    async def replay():
      for row in rows:
        await tensorboard.release(
            {k: np.float32(v) for k, v in row.items()
             if k != 'round' and v != ''}, key=int(row['round']))

    asyncio.run(replay())


RUN_FILE = 'run.json'  # What defines the run in a directory: see below.


def write_text_atomically(path: str, text: str) -> None:
  """Writes `text` to a temporary file and renames it over `path`, so a
  crash never leaves a half-written file."""
  tmp = f'{path}.tmp'
  with open(tmp, 'w') as f:
    f.write(text)
  os.replace(tmp, path)


def write_json_atomically(path: str, value) -> None:
  """`value` as indented JSON, written as `write_text_atomically` does."""
  write_text_atomically(path, json.dumps(value, indent=2, default=str))


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
  if os.path.isdir(output_dir) and os.listdir(output_dir):
    if not os.path.exists(path):
      raise FileExistsError(
          f'--output_dir {output_dir!r} is not empty and holds no {RUN_FILE}: '
          'choose a new directory so that nothing there is overwritten')
    with open(path) as f:
      stored = json.load(f)
    normalise = lambda d: json.loads(json.dumps(d, default=str))
    if normalise(stored) != normalise(run_definition):
      raise FileExistsError(
          f'--output_dir {output_dir!r} holds a run with other flags '
          f'({_differences(normalise(stored), normalise(run_definition))}); '
          'rerun with the same flags to resume it, or choose a new directory')
    return True
  os.makedirs(output_dir, exist_ok=True)
  write_json_atomically(path, run_definition)
  return False


def _differences(stored: dict, wanted: dict) -> str:
  """'--name: stored x, given y' for each differing (nested) entry."""
  out = []
  for key in sorted(set(stored) | set(wanted)):
    a, b = stored.get(key), wanted.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      inner = _differences(a, b)
      if inner:
        out.append(inner)
    elif a != b:
      out.append(f'--{key}: stored {a!r}, given {b!r}')
  return '; '.join(out)
