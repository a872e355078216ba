r"""The paper's Table 2: DLG gradient inversion against each algorithm, with
the accuracy of a training run of that algorithm.

  .venv/bin/python -m binaries.run_privacy_attack --output_dir=runs/privacy \
      --train_dir=runs/privacy_train \
      --train_flags="--rounds=10 --local_epochs=1 --gan_epochs=1"

For each algorithm of --algorithms (fedavg_dp once per --dp_sigma), an
honest-but-curious server attacks client --client's round-1 gradient on each
of --num_images of its training images (in batches of --attack_batch_size)
under that algorithm's threat model (fedcg_tff/dlg_tf.py states each),
with DLG (L-BFGS or Adam, --restarts per batch). It writes to --output_dir:

  privacy.md / privacy.csv  per algorithm: training accuracy, PSNR and SSIM
                            mean ± std over the images, labels recovered,
                            and for DP rows the (epsilon, delta) of the
                            attacked gradient alone and of the training run
  privacy.json              every per-image figure and the settings
  reconstructions.png       true image | each algorithm's reconstruction
  tensorboard/              the same grid, every reconstruction, PSNR means

Accuracy comes from `run_fedcg` runs: --results=name=path/results.json,...
names finished runs (names are the rows': fedavg, fedavg_dp0.1, fedsplit,
fedcg, ...; a run trained with other settings than the row is refused);
with --train_dir, each row without a result is trained there by
`run_fedcg` (one process at a time, resumable: rerunning continues), with
--train_flags, this binary's --seed, --task, --data_dir, --data_source,
--num_clients, --train_per_client and, for DP rows, --dp_sigma / --dp_clip / --dp_delta. Without either, the
accuracy column is empty.
"""

import json
import math
import os
import shlex
import time

from absl import app
from absl import flags
from absl import logging
# TensorFlow itself must be imported before `app.run`: imported inside it,
# Keras (2.14) builds functional models from graph tensors and fails
# ("'SymbolicTensor' object has no attribute 'node'").
import tensorflow as tf

from binaries import common
from fedcg_tff.execution import runtime  # pylint: disable=unused-import  # Before TFF loads: clean exit.
from fedcg_tff.names import PRIVACY_ALGORITHMS, TASK_FLAGS, TASKS
from tasks import registry

flags.DEFINE_list('algorithms', ['fedavg', 'fedavg_dp', 'fedsplit',
                                 'fedsplit_private', 'fedcg', 'fedcg_private'],
                  f'Threat models to attack, of {PRIVACY_ALGORITHMS}; '
                  'fedavg_dp gives one row per --dp_sigma; a *_private row '
                  'attacks (and trains) with --client_init=private.')
flags.DEFINE_list('dp_sigma', ['0.001', '0.1'],
                  'Noise stds of the fedavg_dp rows (the paper\'s 0.001 and '
                  '0.1).')
common.define_dp_flags()
flags.DEFINE_integer('num_images', 8, 'Training images of the client to '
                     'attack (a seeded draw).')
flags.DEFINE_integer('attack_batch_size', 1,
                     'Images behind one shared gradient.')
flags.DEFINE_integer('iterations', 300, 'Optimiser iterations per restart.')
flags.DEFINE_integer('restarts', 1, 'Random restarts per batch; the one '
                     'with the lowest gradient-matching loss is kept.')
flags.DEFINE_enum('attack_optimizer', 'lbfgs', ['lbfgs', 'adam'],
                  'L-BFGS (the original attack) or Adam.')
flags.DEFINE_float('adam_lr', 0.1, 'Learning rate of --attack_optimizer=adam.')
flags.DEFINE_enum('labels', 'auto', ['auto', 'infer', 'optimize'],
                  'Labels: inferred from the output-bias gradient (iDLG, '
                  'batch 1), optimised jointly (DLG), or auto (infer at '
                  'batch 1, else optimise).')
flags.DEFINE_enum('task', 'fmnist', list(TASKS), 'Data set (LeNet-5, 32x32).')
flags.DEFINE_string('data_dir', None, 'As run_fedcg\'s --data_dir.')
flags.DEFINE_enum('data_source', None, ['idx', 'tfds', 'folder'],
                  'As run_fedcg\'s --data_source.')
flags.DEFINE_integer('num_clients', None, 'As run_fedcg\'s --num_clients.')
flags.DEFINE_integer('train_per_client', 2000,
                     'As run_fedcg\'s --train_per_client.')
flags.DEFINE_integer('client', 0, 'Index of the attacked client.')
flags.DEFINE_integer('seed', 1, 'The runs\' seed: data split, initial '
                     'networks, client seeds (as run_fedcg\'s --seed); also '
                     'seeds the images drawn, the DP noise and the attack.')
flags.DEFINE_list('results', [], 'name=path/results.json of finished '
                  'run_fedcg runs, for the accuracy column.')
flags.DEFINE_string('train_dir', None, 'Train each row without --results '
                    'here, one run_fedcg run per row (<train_dir>/<name>).')
flags.DEFINE_string('train_flags', '', 'Further run_fedcg flags for '
                    '--train_dir runs, e.g. "--rounds=10 --local_epochs=1".')
flags.DEFINE_string('output_dir', None, 'Directory of the report.')
flags.mark_flag_as_required('output_dir')
FLAGS = flags.FLAGS

# run_fedcg flags this binary sets itself for --train_dir runs.
_OWNED = ('algorithm', 'output_dir', 'seed', 'task', 'data_dir',
          'data_source', 'num_clients', 'train_per_client', 'dp_sigma',
          'dp_clip', 'dp_delta', 'client_init')


def trained_as(threat: str) -> tuple[str, str]:
  """(`run_fedcg --algorithm`, `--client_init`) of a row's training run
  (dlg_tf.threat_model's naming, without importing TensorFlow)."""
  if threat == 'fedavg_dp':
    return 'fedavg', 'shared'
  if threat.endswith('_private'):
    return threat[:-len('_private')], 'private'
  return threat, 'shared'


def rows() -> list[tuple[str, str, float]]:
  """(row name, threat model, dp sigma) per report row, in flag order."""
  out = []
  for algorithm in FLAGS.algorithms:
    if algorithm == 'fedavg_dp':
      out += [(f'fedavg_dp{s:g}', algorithm, s) for s in _sigmas()]
    else:
      out.append((algorithm, algorithm, 0.0))
  return out


def _sigmas() -> list[float]:
  return common.distinct_list('dp_sigma', float, 'numbers',
                              lambda s: math.isfinite(s) and s > 0,
                              'finite and > 0')


def _check_flags() -> dict[str, str]:
  """Validates the flags; returns --results as {row name: path}."""
  bad = [a for a in FLAGS.algorithms if a not in PRIVACY_ALGORITHMS]
  if bad or not FLAGS.algorithms or len(set(FLAGS.algorithms)) != len(
      FLAGS.algorithms):
    raise app.UsageError(f'--algorithms: {bad or FLAGS.algorithms} must be '
                         f'distinct names of {PRIVACY_ALGORITHMS}')
  common.at_least(1, 'num_images', 'attack_batch_size', 'iterations',
                  'restarts', 'train_per_client', 'num_clients')
  if FLAGS.num_images % FLAGS.attack_batch_size:
    raise app.UsageError(
        f'--num_images={FLAGS.num_images} must be a multiple of '
        f'--attack_batch_size={FLAGS.attack_batch_size}')
  if FLAGS.labels == 'infer' and FLAGS.attack_batch_size != 1:
    raise app.UsageError('--labels=infer needs --attack_batch_size=1 (use '
                         '--labels=optimize or auto)')
  common.check_dp_flags()
  if 'fedavg_dp' not in FLAGS.algorithms:
    for name in ('dp_sigma', 'dp_clip', 'dp_delta'):
      if FLAGS[name].present:
        raise app.UsageError(f'--{name} is only used with fedavg_dp in '
                             '--algorithms')
  common.finite('adam_lr', 0.0, strict=True)
  common.at_least(0, 'client')
  common.seed()
  names = [name for name, _, _ in rows()]
  results = {}
  for item in FLAGS.results:
    name, sep, path = item.partition('=')
    if not sep or name not in names:
      raise app.UsageError(f'--results: {item!r} must be name=path with name '
                           f'one of the rows {names}')
    if not os.path.isfile(path):
      raise app.UsageError(f'--results: {path!r} ({name}) is not a file')
    results[name] = path
  if (FLAGS['train_per_client'].present and
      FLAGS.task not in TASK_FLAGS['train_per_client']):
    raise app.UsageError(f'--train_per_client is not used by --task='
                         f'{FLAGS.task}: each client holds its domain\'s '
                         'whole training split')
  extra = common.split_flags('train_flags')
  if extra and not FLAGS.train_dir:
    raise app.UsageError('--train_flags is only used with --train_dir')
  common.used_by_some('train_flags', extra,
                      {trained_as(threat)[0] for _, threat, _ in rows()},
                      [FLAGS.task])
  for flag in extra:
    name = flag.lstrip('-').split('=')[0]
    if name in _OWNED:
      raise app.UsageError(f'--train_flags must not set --{name}: this '
                           'binary sets it for each training run')
    if name == 'model':
      raise app.UsageError('--train_flags must not set --model: the '
                           'attack\'s networks are LeNet-5\'s')
  return results


def _train_dir(name: str) -> str:
  """Where row `name` trains: <train_dir>/<name>."""
  return os.path.join(os.path.abspath(FLAGS.train_dir), name)


def _training_command(name: str, threat: str, sigma: float) -> list[str]:
  """run_fedcg's flags for a row's training run into <train_dir>/<name>
  (less those its algorithm or task does not use: `common.run_flags_for`)."""
  algorithm, client_init = trained_as(threat)
  directory = _train_dir(name)
  command = [f'--algorithm={algorithm}', f'--client_init={client_init}',
             f'--seed={FLAGS.seed}', f'--task={FLAGS.task}',
             f'--output_dir={directory}']
  for flag in ('data_dir', 'data_source', 'num_clients', 'train_per_client'):
    if FLAGS[flag].value is not None:
      command.append(f'--{flag}={FLAGS[flag].value}')
  if sigma:
    command += [f'--dp_sigma={sigma!r}', f'--dp_clip={FLAGS.dp_clip!r}',
                f'--dp_delta={FLAGS.dp_delta!r}']
  return common.run_flags_for(algorithm, FLAGS.task,
                              command + common.split_flags('train_flags'))


def train(names_to_train: list[tuple[str, str, float]]) -> dict[str, str]:
  """Runs run_fedcg for each row into <train_dir>/<name>, every run's flags
  checked before the first starts; returns the results.json of each."""
  commands = {name: _training_command(name, threat, sigma)
              for name, threat, sigma in names_to_train}
  try:
    if commands:
      common.check_run_fedcg_flags(commands)
  except app.UsageError as e:
    raise app.UsageError(f'--train_flags or the flags passed on: training '
                         f'run {e}') from None
  found = {}
  for n, (name, command) in enumerate(commands.items(), 1):
    directory = _train_dir(name)
    print(f'[train {n}/{len(commands)}] {name}: run_fedcg '
          f'{shlex.join(command)}', flush=True)
    code = common.run_fedcg(command)
    if code:
      raise SystemExit(f'training run {name} failed with exit code {code} '
                       f'({directory}); rerun to resume it')
    found[name] = os.path.join(directory, 'results.json')
  return found


def accuracy_of(name: str, threat: str, sigma: float, path: str) -> dict:
  """The training figures of a row from its run's results.json; refuses a
  run of another algorithm or noise than the row's."""
  try:
    with open(path) as f:
      result = json.load(f)
    if not isinstance(result, dict):
      raise ValueError('not a JSON object')
    for key in ('mean_test_accuracy_at_best_val', 'rounds_run'):
      if key not in result:
        raise ValueError(f'no {key!r}')
  except (OSError, ValueError) as e:
    raise app.UsageError(f'--results: {path} ({name}) is not the '
                         f'results.json of a finished run_fedcg run ({e})'
                         ) from None
  algorithm, client_init = trained_as(threat)
  if result.get('algorithm') != algorithm:
    raise app.UsageError(f'--results: {path} is a run of '
                         f'{result.get("algorithm")!r}, not {algorithm!r} '
                         f'(row {name})')
  # Runs older than --client_init drew each client's networks privately.
  run_init = result.get('client_init', 'private')
  if algorithm in ('fedsplit', 'fedcg') and run_init != client_init:
    raise app.UsageError(f'--results: {path} was trained with client_init '
                         f'{run_init!r}, row {name} needs {client_init!r}')
  run_sigma = result.get('dp', {}).get('dp_sigma', 0.0)
  if not math.isclose(run_sigma, sigma):
    raise app.UsageError(f'--results: {path} was trained with dp_sigma '
                         f'{run_sigma}, row {name} needs {sigma}')
  # The rest of what makes the run this row's: its clip and delta, task,
  # data, seed and model (from the run.json beside it, when it is there; an
  # unset --data_source is the task's default; the clients, whose default
  # number only the loaded task knows, are compared in `main`).
  try:
    with open(os.path.join(os.path.dirname(path), 'run.json')) as f:
      definition = json.load(f)
  except (OSError, ValueError):
    definition = {}
  run, config = definition.get('run', {}), definition.get('config', {})
  wanted = {'task': (result.get('task'), FLAGS.task),
            'seed': (config.get('seed'), FLAGS.seed),
            'model': (config.get('model'), 'lenet'),
            'num_clients': (run.get('num_clients'), FLAGS.num_clients),
            'train_per_client': (run.get('train_per_client'),
                                 FLAGS.train_per_client),
            # A --matmul_precision=bfloat16 run (recorded only when set)
            # is not the float32 run a row reports.
            'matmul_precision': (config.get('matmul_precision', 'float32')
                                 if 'config' in definition else None,
                                 'float32')}
  # (A run of another task is refused for its task; its sources are not ours.)
  if 'run' in definition and result.get('task', FLAGS.task) == FLAGS.task:
    wanted['data_source'] = (
        registry.data_source(FLAGS.task, run.get('data_source')),
        registry.data_source(FLAGS.task, FLAGS.data_source))
  if sigma:
    # The run's epsilon is at its own delta: the report labels it with ours.
    for field in ('dp_clip', 'dp_delta'):
      wanted[field] = (result.get('dp', {}).get(field), getattr(FLAGS, field))
  for field, (got, want) in wanted.items():
    if got is not None and want is not None and got != want:
      raise app.UsageError(f'--results: {path} was trained with {field} '
                           f'{got!r}, row {name} needs {want!r}')
  return {'accuracy': float(result['mean_test_accuracy_at_best_val']),
          'rounds': int(result['rounds_run']),
          'epsilon_training': result.get('dp', {}).get('epsilon'),
          'dp_training': result.get('dp'),
          'client_names': result.get('client_names')}


def _check_clients(name: str, info: dict, results_path: str, task) -> None:
  """Refuses row `name`'s run if it trained on clients other than those
  the attack reads."""
  if info['client_names'] and tuple(info['client_names']) != tuple(
      task.client_names):
    raise app.UsageError(
        f'--results: {results_path} was trained on clients '
        f'{", ".join(info["client_names"])}; row {name} attacks '
        f'{", ".join(task.client_names)} (--num_clients, --task)')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  results = _check_flags()
  table_rows = rows()
  common.writable_dir()
  trained = ([name for name, _, _ in table_rows if name not in results]
             if FLAGS.train_dir else [])
  common.fresh_report_dir('privacy.json', {
      f'{_train_dir(name)} (row {name}\'s run under --train_dir)':
      _train_dir(name) for name in trained})
  started = time.monotonic()
  # The runs given are checked before any other row trains.
  given = {name: accuracy_of(name, threat, sigma, results[name])
           for name, threat, sigma in table_rows if name in results}

  # The project's TF modules load here, and the task with them: the client
  # and image count attacked are checked before any row trains.
  import numpy as np  # pylint: disable=g-import-not-at-top
  from fedcg_tff.privacy import dp  # pylint: disable=g-import-not-at-top
  from fedcg_tff.privacy import dlg_tf  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import driver  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import report  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import run_record  # pylint: disable=g-import-not-at-top
  from fedcg_tff.config import FedCGConfig  # pylint: disable=g-import-not-at-top
  from tasks import image_task  # pylint: disable=g-import-not-at-top
  from tasks.options import TaskOptions  # pylint: disable=g-import-not-at-top

  task = common.load_task(FLAGS.task, TaskOptions(
      num_clients=FLAGS.num_clients,
      train_per_client=FLAGS.train_per_client, seed=FLAGS.seed,
      data_dir=FLAGS.data_dir, data_source=FLAGS.data_source))
  if FLAGS.client >= task.num_clients:
    raise app.UsageError(f'--client={FLAGS.client}: the task has '
                         f'{task.num_clients} clients')
  train_images, train_labels = task.clients[FLAGS.client].train
  if FLAGS.num_images > len(train_labels):
    raise app.UsageError(f'--num_images={FLAGS.num_images} is more than '
                         f'client {FLAGS.client}\'s {len(train_labels)} '
                         'training images')
  for name, info in given.items():
    _check_clients(name, info, results[name], task)
  if FLAGS.train_dir:
    results.update(train([r for r in table_rows if r[0] not in results]))
  training = {name: given.get(name) or accuracy_of(name, threat, sigma,
                                                   results[name])
              for name, threat, sigma in table_rows if name in results}
  for name, info in training.items():
    if name not in given:  # The runs given were checked above.
      _check_clients(name, info, results[name], task)
  config = FedCGConfig(seed=FLAGS.seed, num_classes=task.num_classes,
                       image_channels=task.channels).validate()
  chosen = np.random.default_rng(FLAGS.seed).permutation(
      len(train_labels))[:FLAGS.num_images]
  images = image_task.prepare_images(train_images[chosen], config.image_size,
                                     task.mean, task.std)
  labels = train_labels[chosen].astype(np.int32)
  truth = dlg_tf.to_unit_range(images, task.mean, task.std)
  client_seed = driver.client_seeds(config, task.num_clients)[
      FLAGS.client]
  value_range = dlg_tf.input_range(task.mean, task.std)
  options = dlg_tf.AttackOptions(
      iterations=FLAGS.iterations, restarts=FLAGS.restarts,
      optimizer=FLAGS.attack_optimizer, adam_lr=FLAGS.adam_lr,
      labels=FLAGS.labels, seed=FLAGS.seed).validate()
  bs = FLAGS.attack_batch_size
  print(f'{task.name}: attacking client {FLAGS.client} '
        f'({task.client_names[FLAGS.client]}), {FLAGS.num_images} training '
        f'images in batches of {bs}; DLG {FLAGS.attack_optimizer}, '
        f'{FLAGS.iterations} iterations x {FLAGS.restarts} restart(s)',
        flush=True)

  table, recon01, per_image, threats = [], {}, {}, {}
  for name, threat_name, sigma in table_rows:
    threat = dlg_tf.threat_model(threat_name, sigma, FLAGS.dp_clip)
    threats[name] = threat
    print(f'{name}: the server sees {threat.statement}', flush=True)
    client = dlg_tf.round_one_networks(config, threat, client_seed)
    out_images = np.zeros_like(images)
    out_labels = np.zeros_like(labels)
    losses, row_started = [], time.monotonic()
    for b in range(0, FLAGS.num_images, bs):
      # The DP noise of batch b, the same draw whatever rows run before.
      tf.random.set_seed(FLAGS.seed * 100_003 + b)
      observation = dlg_tf.observe(config, threat, client,
                                       images[b:b + bs], labels[b:b + bs])
      result = dlg_tf.dlg_attack(config, observation, options,
                                     value_range)
      recovered = dlg_tf.to_unit_range(result.images, task.mean,
                                           task.std)
      order = dlg_tf.match_order(truth[b:b + bs], recovered)
      out_images[b:b + bs] = result.images[order]
      out_labels[b:b + bs] = result.labels[order]
      losses.append(result.matching_loss)
      psnr = dlg_tf.psnr(truth[b:b + bs],
                             dlg_tf.to_unit_range(
                                 out_images[b:b + bs], task.mean, task.std))
      print(f'  [{name} {b + bs}/{FLAGS.num_images}] PSNR '
            + ', '.join(f'{v:.2f}' for v in psnr) + ' dB, labels '
            f'{out_labels[b:b + bs].tolist()} (true '
            f'{labels[b:b + bs].tolist()}), matching loss '
            f'{result.matching_loss:.3g}, {result.seconds:.1f}s', flush=True)
    recon01[name] = dlg_tf.to_unit_range(out_images, task.mean, task.std)
    psnr = dlg_tf.psnr(truth, recon01[name])
    ssim = dlg_tf.ssim(truth, recon01[name])
    trained = training.get(name, {})
    row = report.PrivacyRow(
        name=name, label=threat.label, psnr=tuple(psnr), ssim=tuple(ssim),
        labels_recovered=tuple(bool(v) for v in out_labels == labels),
        accuracy=trained.get('accuracy'),
        accuracy_rounds=trained.get('rounds'),
        epsilon_gradient=(dp.epsilon(sigma, FLAGS.dp_clip, 1, FLAGS.dp_delta)
                          if sigma else None),
        epsilon_training=trained.get('epsilon_training'),
        seconds=time.monotonic() - row_started)
    table.append(row)
    per_image[name] = {'psnr': psnr.tolist(), 'ssim': ssim.tolist(),
                       'labels': out_labels.tolist(),
                       'matching_loss': losses}
    print(f'{name}: PSNR {np.mean(psnr):.2f} ± {np.std(psnr):.2f} dB, SSIM '
          f'{np.mean(ssim):.3f}, labels {int(np.sum(out_labels == labels))}/'
          f'{len(labels)}, {row.seconds:.0f}s', flush=True)

  os.makedirs(FLAGS.output_dir, exist_ok=True)
  # What reconstructions that know nothing score, for scale: a constant
  # black and a constant mid-grey image against the attacked images.
  references = {name: dlg_tf.psnr(truth, np.full_like(truth, value))
                for name, value in (('black', 0.0), ('grey', 0.5))}
  markdown = report.privacy_markdown(table, FLAGS.dp_delta) + (
      '\nFor scale, constant images score: ' + '; '.join(
          f'{name} {np.mean(v):.2f} ± {np.std(v):.2f} dB'
          for name, v in references.items()) + '.\n')
  settings = {name: FLAGS[name].value for name in (
      'algorithms', 'dp_sigma', 'dp_clip', 'dp_delta', 'num_images',
      'attack_batch_size', 'iterations', 'restarts', 'attack_optimizer',
      'adam_lr', 'labels', 'task', 'num_clients', 'train_per_client',
      'client', 'seed')}
  summary = {
      'settings': settings,
      'images': {'train_indices': chosen.tolist(), 'labels': labels.tolist()},
      'threat_models': {n: t.statement for n, t in threats.items()},
      'reference_psnr': {n: v.tolist() for n, v in references.items()},
      'stand_in_extractor_seed': (config.seed +
                                  dlg_tf.STAND_IN_SEED_OFFSET),
      'training': {n: {'results': results[n], **training[n]}
                   for n in training},
      'rows': {row.name: {'label': row.label, **per_image[row.name],
                          'epsilon_gradient': row.epsilon_gradient}
               for row in table},
  }
  for filename, text in (('privacy.md', markdown),
                         ('privacy.csv', report.privacy_csv(table)),
                         ('privacy.json', json.dumps(summary, indent=1))):
    run_record.write_text_atomically(
        os.path.join(FLAGS.output_dir, filename), text)
  psnrs = {row.name: row.psnr for row in table}
  grid_path = os.path.join(FLAGS.output_dir, 'reconstructions.png')
  pixels = report.reconstruction_grid(truth, recon01, psnrs, grid_path)
  writer = tf.summary.create_file_writer(
      os.path.join(FLAGS.output_dir, 'tensorboard'))
  with writer.as_default():
    tf.summary.image('reconstructions/grid', pixels[None], step=0)
    tf.summary.image('reconstructions/true', truth, step=0,
                     max_outputs=len(truth))
    for row in table:
      tf.summary.image(f'reconstructions/{row.name}', recon01[row.name],
                       step=0, max_outputs=len(truth))
      tf.summary.scalar(f'psnr/{row.name}', float(np.mean(row.psnr)), step=0)
      tf.summary.scalar(f'ssim/{row.name}', float(np.mean(row.ssim)), step=0)
  writer.flush()
  print(f'\nDLG on {FLAGS.num_images} images of client {FLAGS.client}, '
        f'mean ± std over images ({time.monotonic() - started:.0f}s):\n'
        + markdown)
  print(f'report: {os.path.join(FLAGS.output_dir, "privacy.md")}; grid: '
        f'{grid_path}{report.grid_note(len(truth))}; TensorBoard: '
        'tensorboard --logdir '
        f'{os.path.join(FLAGS.output_dir, "tensorboard")}')


if __name__ == '__main__':
  logging.set_verbosity(logging.WARNING)
  app.run(main)
