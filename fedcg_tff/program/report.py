"""The paper's kinds of output from finished runs: Table 1, Figure 5 and
Table 2 (privacy: `PrivacyRow`, written by binaries/run_privacy_attack.py).

Each run directory holds the `results.json` the binary writes. Table 1
reports, per algorithm and task, the mean over seeds of the run's figure
(the mean over clients of each client's test accuracy at its best-validation
round) ± the standard deviation over seeds (numpy's default, ddof=0).
Figure 5 shows, per task, each algorithm's per-client gain in that accuracy
over Local, averaged over seeds.
"""

import csv
import dataclasses
import io
import json
import os
from typing import Iterable, Sequence

import numpy as np

from fedcg_tff.program import run_record


@dataclasses.dataclass(frozen=True)
class RunResult:
  task: str
  algorithm: str
  seed: int
  test_at_best: tuple[float, ...]  # Per client, in [0, 1].
  client_names: tuple[str, ...] = ()
  rounds_run: int | None = None
  stopped_early: bool | None = None
  # Median of the rounds' wall times (evaluation included), from the run's
  # metrics.csv: unlike their sum, not moved by a few rounds during which
  # the run was paused (SIGSTOP) or the machine was busy.
  median_round_seconds: float | None = None
  # Whether the run.json beside results.json shows the paper's protocol
  # (PAPER_PROTOCOL); None without a run.json.
  paper_protocol: bool | None = None
  # The CPU the run finished on (`devices.host_cpu`; results.json's `host`),
  # None for runs written before it was recorded: round times differ
  # several-fold between the hosts of one machine kind.
  host: str | None = None

  @property
  def mean(self) -> float:
    return float(np.mean(self.test_at_best))


def load_result(path: str, task: str, algorithm: str, seed: int) -> RunResult:
  with open(path) as f:
    r = json.load(f)
  definition = os.path.join(os.path.dirname(path), 'run.json')
  protocol = None
  if os.path.exists(definition):
    with open(definition) as f:
      protocol = _at_paper_protocol(json.load(f))
  metrics_csv = os.path.join(os.path.dirname(path), 'metrics.csv')
  seconds = None
  if os.path.exists(metrics_csv):
    seconds = load_curves(metrics_csv, ('round_seconds',))['round_seconds']
    seconds = seconds[np.isfinite(seconds)]
  return RunResult(task, algorithm, seed,
                   tuple(float(v) for v in r['test_accuracy_at_best_val']),
                   tuple(r.get('client_names', ())), r.get('rounds_run'),
                   r.get('stopped_early'),
                   float(np.median(seconds)) if seconds is not None and
                   len(seconds) else None, protocol, r.get('host'))


# The paper's per-round budget, losses and client setup (FEDCG_SPEC.md), as
# run.json records them: what a run must have used to stand beside Table 1.
# Not the round cap: the reports show the rounds each run ran.
PAPER_PROTOCOL = {
    'config': {'model': 'lenet', 'batch_size': 8, 'lr': 3e-4,
               'weight_decay': 1e-4, 'noise_dim': 100, 'local_epochs': 20,
               'gan_epochs': 20, 'server_epochs': 20,
               'server_steps_per_epoch': 100, 'distance': 'mse',
               'gamma_ramp_rounds': 50, 'client_optimizer': 'adam',
               'prox_mu': 0.01, 'client_init': 'shared'},
    'run': {'partition': 'iid', 'add_noise': False, 'patience': 20},
}
# run.json fields where more than one value is the protocol's: the task's
# default (None) or the spec's figure.
PAPER_PROTOCOL_EITHER = {'num_clients': (None, 4),
                         'train_per_client': (None, 2000)}
# What run.json holds only for runs unlike the paper's: DP noise, secure
# aggregation, client sampling (`run_fedcg`'s definition).
NOT_PAPER_PROTOCOL = ('dp_sigma', 'aggregation', 'clients_per_round')


# run.json's config fields written only when not their default, which is
# the paper's arithmetic: float32 products (`run_fedcg.run_definition`).
PAPER_PROTOCOL_DEFAULTS = {'matmul_precision': 'float32'}


def _at_paper_protocol(definition: dict) -> bool:
  for part, wanted in PAPER_PROTOCOL.items():
    held = definition.get(part, {})
    if any(held.get(k) != v for k, v in wanted.items()):
      return False
  config = definition.get('config', {})
  if any(config.get(k, v) != v for k, v in PAPER_PROTOCOL_DEFAULTS.items()):
    return False
  run = definition.get('run', {})
  return (all(run.get(k) in allowed
              for k, allowed in PAPER_PROTOCOL_EITHER.items()) and
          not any(k in run for k in NOT_PAPER_PROTOCOL))


def definition_differences(run_dirs: Sequence[str]) -> list[str]:
  """How the run.json of each of `run_dirs` (the seeds of one task and
  algorithm) differs from the first's, the seed and data directory aside,
  one line per run (`run_record.differences`: the first run's value is
  "stored", this run's "given"). Runs made with other flags would mix into
  one mean ± std. Runs without a run.json are not compared."""
  held = []
  for run_dir in run_dirs:
    path = os.path.join(run_dir, 'run.json')
    if os.path.exists(path):
      with open(path) as f:
        definition = json.load(f)
      definition.get('config', {}).pop('seed', None)
      definition.get('run', {}).pop('data_dir', None)
      held.append((run_dir, definition))
  out = []
  for run_dir, definition in held[1:]:
    differing = run_record.differences(held[0][1], definition)
    if differing:
      out.append(f'{run_dir} against {held[0][0]}: {differing}')
  return out


def mixed_client_counts(results: Sequence[RunResult], task: str) -> str:
  """'' if every run of `task` in `results` has as many clients as the
  others; else which runs have how many (the gains over Local pair runs
  client by client, and one table would mix two setups)."""
  runs_of = {}
  for r in results:
    if r.task == task:
      runs_of.setdefault(len(r.test_at_best), []).append(
          f'{r.algorithm} seed {r.seed}')
  if len(runs_of) < 2:
    return ''
  return '; '.join(f'{count} clients: {", ".join(runs)}'
                   for count, runs in sorted(runs_of.items()))


def _ordered(values: Iterable[str], preferred: Sequence[str]) -> list[str]:
  values = set(values)
  return ([v for v in preferred if v in values] +
          sorted(values - set(preferred)))


def table(results: Sequence[RunResult], algorithms: Sequence[str] = (),
          tasks: Sequence[str] = ()) -> list[dict]:
  """Rows of Table 1: one per algorithm, a (mean, std, seeds) per task."""
  rows = []
  for algorithm in _ordered((r.algorithm for r in results), algorithms):
    row = {'algorithm': algorithm, 'cells': {}}
    for task in _ordered((r.task for r in results), tasks):
      per_seed = [r.mean for r in results
                  if r.algorithm == algorithm and r.task == task]
      if per_seed:
        row['cells'][task] = (100 * float(np.mean(per_seed)),
                              100 * float(np.std(per_seed)), len(per_seed))
    rows.append(row)
  return rows


def _tasks_of(rows) -> list[str]:
  seen = []
  for row in rows:
    for task in row['cells']:
      if task not in seen:
        seen.append(task)
  return seen


def markdown(rows: list[dict]) -> str:
  """Table 1 as Markdown: 'mean ± std (n seeds)' per cell, in %."""
  tasks = _tasks_of(rows)
  lines = ['| algorithm | ' + ' | '.join(tasks) + ' |',
           '|---|' + '---|' * len(tasks)]
  for row in rows:
    cells = []
    for task in tasks:
      if task in row['cells']:
        mean, std, n = row['cells'][task]
        cells.append(f'{mean:.2f} ± {std:.2f} ({n})')
      else:
        cells.append('—')
    lines.append(f'| {row["algorithm"]} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


# The paper's Table 1 (mean ± std over its seeds, in %), by our task names,
# for the tasks whose client count matches ours by default.
PAPER_TABLE_1 = {
    'fmnist': {'local': (79.66, 0.55), 'fedavg': (82.97, 0.67),
               'fedprox': (83.61, 0.64), 'feddf': (83.20, 0.57),
               'fedsplit': (81.95, 0.43), 'fedgen': (81.66, 0.46),
               'fedcg': (83.81, 0.28)},
}


def paper_markdown(rows: list[dict], results: Sequence[RunResult],
                   task: str) -> str:
  """Our Table 1 column for `task` beside the paper's: the difference (in
  points and in the paper's standard deviations), the gain over Local
  (ours: per client and paired by seed, `gains_over_local`, averaged over
  the clients; the paper's: the difference of its means), our spread with
  Bessel's correction too, and per seed its result, the rounds run
  (whether early stopping fired) and the median round time (and its host,
  where results.json records it). Empty if the paper has no column for
  `task`."""
  paper = PAPER_TABLE_1.get(task)
  if paper is None:
    return ''
  gains = gains_over_local(results, task)
  lines = [f'| algorithm | ours ({task}) | paper | ours − paper | in the '
           'paper\'s std | gain over Local: ours / paper | per seed: '
           'result, rounds run, median s/round |',
           '|---|---|---|---|---|---|---|']
  for row in rows:
    if task not in row['cells']:
      continue
    algorithm = row['algorithm']
    mean, std, n = row['cells'][task]
    runs, per_seed = [], []
    for r in sorted((r for r in results if r.task == task and
                     r.algorithm == algorithm), key=lambda r: r.seed):
      per_seed.append(100 * r.mean)
      stop = ' (early stop)' if r.stopped_early else ''
      per_round = (f', {r.median_round_seconds:.0f} s'
                   if r.median_round_seconds is not None else '')
      if r.host and per_round:
        per_round += f' on {r.host}'
      other = (' (not the paper\'s protocol)' if r.paper_protocol is False
               else '')
      runs.append(f'seed {r.seed}: {100 * r.mean:.2f}, {r.rounds_run}{stop}'
                  f'{per_round}{other}')
    ours = (f'{mean:.2f} ± {std:.2f} ({n}' +
            (f'; Bessel {np.std(per_seed, ddof=1):.2f})' if n > 1 else ')'))
    ref = paper.get(algorithm)
    if ref:
      beside = f'{ref[0]:.2f} ± {ref[1]:.2f} | {mean - ref[0]:+.2f} | '
      beside += f'{(mean - ref[0]) / ref[1]:+.1f} | ' if ref[1] else '— | '
    else:
      beside = '— | — | — | '
    if algorithm in gains:
      gain = f'{float(np.mean(gains[algorithm])):.2f} / '
      gain += (f'{ref[0] - paper["local"][0]:.2f}'
               if ref and 'local' in paper else '—')
    else:
      gain = '—'
    lines.append(f'| {algorithm} | {ours} | {beside}{gain} | ' +
                 '; '.join(runs) + ' |')
  return '\n'.join(lines) + '\n'


def csv_text(rows: list[dict]) -> str:
  """Table 1 as CSV: algorithm, then mean/std/seeds columns per task."""
  tasks = _tasks_of(rows)
  out = io.StringIO()
  writer = csv.writer(out)
  writer.writerow(['algorithm'] + [f'{t}_{k}' for t in tasks
                                   for k in ('mean', 'std', 'seeds')])
  for row in rows:
    values = []
    for task in tasks:
      values += ([f'{v:.4f}' if isinstance(v, float) else v
                  for v in row['cells'][task]]
                 if task in row['cells'] else ['', '', ''])
    writer.writerow([row['algorithm']] + values)
  return out.getvalue()


def gains_over_local(results: Sequence[RunResult], task: str
                     ) -> dict[str, np.ndarray]:
  """Per algorithm (not Local): per-client accuracy gain over Local in
  points, averaged over the seeds both have."""
  of_task = [r for r in results if r.task == task]
  local = {r.seed: np.asarray(r.test_at_best) for r in of_task
           if r.algorithm == 'local'}
  gains = {}
  for algorithm in _ordered({r.algorithm for r in of_task} - {'local'}, ()):
    diffs = [100 * (np.asarray(r.test_at_best) - local[r.seed])
             for r in of_task if r.algorithm == algorithm and r.seed in local]
    if diffs:
      gains[algorithm] = np.mean(diffs, axis=0)
  return gains


def _save_figure(fig, path: str) -> np.ndarray:
  """Writes `fig` as a PNG to `path` (write then rename, so a reader never
  sees half a file), closes it and returns its RGB pixels (uint8 [h, w,
  3], for TensorBoard): the PNG holds those pixels, drawn once (savefig
  would draw the figure again)."""
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  fig.canvas.draw()
  pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
  plt.close(fig)
  tmp = f'{path}.tmp.png'
  Image.fromarray(pixels).save(tmp, format='PNG')
  os.replace(tmp, path)
  return pixels


def gain_chart(gains: dict[str, np.ndarray], client_names: Sequence[str],
               title: str, path: str):
  """Figure 5: grouped bars, one group per client, one bar per algorithm.

  Writes a PNG to `path` (write then rename) and returns the figure's RGB
  pixels (uint8 [h, w, 3], for TensorBoard) and the number of bars drawn.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  algorithms = list(gains)
  num_clients = len(client_names)
  width = 0.8 / max(len(algorithms), 1)
  # The legend sits right of the bars: inside, it covered the tallest ones.
  fig, ax = plt.subplots(figsize=(2.8 + 1.3 * num_clients, 3.6), dpi=100)
  x = np.arange(num_clients)
  for k, algorithm in enumerate(algorithms):
    ax.bar(x - 0.4 + width * (k + 0.5), gains[algorithm], width,
           label=algorithm)
  ax.axhline(0.0, color='black', linewidth=0.8)
  ax.set_xticks(x)
  ax.set_xticklabels(client_names, rotation=15)
  ax.set_ylabel('test accuracy gain over Local (points)')
  ax.set_title(title)
  ax.legend(fontsize='small', loc='center left', bbox_to_anchor=(1.0, 0.5))
  fig.tight_layout()
  bars = sum(len(c) for c in ax.containers)
  return _save_figure(fig, path), bars


CURVE_METRICS = ('mean/val_accuracy', 'mean/test_accuracy')


def load_curves(metrics_csv: str, metrics: Sequence[str] = CURVE_METRICS
                ) -> dict[str, np.ndarray]:
  """Per metric (default: CURVE_METRICS), its value at each round of a run
  (from the run's metrics.csv: a report needs no checkpoint): element r is
  round r + 1's, NaN for a round without a row (lost to a power loss that
  its checkpoint survived: `run_files.resume_after` names it), so that
  later rounds stay in their place."""
  import csv as csv_module  # pylint: disable=g-import-not-at-top
  with open(metrics_csv, newline='') as f:
    rows = {int(r['round']): r for r in csv_module.DictReader(f)
            if int(r['round']) >= 1}
  out = {}
  for name in metrics:
    values = np.full(max(rows, default=0), np.nan)
    for round_num, row in rows.items():
      values[round_num - 1] = float(row[name])
    out[name] = values
  return out


def mean_curves(curves: Sequence[dict[str, np.ndarray]]
                ) -> dict[str, np.ndarray]:
  """The mean over runs (seeds) at each round, over the runs that reached
  it and have its row (runs that stopped early drop out of later rounds;
  NaN where no run has the round)."""
  out = {}
  for name in CURVE_METRICS:
    longest = max(len(c[name]) for c in curves)
    at_round = [[c[name][r] for c in curves
                 if len(c[name]) > r and np.isfinite(c[name][r])]
                for r in range(longest)]
    out[name] = np.array([np.mean(v) if v else np.nan for v in at_round])
  return out


def curve_chart(curves: dict[str, dict[str, np.ndarray]], title: str,
                path: str):
  """Mean validation and test accuracy (%) against round, one line per
  algorithm (`curves[algorithm]` from `mean_curves`), two panels. Writes a
  PNG to `path` (write then rename); returns the RGB pixels."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100, sharey=True)
  for ax, name, label in zip(axes, CURVE_METRICS, ('validation', 'test')):
    for algorithm, c in curves.items():
      ax.plot(np.arange(1, len(c[name]) + 1), 100 * c[name], label=algorithm)
    ax.set_xlabel('round')
    ax.set_title(f'{title}: mean {label} accuracy')
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('accuracy (%)')
  axes[1].legend(fontsize='small')
  fig.tight_layout()
  return _save_figure(fig, path)


# ---------------------------------------------------------------------------
# Table 2: accuracy and DLG reconstruction quality per algorithm.


@dataclasses.dataclass(frozen=True)
class PrivacyRow:
  """One algorithm (threat model) of Table 2."""
  name: str  # 'fedavg', 'fedavg_dp0.1', ...
  label: str  # 'FedAvg DP 0.1'
  psnr: tuple[float, ...]  # Per attacked image, dB.
  ssim: tuple[float, ...]
  labels_recovered: tuple[bool, ...]
  accuracy: float | None = None  # Mean test acc. at best val., in [0, 1].
  accuracy_rounds: int | None = None  # Rounds of that training run.
  epsilon_gradient: float | None = None  # DP: the attacked release alone.
  epsilon_training: float | None = None  # DP: the training run's rounds.
  seconds: float = 0.0  # Attack time, all images.


def _mean_std(values) -> tuple[float, float]:
  return float(np.mean(values)), float(np.std(values))


def _epsilon_text(value: float | None) -> str:
  if value is None:
    return '—'
  if not np.isfinite(value):
    return '∞'
  return f'{value:.3g}'


def privacy_markdown(rows: Sequence[PrivacyRow], delta: float) -> str:
  """Table 2 as Markdown: accuracy, PSNR and SSIM mean ± std over the
  attacked images (numpy's ddof 0), label recovery, epsilon."""
  lines = ['| algorithm | accuracy (%) | PSNR (dB) | SSIM | labels '
           f'recovered | ε (one gradient, δ={delta:g}) | ε (training, '
           f'δ={delta:g}) |',
           '|---|---|---|---|---|---|---|']
  for row in rows:
    accuracy = ('—' if row.accuracy is None else
                f'{100 * row.accuracy:.2f}' +
                (f' ({row.accuracy_rounds} rounds)'
                 if row.accuracy_rounds else ''))
    psnr_mean, psnr_std = _mean_std(row.psnr)
    ssim_mean, ssim_std = _mean_std(row.ssim)
    lines.append(
        f'| {row.label} | {accuracy} | {psnr_mean:.2f} ± {psnr_std:.2f} | '
        f'{ssim_mean:.3f} ± {ssim_std:.3f} | '
        f'{sum(row.labels_recovered)}/{len(row.labels_recovered)} | '
        f'{_epsilon_text(row.epsilon_gradient)} | '
        f'{_epsilon_text(row.epsilon_training)} |')
  return '\n'.join(lines) + '\n'


def privacy_csv(rows: Sequence[PrivacyRow]) -> str:
  """Table 2 as CSV, one row per algorithm."""
  out = io.StringIO()
  writer = csv.writer(out)
  writer.writerow(['algorithm', 'label', 'accuracy', 'accuracy_rounds',
                   'psnr_mean', 'psnr_std', 'ssim_mean', 'ssim_std',
                   'images', 'labels_recovered', 'epsilon_gradient',
                   'epsilon_training', 'attack_seconds'])
  number = lambda v: '' if v is None else f'{v:.6g}'
  for row in rows:
    psnr_mean, psnr_std = _mean_std(row.psnr)
    ssim_mean, ssim_std = _mean_std(row.ssim)
    writer.writerow([
        row.name, row.label, number(row.accuracy),
        '' if row.accuracy_rounds is None else row.accuracy_rounds,
        f'{psnr_mean:.4f}', f'{psnr_std:.4f}', f'{ssim_mean:.4f}',
        f'{ssim_std:.4f}', len(row.psnr), sum(row.labels_recovered),
        number(row.epsilon_gradient), number(row.epsilon_training),
        f'{row.seconds:.1f}'])
  return out.getvalue()


def inversion_markdown(rows: Sequence[dict], extractor_labels: dict,
                       target_labels: dict, references: dict) -> str:
  """The model-inversion table (binaries/run_inversion_attack.py): per
  round, extractor and target, PSNR and SSIM against the attacked images
  (mean ± std over them, numpy's ddof 0) and, for G(z, y) targets, PSNR
  against the class's mean image and the nearest client image of the
  class."""
  lines = ['| round | algorithm | extractor | target | PSNR (dB) | SSIM | '
           'PSNR vs class mean (dB) | PSNR vs nearest client image (dB) |',
           '|---|---|---|---|---|---|---|---|']
  cell = lambda values: '{:.2f} ± {:.2f}'.format(*_mean_std(values))
  for row in rows:
    extractor = ('FedAvg\'s shared E_i' if row['algorithm'] == 'fedavg'
                 else extractor_labels[row['extractor']])
    ssim_mean, ssim_std = _mean_std(row['ssim'])
    lines.append(
        f'| {row["round"]} | {row["algorithm"]} | {extractor} | '
        f'{target_labels[row["target"]]} | {cell(row["psnr"])} | '
        f'{ssim_mean:.3f} ± {ssim_std:.3f} | '
        + (f'{cell(row["psnr_class_mean"])} | {cell(row["psnr_nearest"])} |'
           if 'psnr_class_mean' in row else '— | — |'))
  return '\n'.join(lines) + '\n\nFor scale, constant images score: ' + (
      '; '.join(f'{name} {cell(v)} dB' for name, v in references.items())
      + '.\n')


# Rows of a reconstruction grid: 130 px each, and matplotlib refuses a
# figure of 2^16 px or more (504 rows). The attacks write every
# reconstruction to TensorBoard as well; the grid shows the first rows.
GRID_MAX_ROWS = 64


def grid_rows(count: int) -> int:
  """How many of `count` attacked images `reconstruction_grid` shows."""
  return min(count, GRID_MAX_ROWS)


def grid_note(count: int) -> str:
  """What a binary says beside a grid's path: '' when it shows all."""
  if grid_rows(count) == count:
    return ''
  return (f' (its first {grid_rows(count)} of {count} images; TensorBoard '
          'has every one)')


def reconstruction_grid(true_images: np.ndarray,
                        reconstructions: dict[str, np.ndarray],
                        psnrs: dict[str, Sequence[float]], path: str):
  """A grid of images in [0, 1] (NHWC): one row per attacked image (the
  first `grid_rows(len(true_images))`), the true image then each
  algorithm's reconstruction with its PSNR below it. Writes a PNG to
  `path` (write then rename); returns the figure's RGB pixels (uint8).

  One axes holds every tile, placed in inches (a cell of 1.25 x 1.3 in,
  column titles in the top 0.3 in): a subplot per tile made an inversion
  attack's 8 x 13 grid take about 5 s, most of it building axes."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  columns = ['true'] + list(reconstructions)
  count = grid_rows(len(true_images))
  width, height = 1.25 * len(columns), 1.3 * count + 0.3
  fig = plt.figure(figsize=(width, height), dpi=100)
  ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
  ax.set_axis_off()
  rows, cols = true_images.shape[1:3]
  tile_w, tile_h = 0.95 * min(1.0, cols / rows), 0.95 * min(1.0, rows / cols)
  for j, name in enumerate(columns):
    centre = 1.25 * j + 0.625
    ax.text(centre, 0.28, name, ha='center', va='bottom', fontsize=7)
    for i in range(count):
      image = true_images[i] if name == 'true' else reconstructions[name][i]
      image = np.clip(image, 0.0, 1.0)
      if image.shape[-1] == 1:
        image = np.repeat(image, 3, axis=-1)
      top = 0.3 + 1.3 * i + 0.05
      ax.imshow(image, interpolation='nearest',
                extent=(centre - tile_w / 2, centre + tile_w / 2,
                        top + tile_h, top))
      if name != 'true':
        ax.text(centre, top + tile_h + 0.04, f'{psnrs[name][i]:.1f} dB',
                ha='center', va='top', fontsize=7)
  # In inches from the top (set after the tiles: imshow resets them).
  ax.set_xlim(0.0, width)
  ax.set_ylim(height, 0.0)
  return _save_figure(fig, path)
