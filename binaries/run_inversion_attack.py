r"""Model inversion through FedCG's shared generator, after round R of a run.

  .venv/bin/python -m binaries.run_inversion_attack \
      --run_dir=runs/fedcg --fedavg_run_dir=runs/fedavg --rounds=1,10 \
      --output_dir=runs/inversion

The attacker is the honest-but-curious server after round R of the
`run_fedcg` run in --run_dir. It holds what FedCG sends it: client
--client's upload of round R (G_i, C_i, teacher logits; DP-FedCG: their
noised updates, as the run's DP flags noise them; the attacker raises
any batch-norm variance the noise pushed below 0 to 0, as the server does
to the mean, so that G_i can run). The upload is
recomputed exactly as the run made it: the run's state before round R (its
checkpoint of round R - 1, or the fresh state for R = 1) and the client's
round-R data through the algorithm's own client step; when the checkpoint
of round R is kept too, the recomputed E_i is compared with the saved one
and the difference printed.

Rows, on --num_images of the client's training images
(`fedcg_tff/privacy/inversion_tf.py` explains each):
  extractor: the true E_i (upper bound), or a shadow extractor the attacker
    trains with the client's G_i and C_i frozen on (own) the client's own
    training images (an oracle: they include the attacked images),
    (disjoint) the task's training images no client has, (shifted) those
    images under --shift;
  target: E_i(x) (upper bound), G_i(z*, y) with z* fitted to E_i(x) (an
    upper bound too: fitting z* needs E_i(x)), or a plain G_i(z, y), y the
    image's class (what the server can do; scored also against the class's
    mean image and the nearest client image of the class).
With --fedavg_run_dir, FedAvg's rows for scale: its client uploads E_i, so
the attacker inverts E_i(x) through the very extractor that made it.

Writes to --output_dir: inversion.md (the table), inversion.json (every
per-image figure, settings, replay check), grid_round_<R>.png (true image |
each row) and tensorboard/ (the grids, every reconstruction, PSNR means).
"""

import functools
import json
import os
import time

from absl import app
from absl import flags
from absl import logging
# TensorFlow before `app.run` (see run_privacy_attack.py).
import tensorflow as tf

from binaries import common
from fedcg_tff.execution import runtime  # Before TFF loads: clean exit.
from fedcg_tff.names import POOLED_TASKS

flags.DEFINE_string('run_dir', None, 'Output directory of the FedCG '
                    '`run_fedcg` run to attack (run.json, checkpoints/).')
flags.DEFINE_string('fedavg_run_dir', None, 'Optional: a FedAvg run of the '
                    'same task for the rows for scale.')
flags.DEFINE_list('rounds', ['1'], 'Rounds R after which the server attacks '
                  '(R = 1, or R - 1 among the run\'s kept checkpoints; R at '
                  'most its newest checkpoint\'s round).')
flags.DEFINE_integer('client', 0, 'Index of the attacked client.')
flags.DEFINE_integer('num_images', 8, 'Training images of the client to '
                     'invert (a seeded draw).')
flags.DEFINE_integer('iterations', 300, 'L-BFGS iterations of the image '
                     'inversion.')
flags.DEFINE_float('tv_weight', 0.01, 'Weight of the total-variation prior.')
flags.DEFINE_integer('latent_iterations', 200, 'L-BFGS iterations fitting '
                     'z* to E_i(x).')
flags.DEFINE_integer('latent_restarts', 4, 'Starting draws of z for z*.')
flags.DEFINE_integer('shadow_epochs', 5, 'Epochs of each shadow extractor\'s '
                     'training.')
flags.DEFINE_integer('aux_size', 2000, 'Labelled auxiliary images (disjoint '
                     'from every client\'s) of the disjoint and shifted '
                     'shadow extractors.')
flags.DEFINE_enum('shift', 'rotate', ['rotate', 'invert', 'blur', 'noise',
                                      'contrast'],
                  'The other distribution: the disjoint images shifted so '
                  '(tasks/fmnist_shift.py).')
flags.DEFINE_string('data_dir', None, 'As the run\'s --data_dir (default: '
                    'the one run.json records).')
flags.DEFINE_integer('seed', 1, 'Seeds the images drawn, the shadow '
                     'extractors\' own initialisation, z and the starts.')
flags.DEFINE_string('output_dir', None, 'Directory of the report.')
flags.mark_flags_as_required(['run_dir', 'output_dir'])
FLAGS = flags.FLAGS

TARGETS = {'features': 'E_i(x) (upper bound)',
           'fitted': 'G_i(z*, y), z* fitted to E_i(x) (upper bound)',
           'sampled': 'G_i(z, y), y the image\'s class'}


def _read_run(path: str, algorithm: str) -> dict:
  name = 'fedavg_run_dir' if algorithm == 'fedavg' else 'run_dir'
  try:
    with open(os.path.join(path, 'run.json')) as f:
      definition = json.load(f)
  except (OSError, ValueError) as e:
    raise app.UsageError(f'--{name}={path}: no readable run.json ({e})')
  run = definition['run']
  if run['algorithm'] != algorithm:
    raise app.UsageError(f'--{name}={path} is a {run["algorithm"]} run, '
                         f'not {algorithm}')
  if run['task'] not in POOLED_TASKS:
    # From run.json, before the task's data loads (DomainNet's: minutes).
    raise app.UsageError(
        f'--{name}={path} is a run of task {run["task"]}: the shadow '
        'extractors train on labelled auxiliary images from the pooled '
        'training split the clients are drawn from, which only '
        f'{", ".join(POOLED_TASKS)} have')
  if run.get('aggregation') == 'secure':
    raise app.UsageError(f'--{name}={path} used --aggregation=secure: the '
                         'server never sees one client\'s upload')
  if run.get('clients_per_round'):
    raise app.UsageError(f'--{name}={path} samples clients; attack a run '
                         'where every client takes part')
  if run.get('client_states_on_disk'):
    raise app.UsageError(f'--{name}={path} kept its client states on disk '
                         '(--client_states_on_disk), outside the checkpoints '
                         'the replay reads; attack a run without it')
  return definition


# What decides the clients' data and networks: the FedAvg run compared
# must share them with the FedCG run (the data's folder and source may be
# named differently for the same files, so they are not compared).
_SAME_DATA = {'run': ('task', 'num_clients', 'train_per_client', 'partition',
                      'dirichlet_alpha', 'add_noise', 'noise_std'),
              'config': ('seed', 'model', 'num_classes', 'image_channels')}


def _check_same_data(fedcg_run: dict, fedavg_run: dict) -> None:
  """Refuses a FedAvg run of other data; an unset --num_clients (the task's
  default) is compared once the tasks are loaded, the Dirichlet alpha only
  where the split is Dirichlet's."""
  for part, names in _SAME_DATA.items():
    for field in names:
      ours = fedcg_run.get(part, {}).get(field)
      theirs = fedavg_run.get(part, {}).get(field)
      if (field == 'num_clients' and None in (ours, theirs)) or (
          field == 'dirichlet_alpha' and
          fedcg_run['run'].get('partition') != 'dirichlet'):
        continue
      if ours != theirs:
        raise app.UsageError(
            f'--fedavg_run_dir={FLAGS.fedavg_run_dir} has {field} '
            f'{theirs!r}, --run_dir={FLAGS.run_dir} {ours!r}: the FedAvg '
            'run must be trained on the same clients\' data')


def _saves(run_dir: str):
  """The run's `Checkpoints`, or None if it has none: TFF's state manager
  would create a missing directory inside the run read."""
  from fedcg_tff.program import checkpoint  # pylint: disable=g-import-not-at-top
  directory = os.path.join(run_dir, 'checkpoints')
  return (checkpoint.Checkpoints(directory) if os.path.isdir(directory)
          else None)


def _check_rounds(run_dir: str, name: str, rounds: list[int]) -> None:
  """Refuses, before any work, a round R the run never ran (after its
  newest save: the round would be made up) or whose previous state (the
  save of round R - 1) the run does not keep."""
  saves = _saves(run_dir)
  kept = saves.kept_rounds() if saves is not None else []
  if kept and rounds[-1] > max(kept):
    raise app.UsageError(
        f'--rounds: --{name}={run_dir} has run {max(kept)} rounds (its '
        f'newest checkpoint), not round {rounds[-1]}')
  missing = [r for r in rounds if r > 1 and r - 1 not in kept]
  if missing:
    raise app.UsageError(
        f'--rounds: round {missing[0]} needs the state after round '
        f'{missing[0] - 1}, which --{name}={run_dir} does not keep (its '
        f'checkpoints: rounds {kept}; round 1 needs none)')


def _check_flags() -> list[int]:
  common.at_least(1, 'num_images', 'iterations', 'latent_iterations',
                  'latent_restarts', 'shadow_epochs', 'aux_size')
  common.finite('tv_weight')
  common.at_least(0, 'client')
  try:
    rounds = sorted({int(r) for r in FLAGS.rounds})
  except ValueError:
    raise app.UsageError(f'--rounds={",".join(FLAGS.rounds)}: not integers')
  if not rounds or rounds[0] < 1:
    raise app.UsageError(f'--rounds must be >= 1, got {FLAGS.rounds}')
  return rounds


@functools.cache
def _process(algorithm: str, config, dp_flags: tuple, num_clients: int):
  """The algorithm's process as the run built it (DP-FedCG: with its
  aggregator; `_Replay` refuses DP runs of other algorithms), traced once
  per interpreter: a script calling `main` for several attacks on one run
  (the tests do) traces it once. A process holds computations, no state
  (each `_Replay` has its own driver)."""
  from fedcg_tff.algorithms import catalog  # pylint: disable=g-import-not-at-top
  aggregation = {}
  if dp_flags:
    from fedcg_tff.privacy import dp  # pylint: disable=g-import-not-at-top
    dp_flags = dict(dp_flags)
    aggregation = dp.aggregation(algorithm, dp_flags['dp_sigma'],
                                 dp_flags['dp_clip'],
                                 dp_flags['dp_teacher_clip'], num_clients)
  return catalog.build_process(algorithm, config, **aggregation)


class _Replay:
  """A run's algorithm, its task and checkpoints: recomputes one client's
  round as the run did."""

  def __init__(self, run_dir: str, definition: dict, aux_size: int):
    from fedcg_tff.config import FedCGConfig  # pylint: disable=g-import-not-at-top
    from tasks.options import TaskOptions  # pylint: disable=g-import-not-at-top
    run = definition['run']
    self.run = run
    self.config = FedCGConfig(**definition['config']).validate()
    options = TaskOptions(
        num_clients=run['num_clients'],
        train_per_client=run['train_per_client'], seed=self.config.seed,
        data_dir=FLAGS.data_dir or run.get('data_dir'),
        data_source=run.get('data_source'), partition=run['partition'],
        dirichlet_alpha=run['dirichlet_alpha'], server_size=aux_size,
        add_noise=run['add_noise'], noise_std=run['noise_std'],
        image_size=self.config.image_size)
    try:
      self.task = common.load_task(run['task'], options)
    except app.UsageError as e:
      raise app.UsageError(f'{e} (with --aux_size={aux_size} auxiliary '
                           'images beside the run\'s)') from None
    self.dp = ({k: run[k] for k in ('dp_sigma', 'dp_clip', 'dp_teacher_clip')
                if k in run} if run.get('dp_sigma') else {})
    if self.dp and run['algorithm'] != 'fedcg':
      raise app.UsageError(f'{run_dir}: a DP {run["algorithm"]} run; only '
                           'DP-FedCG runs are replayed with their noise')
    self.run_dir = run_dir
    self._driver = None

  @property
  def driver(self):
    """The run's driver, built when first needed: a run refused on its
    flags or clients costs no tracing."""
    if self._driver is None:
      from fedcg_tff.program import driver as driver_lib  # pylint: disable=g-import-not-at-top
      process = _process(self.run['algorithm'], self.config,
                         tuple(sorted(self.dp.items())),
                         self.task.num_clients)
      self._driver = driver_lib.Driver(self.config, self.task.num_clients,
                                       process)
    return self._driver

  def state_after(self, rounds_done: int):
    from fedcg_tff.program import checkpoint  # pylint: disable=g-import-not-at-top
    from fedcg_tff.program import round_loop  # pylint: disable=g-import-not-at-top
    saves = _saves(self.run_dir)
    driver = self.driver  # Built outside the try: its errors are its own.
    try:
      if rounds_done and saves is None:
        raise ValueError(f'{self.run_dir} has no checkpoints')
      return round_loop.saved_algorithm_state(
          driver, saves, rounds_done, self.task.num_clients)
    except (ValueError, checkpoint.DamagedState) as e:
      raise app.UsageError(f'--rounds: round {rounds_done + 1} needs the '
                           f'state after round {rounds_done}: {e}')

  def client_round(self, round_num: int, client: int):
    """(server state before, client state before, client output) of
    `client`'s round
    `round_num` (1-based) as the run computed it."""
    server, clients = self.state_after(round_num - 1)
    data = self.task.train_datasets(round_num - 1, self.config.batch_size,
                                    self.config.image_size,
                                    self.config.replay_draws)
    # The whole round's clients' step, as the run computed it (a client
    # run alone could get other threads, hence other float rounding, which
    # Adam's first steps amplify).
    outputs = self.driver.process.parts.clients_step(
        server, list(clients), [data[i] for i in range(len(clients))])
    return server, clients[client], outputs[client]

  def saved_extractor(self, round_num: int, client: int):
    """E_i as the run saved it after `round_num`, if that save is kept."""
    try:
      _, clients = self.state_after(round_num)
    except app.UsageError:
      return None
    return clients[client].extractor


def _configure_precision(runs: dict) -> None:
  """Sets this process up for the runs' --matmul_precision before TFF
  starts its worker (`execution.precision`), so that a bfloat16 run is
  replayed as it ran. `runs`: flag name -> run.json content (or None).
  Runs of both precisions cannot share the worker, and a bfloat16 run
  needs a host with bfloat16 arithmetic: refused, naming the flags."""
  from fedcg_tff.execution import precision  # pylint: disable=g-import-not-at-top
  try:
    precision.configure_for_runs({
        f'--{flag}={FLAGS[flag].value}':
            run['config'].get('matmul_precision', 'float32')
        for flag, run in runs.items() if run is not None})
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  rounds = _check_flags()
  fedcg_run = _read_run(FLAGS.run_dir, 'fedcg')
  fedavg_run = (_read_run(FLAGS.fedavg_run_dir, 'fedavg')
                if FLAGS.fedavg_run_dir else None)
  _check_rounds(FLAGS.run_dir, 'run_dir', rounds)
  if fedavg_run is not None:
    _check_same_data(fedcg_run, fedavg_run)
    _check_rounds(FLAGS.fedavg_run_dir, 'fedavg_run_dir', rounds)
  # Before TensorFlow's first op (here and in the worker): this process's
  # own training and inversions take the runs' setting too.
  _configure_precision({'run_dir': fedcg_run, 'fedavg_run_dir': fedavg_run})
  common.writable_dir()
  common.fresh_report_dir('inversion.json', {
      f'--{name}={path}': path for name, path in (
          ('run_dir', FLAGS.run_dir), ('fedavg_run_dir', FLAGS.fedavg_run_dir))
      if path})

  import numpy as np  # pylint: disable=g-import-not-at-top
  from fedcg_tff.privacy import dlg_tf  # pylint: disable=g-import-not-at-top
  from fedcg_tff.algorithms import training_tf  # pylint: disable=g-import-not-at-top
  from fedcg_tff.models import model_weights  # pylint: disable=g-import-not-at-top
  from fedcg_tff.privacy import inversion_tf as inv  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import report  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import run_record  # pylint: disable=g-import-not-at-top
  from tasks import fmnist_shift  # pylint: disable=g-import-not-at-top
  from tasks import image_task  # pylint: disable=g-import-not-at-top

  runtime.set_local_cpp_context()
  started = time.monotonic()
  replay = _Replay(FLAGS.run_dir, fedcg_run, FLAGS.aux_size)
  config, task = replay.config, replay.task
  fedavg = (_Replay(FLAGS.fedavg_run_dir, fedavg_run, FLAGS.aux_size)
            if fedavg_run is not None else None)
  if fedavg and fedavg.task.client_names != task.client_names:
    # (--num_clients unset in one run.json: the task's default.)
    raise app.UsageError(
        f'--fedavg_run_dir={FLAGS.fedavg_run_dir} has clients '
        f'{", ".join(fedavg.task.client_names)}, --run_dir={FLAGS.run_dir} '
        f'{", ".join(task.client_names)}')
  if FLAGS.client >= task.num_clients:
    raise app.UsageError(f'--client={FLAGS.client}: the run has '
                         f'{task.num_clients} clients')
  own_images, own_labels = task.clients[FLAGS.client].train
  if FLAGS.num_images > len(own_labels):
    raise app.UsageError(f'--num_images={FLAGS.num_images} is more than '
                         f'client {FLAGS.client}\'s {len(own_labels)} '
                         'training images')
  prepare = lambda x: image_task.prepare_images(x, config.image_size,
                                                task.mean, task.std)
  to01 = lambda x: dlg_tf.to_unit_range(x, task.mean, task.std)
  chosen = np.random.default_rng(FLAGS.seed).permutation(
      len(own_labels))[:FLAGS.num_images]
  own = prepare(own_images)
  images, labels = own[chosen], own_labels[chosen].astype(np.int32)
  truth, own01 = to01(images), to01(own)
  aux = {'own': (own, own_labels),
         'disjoint': (prepare(task.server_images), task.server_labels),
         'shifted': (prepare(fmnist_shift.shift(
             FLAGS.shift, task.server_images, FLAGS.seed)),
                     task.server_labels)}
  extractor_labels = {
      'true': 'true E_i (upper bound)',
      'own': ('shadow, trained on the client\'s own images (an oracle: '
              'they include the attacked ones)'),
      'disjoint': (f'shadow, trained on {FLAGS.aux_size} other {task.name} '
                   'images'),
      'shifted': f'shadow, trained on those images, {FLAGS.shift}d'}
  options = inv.InversionOptions(
      iterations=FLAGS.iterations, tv_weight=FLAGS.tv_weight,
      latent_iterations=FLAGS.latent_iterations,
      latent_restarts=FLAGS.latent_restarts, seed=FLAGS.seed).validate()
  value_range = dlg_tf.input_range(task.mean, task.std)
  image_shape = images.shape[1:]
  attacker_seed = config.seed + dlg_tf.STAND_IN_SEED_OFFSET + FLAGS.seed
  print(f'{task.name}: inverting {FLAGS.num_images} training images of '
        f'client {FLAGS.client} after rounds {rounds} of {FLAGS.run_dir}'
        + (f' (DP-FedCG: {replay.dp})' if replay.dp else ''), flush=True)

  rows, recon, psnr_of, replay_checks = [], {}, {}, {}

  def add_row(round_num, algorithm, extractor, target, result, sampled):
    out01 = to01(result.images)
    row = {'round': round_num, 'algorithm': algorithm,
           'extractor': extractor, 'target': target,
           'label': f'R{round_num} {algorithm} {extractor} / {target}',
           'psnr': dlg_tf.psnr(truth, out01).tolist(),
           'ssim': dlg_tf.ssim(truth, out01).tolist(),
           'mismatch': result.mismatch.tolist()}
    if sampled:
      row.update({k: v.tolist() for k, v in inv.class_references(
          own01, own_labels, out01, labels).items()})
    rows.append(row)
    key = (f'{"fedavg " if algorithm == "fedavg" else ""}{extractor}\n'
           f'{target}')  # A grid column's title.
    recon.setdefault(round_num, {})[key] = out01
    psnr_of.setdefault(round_num, {})[key] = row['psnr']
    print(f'  [R{round_num} {algorithm} {extractor:8s} {target:8s}] PSNR '
          f'{np.mean(row["psnr"]):.2f} dB, SSIM {np.mean(row["ssim"]):.3f}'
          + (f', vs class mean {np.mean(row["psnr_class_mean"]):.2f} dB'
             if sampled else '') + f' ({result.seconds:.1f}s)', flush=True)

  # Every replay first: the attack below draws random numbers, and TF's
  # global random state (DP noise) would change the shuffles of datasets
  # made after it.
  def replayed_round(run: _Replay, r: int):
    # A whole clients' step each (its first also builds the process).
    began = time.monotonic()
    print(f'round {r}: recomputing the clients\' step of '
          f'{run.run["algorithm"]} from {run.run_dir}', flush=True)
    out = run.client_round(r, FLAGS.client)
    print(f'round {r}: recomputed ({time.monotonic() - began:.0f}s)',
          flush=True)
    return out

  replayed = {r: replayed_round(replay, r) for r in rounds}
  fedavg_uploads = {r: replayed_round(fedavg, r)[2].upload
                    for r in rounds} if fedavg else {}
  templates = training_tf.InitialNetworks(config, ('generator', 'classifier'))
  # One extractor network for every inversion of this attack, holding each
  # extractor's weights in turn: its objective is traced once.
  inverter = inv.FeatureInverter(
      inv.extractor_with(config, replayed[rounds[0]][2].state.extractor),
      image_shape, value_range, options)

  def invert(extractor_weights, target):
    model_weights.assign(inverter.extractor, extractor_weights)
    return inverter(target)

  for r in rounds:
    server, before, output = replayed[r]
    upload = output.upload
    generator_w, classifier_w = upload.generator, upload.classifier
    if replay.dp:  # What the server sees: G_g + the noised update, C too.
      tf.random.set_seed(FLAGS.seed * 100_003 + r)
      sigma, clip = replay.dp['dp_sigma'], replay.dp['dp_clip']
      generator_w = inv.dp_server_view(templates.model('generator'),
                                       server.generator, generator_w,
                                       sigma, clip)
      classifier_w = inv.dp_server_view(templates.model('classifier'),
                                        server.classifier, classifier_w,
                                        sigma, clip)
    true_e = output.state.extractor
    saved = replay.saved_extractor(r, FLAGS.client)
    if saved is not None:
      # The recomputed E_i must be far closer to the saved E_i than the
      # round moved E_i (a replay on another round's data is not).
      distance = lambda xs, ys: float(np.sqrt(sum(
          np.sum(np.square(x - y)) for x, y in zip(xs, ys))))
      check = replay_checks[r] = {
          'replay_to_saved': distance(true_e, saved),
          'round_change': distance(before.extractor, saved)}
      print(f'round {r}: recomputed E_i is {check["replay_to_saved"]:.3g} '
            f'(L2) from the run\'s saved one; the round moved it '
            f'{check["round_change"]:.3g}', flush=True)
    model_weights.assign(inverter.extractor, true_e)
    generator = inv.generator_with(config, generator_w)
    features = inverter.extractor(images, training=False).numpy()
    fitted, fit_mismatch = inv.fit_latent(generator, features, labels,
                                          options)
    print(f'round {r}: z* fits E_i(x) with mismatch '
          f'{np.mean(fit_mismatch):.3f} (||G(z*,y) - E(x)||^2 / ||E(x)||^2)',
          flush=True)
    targets = {'features': features, 'fitted': fitted,
               'sampled': inv.sample_features(generator, labels,
                                              FLAGS.seed + r)}
    extractors = {'true': true_e}
    for name, (x, y) in aux.items():
      shadow_started = time.monotonic()
      extractors[name] = inv.train_shadow_extractor(
          config, generator_w, classifier_w, x, y, inv.ShadowTraining(
              epochs=FLAGS.shadow_epochs, seed=attacker_seed))
      print(f'round {r}: shadow extractor on {name} images trained '
            f'({time.monotonic() - shadow_started:.0f}s)', flush=True)
    for ename, weights in extractors.items():
      for tname, t in targets.items():
        add_row(r, 'fedcg', ename, tname, invert(weights, t),
                tname == 'sampled')

    if fedavg:
      model_weights.assign(inverter.extractor, fedavg_uploads[r]['extractor'])
      target = inverter.extractor(images, training=False).numpy()
      add_row(r, 'fedavg', 'shared', 'features', inverter(target), False)

  references = {name: dlg_tf.psnr(truth, np.full_like(truth, value)).tolist()
                for name, value in (('black', 0.0), ('grey', 0.5))}
  markdown = report.inversion_markdown(rows, extractor_labels, TARGETS,
                                       references)
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  settings = {name: FLAGS[name].value for name in (
      'run_dir', 'fedavg_run_dir', 'rounds', 'client', 'num_images',
      'iterations', 'tv_weight', 'latent_iterations', 'latent_restarts',
      'shadow_epochs', 'aux_size', 'shift', 'seed')}
  summary = {'settings': settings, 'dp': replay.dp,
             'images': {'train_indices': chosen.tolist(),
                        'labels': labels.tolist()},
             'replay_check': replay_checks,
             'reference_psnr': references, 'rows': rows}
  for filename, text in (('inversion.md', markdown),
                         ('inversion.json', json.dumps(summary, indent=1))):
    run_record.write_text_atomically(
        os.path.join(FLAGS.output_dir, filename), text)
  writer = tf.summary.create_file_writer(
      os.path.join(FLAGS.output_dir, 'tensorboard'))
  with writer.as_default():
    tf.summary.image('inversion/true', truth, step=0, max_outputs=len(truth))
    for r, columns in recon.items():
      grid = os.path.join(FLAGS.output_dir, f'grid_round_{r}.png')
      pixels = report.reconstruction_grid(truth, columns, psnr_of[r], grid)
      tf.summary.image(f'inversion/grid_round_{r}', pixels[None], step=r)
      for key, images01 in columns.items():
        tag = key.replace('\n', '/').replace(' ', '_')
        tf.summary.image(f'inversion/round_{r}/{tag}', images01, step=r,
                         max_outputs=len(truth))
    for row in rows:
      tf.summary.scalar(f'psnr/{row["algorithm"]}/{row["extractor"]}/'
                        f'{row["target"]}', float(np.mean(row['psnr'])),
                        step=row['round'])
  writer.flush()
  print(f'\nModel inversion, client {FLAGS.client}, {FLAGS.num_images} '
        f'images ({time.monotonic() - started:.0f}s):\n' + markdown)
  print(f'report: {os.path.join(FLAGS.output_dir, "inversion.md")}; '
        f'grids: grid_round_R.png{report.grid_note(len(truth))}; '
        f'TensorBoard: tensorboard --logdir '
        f'{os.path.join(FLAGS.output_dir, "tensorboard")}')


if __name__ == '__main__':
  logging.set_verbosity(logging.WARNING)
  app.run(main)
