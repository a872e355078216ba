"""The round loop shared by every algorithm: evaluate, record, early-stop,
checkpoint and resume.

An algorithm is anything with `run_round(round_num, train_data) -> metrics`,
`evaluate(val_data, test_data) -> (val_accuracies, test_accuracies)` and
`state()` / `restore(state)`; this module keeps the paper's bookkeeping (per
client, the test accuracy at its best-validation round), writes every
round's metrics to TensorBoard and CSV through `tff.program` release
managers, prints progress, stops after `patience` rounds in which no client
reached a new best validation accuracy, and (with `checkpoint.Checkpoints`)
saves each completed round so that rerunning resumes where it stopped.

A round's metrics are released before its state is saved: a crash between
the two redoes that round on resume, and the CSV release manager replaces
rows from the redone round on, so every round appears once.

ROUND_NUMBERING, the one place it is defined:
* Everything a user reads counts rounds from 1: progress lines, the
  `round` column of metrics.csv, TensorBoard steps, `best_round` in the
  final table and results.json, `checkpoints/round_<n>` (n rounds done).
* The algorithms get the 0-based index r = round - 1: `run_round(r)`, the
  `round_num` of every server state (the round about to run), and so every
  noise draw keyed by round and FedCG's gamma ramp p = min(r / 50, 1),
  which makes gamma 0 in round 1 as in the published code.
* The published code prints that 0-based index: its round r is our round
  r + 1 (benchmarks/compare_with_original.py compares the two that way).
"""

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import tree

from fedcg_tff.program import checkpoint
from fedcg_tff.program import run_files
from fedcg_tff.program import run_record


class Algorithm(Protocol):

  def run_round(self, round_num: int, train_data: list) -> dict[str, float]:
    ...

  def evaluate(self, val_data: list,
               test_data: list) -> tuple[Sequence[float], Sequence[float]]:
    ...

  def state(self) -> Any:
    ...

  def restore(self, state: Any) -> None:
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
    if not len(val) == len(test) == self.num_clients:
      raise ValueError(f'{self.num_clients} clients, but {len(val)} '
                       f'validation and {len(test)} test accuracies')
    for i, (v, t) in enumerate(zip(val, test)):
      if v > self.best_val[i]:
        self.best_val[i], self.test_at_best[i] = float(v), float(t)
        self.best_round[i] = round_num
        improved = True
    return improved

  def as_arrays(self) -> dict[str, np.ndarray]:
    return {'best_val': np.asarray(self.best_val, np.float64),
            'test_at_best': np.asarray(self.test_at_best, np.float64),
            'best_round': np.asarray(self.best_round, np.int64)}

  def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
    self.best_val = [float(v) for v in arrays['best_val']]
    self.test_at_best = [float(v) for v in arrays['test_at_best']]
    self.best_round = [int(v) for v in arrays['best_round']]

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


def time_left(round_seconds, rounds_left: int) -> str:
  """At most how long the rounds left take, at the median round so far:
  a round paused (SIGSTOP while a test suite runs) or slowed by another
  job counts as one round, not as hours spread over all the rest (the
  mean's way). An upper bound in rounds only: early stopping may end the
  run sooner."""
  return run_record.duration(float(np.median(round_seconds)) * rounds_left)


@dataclasses.dataclass
class RunResult:
  tracker: BestTracker
  rounds_run: int
  stopped_early: bool
  round_seconds: list
  resumed_from: int = 0  # Rounds already done when this invocation began.


class NumericalFault(FloatingPointError):
  """A non-finite loss, metric or weight after a round."""


def _where(path: str) -> str:
  """'client_2/cls_loss' -> 'client 2: cls_loss'; state paths likewise."""
  head, _, rest = path.partition('/')
  if head.startswith('client_'):
    return f'client {head[len("client_"):]}: {rest}'
  if head in ('server', 'mean'):
    return f'{head}: {rest}'
  return path


def check_finite(round_num: int, metrics: dict[str, float], state) -> None:
  """Raises NumericalFault naming round, party and quantity if a metric or
  any value of the algorithm's state (server state, client states) is not
  finite. The client states are a list (client i at index i) or a mapping
  from client id to state (the clients of a sampled round). An algorithm's
  `run_round` calls it once a round, before it stores anything."""
  # Clients train before the server steps: a fault at a client shows up in
  # the server's metrics too, so clients are checked first to name where it
  # started.
  order = lambda item: (not item[0].startswith('client_'),
                        not item[0].startswith('server/'))
  for name, value in sorted(metrics.items(), key=order):
    if not np.isfinite(value):
      raise NumericalFault(f'round {round_num}, {_where(name)} is {value}')
  server, clients = state
  clients = (clients.items() if isinstance(clients, Mapping)
             else enumerate(clients))
  parts = [('server state', server)] + [
      (f'client {i} state', c) for i, c in clients]
  for party, structure in parts:
    for keys, leaf in tree.flatten_with_path(structure):
      path = '/'.join(str(k) for k in keys)
      leaf = np.asarray(leaf)
      if leaf.dtype.kind == 'f' and not np.all(np.isfinite(leaf)):
        raise NumericalFault(
            f'round {round_num}, {party}: {path} holds '
            f'{int(np.sum(~np.isfinite(leaf)))} non-finite value(s)')


def _loop_state(tracker: BestTracker, since_best: int,
                round_seconds: list) -> dict[str, np.ndarray]:
  return {**tracker.as_arrays(), 'since_best': np.int64(since_best),
          'round_seconds': np.asarray(round_seconds + [0.0], np.float64)}


def _checkpoint_template(fresh, num_clients: int) -> dict[str, Any]:
  """The structure `run` saves: the packed algorithm state and the loop's
  bookkeeping (as when nothing has run)."""
  return {'algorithm': checkpoint.pack(fresh),
          'loop': _loop_state(BestTracker(num_clients), 0, [])}


def saved_algorithm_state(algorithm: Algorithm,
                          checkpoints: checkpoint.Checkpoints,
                          rounds_done: int, num_clients: int) -> Any:
  """The algorithm state `run` saved after `rounds_done` rounds (0: the
  fresh state), without restoring it: what inspection tools (the
  inversion attack) start from."""
  fresh = algorithm.state()
  if rounds_done == 0:
    return fresh
  state = checkpoints.load(rounds_done,
                           _checkpoint_template(fresh, num_clients))
  return checkpoint.unpack(state['algorithm'], fresh)


def run(algorithm: Algorithm,
        train_data_fn: Callable[[int], list],
        val_data: list,
        test_data: list,
        max_rounds: int,
        patience: int,
        writer: run_files.MetricsWriter | None = None,
        log: Callable[[str], None] = print,
        checkpoints: checkpoint.Checkpoints | None = None) -> RunResult:
  """Runs up to `max_rounds` rounds with early stopping after `patience`.

  With `checkpoints`, each completed round's state is saved there, and a
  run that finds saved rounds continues after the newest intact one
  (`checkpoint.Checkpoints.resume`: a damaged save is set aside, named).
  """
  num_clients = len(val_data)
  tracker = BestTracker(num_clients)
  since_best = 0
  round_seconds = []
  rounds_run = 0
  if checkpoints is not None:
    fresh = algorithm.state()
    template = _checkpoint_template(fresh, num_clients)
    saved = {}

    def restore(rounds_done, state):
      algorithm.restore(checkpoint.unpack(state['algorithm'], fresh))
      saved.update(state)

    had_saves = checkpoints.had_saves()
    rounds_run = checkpoints.resume(template, restore, log)
    if not rounds_run:
      # Starting over (also after every save was set aside): the fresh
      # state; client files of an earlier attempt are moved aside, not
      # loaded (Driver.restore).
      algorithm.restore(fresh)
      aside = writer.set_aside() if had_saves and writer else None
      if aside is not None:
        log(f'the metrics of the rounds run before were moved to {aside}')
    if rounds_run:
      tracker.load_arrays(saved['loop'])
      since_best = int(saved['loop']['since_best'])
      round_seconds = [float(v) for v in saved['loop']['round_seconds'][:-1]]
      log(f'resuming after round {rounds_run} (checkpoint in '
          f'{checkpoints.directory})')
  resumed_from = rounds_run
  # Each round's time to its saved checkpoint, for the ETA: `round_seconds`
  # (the record) leave out writing the metrics and the checkpoint.
  until_saved = []
  if writer is not None:
    missing, damaged = writer.resume_after(rounds_run)
    if damaged:
      log(f'{writer.csv_path} had damaged lines: it and the TensorBoard logs '
          f'were kept in {damaged}; the run goes on with its readable rows')
    if missing:
      log(f'{writer.csv_path} has no row for rounds {missing} (lost before '
          'the interruption; the checkpoint kept their state): the '
          'curves have gaps there')
  if rounds_run and since_best >= patience:
    return RunResult(tracker, rounds_run, True, round_seconds, resumed_from)
  for round_num in range(rounds_run, max_rounds):
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
    # `run_round` raised NumericalFault before anything of a faulty round
    # was recorded: the last good round stays the latest checkpoint.
    packed = checkpoint.pack(algorithm.state())
    since_best = 0 if improved else since_best + 1
    if writer is not None:
      writer.write(rounds_run, metrics)
    if checkpoints is not None:  # After the release: see the module doc.
      checkpoints.save(rounds_run, {
          'algorithm': packed,
          'loop': _loop_state(tracker, since_best, round_seconds)})
    until_saved.append(time.perf_counter() - start)

    log(f'round {rounds_run}/{max_rounds} | '
        f'val {100 * np.mean(val):.2f}% test {100 * np.mean(test):.2f}% | '
        f'best-val test {100 * tracker.mean_test:.2f}% | '
        f'{elapsed:.1f}s | ETA <= '
        f'{time_left(until_saved, max_rounds - rounds_run)} '
        f'({since_best}/{patience} rounds without a new best)')
    if since_best >= patience:
      return RunResult(tracker, rounds_run, True, round_seconds, resumed_from)
  return RunResult(tracker, rounds_run, False, round_seconds, resumed_from)
