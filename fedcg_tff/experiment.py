"""The round loop shared by every algorithm: evaluate, record, early-stop.

An algorithm is anything with `run_round(round_num, train_data) -> metrics`
and `evaluate(val_data, test_data) -> (val_accuracies, test_accuracies)`;
this module keeps the paper's bookkeeping (per client, the test accuracy at
its best-validation round), writes every round's metrics to TensorBoard and
CSV through `tff.program` release managers, prints progress, and stops after
`patience` rounds in which no client reached a new best validation accuracy.

Rounds are numbered from 1 in everything a user reads (progress lines, the
CSV and TensorBoard step, the final table); algorithms get 0-based indices.
"""

import asyncio
import dataclasses
import os
import time
from typing import Callable, Protocol, Sequence

import numpy as np
import tensorflow_federated as tff


class Algorithm(Protocol):

  def run_round(self, round_num: int, train_data: list) -> dict[str, float]:
    ...

  def evaluate(self, val_data: list,
               test_data: list) -> tuple[Sequence[float], Sequence[float]]:
    ...


@dataclasses.dataclass
class BestTracker:
  """Per client: best validation accuracy, its round, and test accuracy then."""
  num_clients: int
  best_val: list = None
  test_at_best: list = None
  best_round: list = None

  def __post_init__(self):
    self.best_val = [-1.0] * self.num_clients
    self.test_at_best = [float('nan')] * self.num_clients
    self.best_round = [-1] * self.num_clients

  def update(self, round_num: int, val: Sequence[float],
             test: Sequence[float]) -> bool:
    """Records a round; True if any client reached a new best validation."""
    improved = False
    for i, (v, t) in enumerate(zip(val, test)):
      if v > self.best_val[i]:
        self.best_val[i], self.test_at_best[i] = float(v), float(t)
        self.best_round[i] = round_num
        improved = True
    return improved

  @property
  def mean_test(self) -> float:
    return float(np.mean(self.test_at_best))

  def table(self) -> str:
    lines = ['client  best_round  best_val_acc  test_acc_at_best_val']
    for i in range(self.num_clients):
      lines.append(f'{i:>6}  {self.best_round[i]:>10}  '
                   f'{100 * self.best_val[i]:>12.2f}  '
                   f'{100 * self.test_at_best[i]:>20.2f}')
    lines.append(f'{"mean":>6}  {"":>10}  '
                 f'{100 * float(np.mean(self.best_val)):>12.2f}  '
                 f'{100 * self.mean_test:>20.2f}')
    return '\n'.join(lines)


class MetricsWriter:
  """Each round's scalars to TensorBoard (`<dir>/tensorboard`) and CSV."""

  def __init__(self, output_dir: str):
    self.csv_path = os.path.join(output_dir, 'metrics.csv')
    self.tensorboard_dir = os.path.join(output_dir, 'tensorboard')
    self._managers = [
        tff.program.TensorBoardReleaseManager(self.tensorboard_dir),
        tff.program.CSVFileReleaseManager(self.csv_path, key_fieldname='round'),
    ]

  def write(self, round_num: int, scalars: dict[str, float]) -> None:
    value = {k: np.float32(v) for k, v in scalars.items()}

    async def release_all():
      await asyncio.gather(*(m.release(value, key=round_num)
                             for m in self._managers))

    asyncio.run(release_all())


def prepare_output_dir(output_dir: str) -> None:
  """Creates `output_dir`; refuses one that already holds results."""
  if os.path.isdir(output_dir) and os.listdir(output_dir):
    raise FileExistsError(
        f'--output_dir {output_dir!r} is not empty; choose a new directory so '
        'that no earlier results are overwritten')
  os.makedirs(output_dir, exist_ok=True)


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f'{h}h{m:02d}m{s:02d}s' if h else f'{m}m{s:02d}s'


@dataclasses.dataclass
class RunResult:
  tracker: BestTracker
  rounds_run: int
  stopped_early: bool
  round_seconds: list


def run(algorithm: Algorithm,
        train_data_fn: Callable[[int], list],
        val_data: list,
        test_data: list,
        max_rounds: int,
        patience: int,
        writer: MetricsWriter | None = None,
        log: Callable[[str], None] = print) -> RunResult:
  """Runs up to `max_rounds` rounds with early stopping after `patience`."""
  num_clients = len(val_data)
  tracker = BestTracker(num_clients)
  since_best = 0
  round_seconds = []
  rounds_run = 0
  for round_num in range(max_rounds):
    start = time.perf_counter()
    metrics = dict(algorithm.run_round(round_num, train_data_fn(round_num)))
    val, test = algorithm.evaluate(val_data, test_data)
    elapsed = time.perf_counter() - start
    round_seconds.append(elapsed)
    rounds_run = round_num + 1

    for i in range(num_clients):
      metrics[f'client_{i}/val_accuracy'] = val[i]
      metrics[f'client_{i}/test_accuracy'] = test[i]
    metrics['mean/val_accuracy'] = float(np.mean(val))
    metrics['mean/test_accuracy'] = float(np.mean(test))
    metrics['round_seconds'] = elapsed
    improved = tracker.update(rounds_run, val, test)
    metrics['mean/test_accuracy_at_best_val'] = tracker.mean_test
    if writer is not None:
      writer.write(rounds_run, metrics)

    since_best = 0 if improved else since_best + 1
    mean_time = float(np.mean(round_seconds))
    remaining = max_rounds - rounds_run
    log(f'round {rounds_run}/{max_rounds} | '
        f'val {100 * np.mean(val):.2f}% test {100 * np.mean(test):.2f}% | '
        f'best-val test {100 * tracker.mean_test:.2f}% | '
        f'{elapsed:.1f}s | ETA <= {_duration(mean_time * remaining)} '
        f'({since_best}/{patience} rounds without a new best)')
    if since_best >= patience:
      return RunResult(tracker, rounds_run, True, round_seconds)
  return RunResult(tracker, rounds_run, False, round_seconds)
