r"""Our training curves next to the published PyTorch code's, at the settings
of issue 15 (real FMNIST, 4 clients x 2000 images, batch 8, lr 3e-4;
1 local epoch a round; FedCG also 1 GAN epoch and 1 x 100 server steps).

  .venv/bin/python -m benchmarks.compare_with_original \
      --output_dir=/var/tmp/fedcg_runs/compare_with_original --seeds=1,2,3

Each (algorithm, seed) is a resumable `run_fedcg` run in
`<output_dir>/<algorithm>/seed_<s>` (rerunning continues or reuses it).
Then it prints, and writes to `<output_dir>/comparison.md` and `.json`,
`mean/test_accuracy_at_best_val` (the mean over clients of the test
accuracy at each client's best-validation round so far) at the rounds the
original was measured at, the original's figure, and the difference.

The published code numbers its first round 0 and we number it 1
(fedcg_tff/program/round_loop.py, ROUND_NUMBERING): its round r is our round r + 1,
and the tables name rounds the original's way.

The original's figures were measured with its code at seed 1 (issue 15);
ours are seed by seed, and their mean when several seeds are run.
"""

import csv
import json
import os

from absl import app
from absl import flags

from binaries import common

# The original's `mean/test_accuracy_at_best_val` (%), by its 0-based round.
ORIGINAL = {
    'local': {0: 9.8, 2: 33.1, 5: 48.4, 8: 56.5, 10: 60.5, 16: 65.8},
    'fedavg': {0: 9.8, 2: 33.0, 5: 48.3, 8: 56.4, 10: 60.2, 16: 65.3},
    'fedcg': {0: 9.8, 2: 31.3, 5: 46.5, 8: 54.4, 10: 58.5, 11: 60.4},
}
# What the original was run with (besides the defaults of both codes).
RUN_FLAGS = ('--local_epochs=1', '--gan_epochs=1', '--server_epochs=1',
             '--server_steps_per_epoch=100')
METRIC = 'mean/test_accuracy_at_best_val'
TOLERANCE = 2.0  # Points: the bar.

flags.DEFINE_list('algorithms', list(ORIGINAL), 'Rows to run.')
flags.DEFINE_list('seeds', ['1'], 'Seeds to run.')
flags.DEFINE_string('output_dir', None, 'Where the runs and the report go.')
flags.DEFINE_string('data_dir', None, 'As run_fedcg\'s --data_dir.')
flags.DEFINE_bool('report_only', False,
                  'Report the finished runs in --output_dir without running.')
flags.mark_flag_as_required('output_dir')
FLAGS = flags.FLAGS


def run_dir(algorithm: str, seed: int) -> str:
  return os.path.join(os.path.abspath(FLAGS.output_dir), algorithm,
                      f'seed_{seed}')


def our_curve(algorithm: str, seed: int) -> dict[int, float] | None:
  """METRIC (%) by the original's 0-based round, from a run's CSV."""
  path = os.path.join(run_dir(algorithm, seed), 'metrics.csv')
  if not os.path.exists(path):
    return None
  with open(path, newline='') as f:
    return {int(row['round']) - 1: 100 * float(row[METRIC])
            for row in csv.DictReader(f)}


def comparison(curves: dict[str, dict[int, dict[int, float]]]) -> dict:
  """Per algorithm and original round: the original, ours per seed, their
  mean and the difference of the mean; the largest |difference|."""
  out = {}
  for algorithm, by_seed in curves.items():
    rows = {}
    for r, original in ORIGINAL[algorithm].items():
      ours = {s: c[r] for s, c in by_seed.items() if r in c}
      if not ours:
        continue
      mean = sum(ours.values()) / len(ours)
      rows[r] = {'original': original, 'ours': ours, 'mean': mean,
                 'difference': mean - original}
    worst = max((abs(v['difference']) for v in rows.values()), default=None)
    out[algorithm] = {'rounds': rows, 'max_abs_difference': worst,
                      'within_tolerance': worst is not None and
                      worst <= TOLERANCE}
  return out


def markdown(result: dict, seeds: list[int]) -> str:
  lines = []
  for algorithm, entry in result.items():
    rounds = sorted(entry['rounds'])
    if not rounds:
      continue
    header = ' / '.join(str(r) for r in rounds)
    lines.append(f'\n{algorithm}, rounds {header} (original numbering; ours '
                 f'is round + 1):\n')
    lines.append('| | ' + ' | '.join(f'r{r}' for r in rounds) + ' |')
    lines.append('|---|' + '---|' * len(rounds))
    cells = lambda f: ' | '.join(f(entry['rounds'][r]) for r in rounds)
    lines.append('| original (seed 1) | ' +
                 cells(lambda v: f'{v["original"]:.1f}') + ' |')
    for s in seeds:
      lines.append(f'| ours, seed {s} | ' + cells(
          lambda v, s=s: f'{v["ours"][s]:.1f}' if s in v['ours'] else '—')
                   + ' |')
    if len(seeds) > 1:
      lines.append('| ours, mean | ' + cells(lambda v: f'{v["mean"]:.1f}')
                   + ' |')
    lines.append('| difference | ' +
                 cells(lambda v: f'{v["difference"]:+.1f}') + ' |')
    verdict = ('within' if entry['within_tolerance'] else 'NOT within')
    lines.append(f'\nlargest |difference| {entry["max_abs_difference"]:.1f} '
                 f'points: {verdict} {TOLERANCE:g} at every round listed.')
  return '\n'.join(lines) + '\n'


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  bad = [a for a in FLAGS.algorithms if a not in ORIGINAL]
  if bad or not FLAGS.algorithms:
    raise app.UsageError(f'--algorithms: {bad or "empty"} not in '
                         f'{tuple(ORIGINAL)}')
  common.writable_dir()
  common.distinct_list('algorithms', str, 'names')
  seeds = common.distinct_list('seeds', int, 'integers')

  def run_args(algorithm, seed):
    rounds = max(ORIGINAL[algorithm]) + 1
    args = [f'--algorithm={algorithm}', f'--seed={seed}',
            f'--rounds={rounds}', f'--patience={rounds}',
            f'--output_dir={run_dir(algorithm, seed)}', *RUN_FLAGS]
    return args + ([f'--data_dir={FLAGS.data_dir}'] if FLAGS.data_dir else [])

  if not FLAGS.report_only:
    # Every run's flags (a seed out of range, say) before the first runs.
    common.check_run_fedcg_flags({f'{a} seed {s}': run_args(a, s)
                                  for a in FLAGS.algorithms for s in seeds})
    for algorithm in FLAGS.algorithms:
      for seed in seeds:
        args = run_args(algorithm, seed)
        print(f'{algorithm} seed {seed}: run_fedcg {" ".join(args)}',
              flush=True)
        code = common.run_fedcg(args)
        if code:
          raise SystemExit(f'{algorithm} seed {seed} failed (exit {code}); '
                           'rerun to resume it')
  curves = {}
  for algorithm in FLAGS.algorithms:
    found = {s: our_curve(algorithm, s) for s in seeds}
    curves[algorithm] = {s: c for s, c in found.items() if c}
  result = comparison(curves)
  text = markdown(result, seeds)
  print(text)
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  for name, content in (('comparison.md', text),
                        ('comparison.json', json.dumps(
                            {'seeds': seeds, 'run_flags': RUN_FLAGS,
                             'result': result}, indent=1))):
    path = os.path.join(FLAGS.output_dir, name)
    with open(f'{path}.tmp', 'w') as f:
      f.write(content)
    os.replace(f'{path}.tmp', path)


if __name__ == '__main__':
  app.run(main)
