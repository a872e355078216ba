"""Each round's scalars, as a run writes them to its output directory
(TensorBoard and CSV, through `tff.program` release managers). What defines
the run (`run.json`) and atomic writes are in `run_record`, which needs no
TensorFlow."""

import asyncio
import csv
import glob
import io
import os
import shutil

import numpy as np
import tensorflow_federated as tff

from fedcg_tff.program import run_record


METRICS_FILE = 'metrics.csv'  # Every round's scalars, in the run's directory.


class MetricsWriter:
  """Each round's scalars to TensorBoard (`<dir>/tensorboard`) and CSV,
  through `tff.program` release managers."""

  def __init__(self, output_dir: str):
    self.csv_path = os.path.join(output_dir, METRICS_FILE)
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

  def set_aside(self) -> str | None:
    """Moves the CSV and TensorBoard logs, if any, into a new
    `earlier_attempt_<time>` directory beside them and returns its path
    (None: nothing to move). For a run that starts over because none of its
    saves could be resumed: their record of the rounds run is kept."""
    present = [p for p in (self.csv_path, self.tensorboard_dir)
               if os.path.exists(p)]
    if not present:
      return None
    self._managers = None
    aside = run_record.earlier_attempt_dir(os.path.dirname(self.csv_path))
    for path in present:
      os.replace(path, os.path.join(aside, os.path.basename(path)))
    return aside

  def resume_after(self, rounds_done: int) -> tuple[list[int], str | None]:
    """Keeps the metrics of rounds 1..`rounds_done` only and returns those
    of them that have no row (a power loss can lose a row the checkpoint
    after it kept: the CSV is appended without fsync), and where a damaged
    CSV was kept (None if it was not damaged).

    The CSV is the record: its rows of later rounds (released before a crash
    that lost their state) are dropped by rewriting it to a temporary file
    that replaces it, so an interruption here loses nothing. TensorBoard's
    event files, which cannot be edited, are then rebuilt from those rows
    (again on the next resume if this one is interrupted). A CSV with
    damaged lines (a header without `round`, a value that is no number, a
    row of the wrong length) is first moved, with the TensorBoard logs, into
    an `earlier_attempt_<time>` directory: only its readable rows are kept.
    """
    self._managers = None
    # TFF's CSV manager rewrites the whole file (when a round brings a new
    # column) into <file>_temp<4 digits> and renames it: one a crash left
    # was never renamed, and the file it would have replaced is whole.
    for leftover in glob.glob(glob.escape(self.csv_path) + '_temp[0-9]*'):
      os.remove(leftover)
    if not os.path.exists(self.csv_path):
      shutil.rmtree(self.tensorboard_dir, ignore_errors=True)
      return list(range(1, rounds_done + 1)), None
    # Bytes that are no UTF-8 (a bad disk) become U+FFFD: their rows then
    # hold no number, and are damaged rows like any other.
    with open(self.csv_path, newline='', errors='replace') as f:
      kept = f.read()
    # A row cut short (a full disk, a crash while appending) has no line
    # end: dropped, as its round is not saved either.
    kept = kept[:kept.rfind('\n') + 1]
    reader = csv.DictReader(io.StringIO(kept, newline=''))
    rows, fieldnames = [], ['round']
    try:
      fieldnames = reader.fieldnames or fieldnames
      damaged = 'round' not in fieldnames
      for row in ([] if damaged else reader):
        if not _readable(row):
          damaged = True
        elif int(row['round']) <= rounds_done:
          rows.append(row)
    except csv.Error:  # E.g. a field past the csv module's size limit.
      damaged = True
    aside = self.set_aside() if damaged else None
    if 'round' not in fieldnames:
      fieldnames = ['round']
    text = io.StringIO(newline='')
    writer = csv.DictWriter(text, fieldnames=fieldnames)
    writer.writeheader()
    writer.writerows(rows)
    run_record.write_text_atomically(self.csv_path, text.getvalue())
    shutil.rmtree(self.tensorboard_dir, ignore_errors=True)
    tensorboard = tff.program.TensorBoardReleaseManager(self.tensorboard_dir)

    async def replay():
      for row in rows:
        await tensorboard.release(
            {k: np.float32(v) for k, v in row.items()
             if k != 'round' and v != ''}, key=int(row['round']))

    asyncio.run(replay())
    return sorted(set(range(1, rounds_done + 1)) -
                  {int(row['round']) for row in rows}), aside


def _readable(row: dict) -> bool:
  """Whether a metrics.csv row has every field, a round number and numbers
  (or nothing: a metric that round did not have) everywhere else."""
  if None in row or None in row.values() or not row['round'].isdigit():
    return False
  try:
    for key, value in row.items():
      if key != 'round' and value != '':
        float(value)
  except ValueError:
    return False
  return True
