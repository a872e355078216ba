r"""Sweeps algorithms x tasks x seeds and writes the paper's Table 1 and
Figure 5 from the results.

  .venv/bin/python -m binaries.run_experiments --output_dir=runs/sweep \
      --algorithms=local,fedavg,fedcg --tasks=fmnist --seeds=1,2 \
      --run_flags="--rounds=5 --local_epochs=1 --gan_epochs=1"

Each run is `binaries.run_fedcg` in its own process (started in this
process's working directory, so relative paths in --run_flags mean the same),
writing to `<output_dir>/<task>/<algorithm>/seed_<seed>` (without the
`<task>` level under --notask_dirs). `run_fedcg` itself
skips a finished run, resumes an unfinished one from its last completed
round and refuses a directory that holds a run with other flags, so
rerunning the same command after an interruption continues the sweep, and
a changed --run_flags cannot mix old results into the table (a refused or
failed run is left out of it). Then
`results.md` and `results.csv` (mean ± std over seeds of the mean over
clients of the test accuracy at each client's best-validation round), one
`paper_<task>.md` per task the paper's Table 1 has (ours beside the
paper's, with each run's rounds and median round time), one
`curves_<task>.png` per task (mean validation and test accuracy against
round, averaged over seeds), one `gain_<task>.png` per task (per-client
gain over Local, like the paper's Figure 5; needs `local` in --algorithms) and the same charts as TensorBoard
images in `<output_dir>/tensorboard` are written. `--report_only` writes
only these, from the runs' results.json and metrics.csv (no checkpoint
needed: a report can be remade from committed results).
"""

import os
import shutil
import time

from absl import app
from absl import flags

from binaries import common
# SIGTERM and SIGHUP end the sweep like Ctrl-C, and its run with it.
from fedcg_tff.execution import runtime  # pylint: disable=unused-import
from fedcg_tff.names import ALGORITHMS, TASKS
from fedcg_tff.program import run_record

flags.DEFINE_list('algorithms', list(ALGORITHMS), 'Algorithms to run.')
flags.DEFINE_list('tasks', ['fmnist'], 'Tasks to run.')
flags.DEFINE_list('seeds', ['1', '2', '3', '4', '5'], 'Seeds to run.')
flags.DEFINE_string('run_flags', '', 'Further flags for every run, e.g. '
                    '"--rounds=10 --local_epochs=1 --data_dir=..."; a flag '
                    'only some algorithms or tasks use (--prox_mu, '
                    '--train_per_client, ...) goes only to their runs.')
flags.DEFINE_string('output_dir', None, 'Directory of the sweep.')
flags.mark_flag_as_required('output_dir')
flags.DEFINE_bool('task_dirs', True, 'Runs under <output_dir>/<task>/'
                  '<algorithm>/seed_<seed>; --notask_dirs (one task only) '
                  'drops the <task> level, as results/fmnist_paper_protocol/ '
                  'does.')
flags.DEFINE_bool('report_only', False, 'Run nothing: write the reports '
                  'from the runs already in --output_dir (their results.json '
                  'and metrics.csv suffice, e.g. committed results).')
FLAGS = flags.FLAGS

_OWNED = ('algorithm', 'task', 'seed', 'output_dir')


def _check_flags() -> tuple[list[int], list[str]]:
  for name, allowed in (('algorithms', ALGORITHMS), ('tasks', TASKS)):
    bad = [v for v in FLAGS[name].value if v not in allowed]
    if bad or not FLAGS[name].value:
      raise app.UsageError(f'--{name}: {bad or "empty"} not in {allowed}')
    common.distinct_list(name, str, 'names')
  seeds = common.distinct_list('seeds', int, 'integers')
  if not FLAGS.task_dirs and len(FLAGS.tasks) != 1:
    raise app.UsageError(f'--notask_dirs needs one task, got --tasks='
                         f'{",".join(FLAGS.tasks)}')
  common.writable_dir()
  extra = common.split_flags('run_flags')
  for flag in extra:
    name = flag.lstrip('-').split('=')[0]
    if name in _OWNED:
      raise app.UsageError(f'--run_flags must not set --{name}: the sweep '
                           'sets it for each run')
  common.used_by_some('run_flags', extra, FLAGS.algorithms, FLAGS.tasks)
  return seeds, extra


def run_args(task: str, algorithm: str, seed: int,
             extra: list[str]) -> list[str]:
  """The flags of one run: the sweep's four and --run_flags, less the
  flags only other algorithms or tasks use (`common.run_flags_for`)."""
  return [f'--algorithm={algorithm}', f'--task={task}', f'--seed={seed}',
          f'--output_dir={run_dir(task, algorithm, seed)}',
          *common.run_flags_for(algorithm, task, extra)]


def _results_stamp(task: str, algorithm: str, seed: int):
  """The run's results.json's modification time, None while it has none."""
  try:
    return os.stat(os.path.join(run_dir(task, algorithm, seed),
                                run_record.RESULTS_FILE)).st_mtime_ns
  except OSError:
    return None


def run_dir(task: str, algorithm: str, seed: int) -> str:
  task_level = (task,) if FLAGS.task_dirs else ()
  return os.path.join(os.path.abspath(FLAGS.output_dir), *task_level,
                      algorithm, f'seed_{seed}')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  seeds, extra = _check_flags()
  runs = [(t, a, s) for t in FLAGS.tasks for a in FLAGS.algorithms
          for s in seeds]
  if FLAGS.report_only:
    write_reports(runs)
    return
  common.check_run_fedcg_flags({f'{t} {a} seed {s}': run_args(t, a, s, extra)
                                for t, a, s in runs})
  failed, failed_runs = [], set()
  started = time.monotonic()
  ran = {}  # (task, algorithm) -> seconds of each run this sweep ran.
  for n, (task, algorithm, seed) in enumerate(runs, 1):
    label = f'[{n}/{len(runs)}] {task} {algorithm} seed {seed}'
    print(f'{label}: {run_dir(task, algorithm, seed)}', flush=True)
    before = _results_stamp(task, algorithm, seed)
    run_started = time.monotonic()
    code = common.run_fedcg(run_args(task, algorithm, seed, extra))
    if code:
      failed.append((label, code))
      failed_runs.add((task, algorithm, seed))
      print(f'{label}: failed with exit code {code}', flush=True)
    elif before is None or _results_stamp(task, algorithm, seed) != before:
      # A run that trained (a finished one is passed over in a second).
      ran.setdefault((task, algorithm), []).append(
          time.monotonic() - run_started)
    left = runs[n:]
    if left and ran:
      print(f'sweep: {len(left)} run(s) left, about '
            f'{run_record.duration(common.sweep_time_left(ran, left))} at '
            'the times of the runs it trained (runs already finished and '
            'early stopping take less)', flush=True)
  print(f'sweep: {len(runs)} runs, {time.monotonic() - started:.0f}s',
        flush=True)
  if failed:
    # A run refused for other flags may hold an older finished result:
    # it must not enter this sweep's tables.
    print('left out of the report: ' + '; '.join(l for l, _ in failed),
          flush=True)
  write_reports([r for r in runs if r not in failed_runs])
  if failed:
    raise SystemExit(f'{len(failed)} run(s) failed: ' +
                     '; '.join(f'{l} (exit {c})' for l, c in failed))


def write_reports(runs) -> None:
  """results.md, results.csv, paper_<task>.md, the charts and their
  TensorBoard images from the finished runs among `runs` (those with a
  results.json: a run still going, or one that stopped on a fault, is in
  neither the tables nor the curves)."""
  # Imported here: TensorFlow starts only once the runs are done.
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import report  # pylint: disable=g-import-not-at-top

  output_dir = os.path.abspath(FLAGS.output_dir)
  # Everything is read before any earlier report is removed.
  results, curves_of = [], {}
  for task, algorithm, seed in runs:
    path = os.path.join(run_dir(task, algorithm, seed), 'results.json')
    if not os.path.exists(path):
      continue
    result = report.load_result(path, task, algorithm, seed)
    results.append(result)
    metrics_csv = os.path.join(os.path.dirname(path), 'metrics.csv')
    if os.path.exists(metrics_csv):
      curves_of.setdefault((task, algorithm), []).append(
          report.load_curves(metrics_csv))
    else:
      print(f'{metrics_csv} is missing: that run is in the tables but not '
            'in the curves', flush=True)
  # A normal sweep leaves out the runs that refused its flags; a report of
  # whatever is there (--report_only) must still not average runs made
  # with other flags into one cell.
  for task in FLAGS.tasks:
    for algorithm in FLAGS.algorithms:
      differences = report.definition_differences(
          [run_dir(task, algorithm, r.seed) for r in results
           if (r.task, r.algorithm) == (task, algorithm)])
      if differences:
        raise app.UsageError(
            f'{task} {algorithm}: its runs were made with other flags, '
            'which one mean ± std would mix: ' + '; '.join(differences) +
            ' (choose --seeds, or move those runs); no report was changed')
    mixed = report.mixed_client_counts(results, task)
    if mixed:
      raise app.UsageError(
          f'{task}: its runs have different numbers of clients ({mixed}), '
          'which one table and the gains per client would mix (choose '
          '--algorithms and --seeds, or move those runs); no report was '
          'changed')
  if not results:
    if FLAGS.report_only:
      raise app.UsageError(
          f'--report_only: none of the runs asked for has a results.json '
          f'(looked for {run_dir(*runs[0])}/results.json and the like): '
          'check --output_dir, --task_dirs, --algorithms and --seeds; no '
          'report was changed')
    print(f'no finished run to report: the reports already in {output_dir}, '
          'if any, were left as they were (an earlier invocation\'s)')
    return
  # An earlier invocation's reports go next, those of every task: one this
  # invocation does not write again (no Local for the gains, a task not
  # asked for now) would otherwise still show runs that results.md leaves
  # out. The sweep's TensorBoard holds only them.
  for name in ['results.md', 'results.csv'] + [
      f'{kind}_{task}.{ext}' for task in TASKS
      for kind, ext in (('paper', 'md'), ('curves', 'png'), ('gain', 'png'))]:
    if os.path.exists(os.path.join(output_dir, name)):
      os.remove(os.path.join(output_dir, name))
  shutil.rmtree(os.path.join(output_dir, 'tensorboard'), ignore_errors=True)
  rows = report.table(results, FLAGS.algorithms, FLAGS.tasks)
  markdown = report.markdown(rows)
  for name, text in (('results.md', markdown),
                     ('results.csv', report.csv_text(rows))):
    run_record.write_text_atomically(os.path.join(output_dir, name), text)
  print('\nTest accuracy (%) at best validation, mean ± std over seeds '
        '(seeds):\n' + markdown)
  for task in FLAGS.tasks:
    beside = report.paper_markdown(rows, results, task)
    if beside:
      run_record.write_text_atomically(
          os.path.join(output_dir, f'paper_{task}.md'), beside)
      print(f'Beside the paper\'s Table 1:\n{beside}')
  writer = tf.summary.create_file_writer(
      os.path.join(FLAGS.output_dir, 'tensorboard'))
  for task in FLAGS.tasks:
    curves = {algorithm: report.mean_curves(curves_of[task, algorithm])
              for algorithm in FLAGS.algorithms
              if (task, algorithm) in curves_of}
    if curves:
      path = os.path.join(FLAGS.output_dir, f'curves_{task}.png')
      pixels = report.curve_chart(curves, task, path)
      with writer.as_default():
        tf.summary.image(f'accuracy_curves/{task}', pixels[None], step=0)
      print(f'chart: {path}')
    gains = report.gains_over_local(results, task)
    if not gains:
      continue
    names = next((r.client_names for r in results if r.task == task and
                  r.client_names), ())
    count = len(next(iter(gains.values())))
    names = names or tuple(f'client {i}' for i in range(count))
    path = os.path.join(FLAGS.output_dir, f'gain_{task}.png')
    pixels, _ = report.gain_chart(gains, names,
                                  f'{task}: gain over Local', path)
    with writer.as_default():
      tf.summary.image(f'gain_over_local/{task}', pixels[None], step=0)
    print(f'chart: {path}')
    for algorithm, gain in gains.items():
      print(f'  {algorithm}: ' + ', '.join(
          f'{n} {g:+.2f}' for n, g in zip(names, np.round(gain, 2))))
  writer.flush()


if __name__ == '__main__':
  app.run(main)
