r"""Trains FedCG or a baseline with TFF's local runtime on a task (FMNIST by
default) and reports the paper's table.

  .venv/bin/python -m binaries.run_fedcg --output_dir=runs/fedcg_fmnist
  .venv/bin/python -m binaries.run_fedcg --algorithm=fedavg \
      --output_dir=runs/fedavg_fmnist

--algorithm is one of local, fedavg, fedprox, fedsplit, feddf, fedgen, fedcg:
all use the same networks, data, evaluation and early stopping.

Every hyper-parameter of the spec is a flag whose default is the published
code's. Per round it prints a progress line and writes TensorBoard summaries
and a CSV under --output_dir; at the end it prints, per client, the test
accuracy at its best-validation round, and their mean.
"""

import dataclasses
import json
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging

from binaries import common

from fedcg_tff.config import CLIENT_INITS, CLIENT_OPTIMIZERS, DISTANCES, MODELS, FedCGConfig
from fedcg_tff.execution import precision
from fedcg_tff.execution import runtime  # Before TFF starts a worker: clean shutdown.
from fedcg_tff.names import ALGORITHM_FLAGS, ALGORITHMS, DP_ALGORITHMS, SECURE_ALGORITHMS, SERVER_DATA_TASKS, TASK_FLAGS, TASKS
from tasks import partition  # Numpy only: flags are checked before TF.

_DEFAULTS = FedCGConfig()

flags.DEFINE_enum('algorithm', 'fedcg', list(ALGORITHMS),
                  'Which algorithm of the paper\'s Table 1 to run.')
flags.DEFINE_enum('task', 'fmnist', list(TASKS),
                  'Data set and client split (tasks/registry.py).')
flags.DEFINE_enum('model', _DEFAULTS.model, list(MODELS),
                  'Split networks: LeNet-5 (32x32) or ResNet-18 (224x224).')

# Hyper-parameters: one flag per FedCGConfig field, same name and default.
flags.DEFINE_integer('batch_size', _DEFAULTS.batch_size, 'Batch size.')
flags.DEFINE_float('lr', _DEFAULTS.lr, 'Adam learning rate (all optimizers).')
flags.DEFINE_float('weight_decay', _DEFAULTS.weight_decay,
                   'L2 weight decay of the E+C optimizer.')
flags.DEFINE_float('beta1', _DEFAULTS.beta1, 'Adam beta1 of E+C and server.')
flags.DEFINE_float('beta2', _DEFAULTS.beta2, 'Adam beta2 of E+C and server.')
flags.DEFINE_float('gan_beta1', _DEFAULTS.gan_beta1, 'Adam beta1 of D and G.')
flags.DEFINE_float('gan_beta2', _DEFAULTS.gan_beta2, 'Adam beta2 of D and G.')
flags.DEFINE_float('adam_epsilon', _DEFAULTS.adam_epsilon, 'Adam epsilon.')
flags.DEFINE_integer('noise_dim', _DEFAULTS.noise_dim, 'Generator noise size.')
flags.DEFINE_integer('local_epochs', _DEFAULTS.local_epochs,
                     'Stage-1 (E, C) epochs per round.')
flags.DEFINE_integer('gan_epochs', _DEFAULTS.gan_epochs,
                     'Stage-2 (D, G) epochs per round.')
flags.DEFINE_integer('server_epochs', _DEFAULTS.server_epochs,
                     'Server distillation epochs per round.')
flags.DEFINE_integer('server_steps_per_epoch',
                     _DEFAULTS.server_steps_per_epoch,
                     'Server distillation steps per epoch.')
flags.DEFINE_enum('distance', _DEFAULTS.distance, list(DISTANCES),
                  'L_dist between E(x) and G(z, y).')
flags.DEFINE_integer('gamma_ramp_rounds', _DEFAULTS.gamma_ramp_rounds,
                     'Rounds until the gamma ramp reaches ~1.')
flags.DEFINE_integer('seed', _DEFAULTS.seed, 'Seed of partition, init, noise.')
flags.DEFINE_enum('client_init', _DEFAULTS.client_init, list(CLIENT_INITS),
                  'shared: every client starts from the same networks, drawn '
                  'from --seed, as the server\'s G and C are (the published '
                  'code; the server then knows each client\'s initial E). '
                  'private: each client draws its private E and D from its '
                  'own seed.')
flags.DEFINE_enum('client_optimizer', _DEFAULTS.client_optimizer,
                  list(CLIENT_OPTIMIZERS),
                  'Client optimizer of E and C (sgd: no momentum).')
flags.DEFINE_float('prox_mu', _DEFAULTS.prox_mu,
                   'FedProx: weight mu of (mu/2)||w - w_global||^2.')
flags.DEFINE_float('diversity_weight', _DEFAULTS.diversity_weight,
                   'FedGen: weight of the generator\'s diversity term.')
flags.DEFINE_bool('replay_draws', _DEFAULTS.replay_draws,
                  'Replay the first round\'s random draws (data order and '
                  'flips, noise, distillation inputs) every round, the same '
                  'for every client, as the published code does by '
                  'reseeding each round; default: fresh draws each round '
                  'and per client.')
common.define_precision_flag()
# Run.
flags.DEFINE_integer('rounds', 200, 'Maximum number of rounds.')
flags.DEFINE_integer('patience', 20, 'Stop after this many rounds without a '
                     'new best validation accuracy on any client.')
flags.DEFINE_integer('num_clients', None,
                     'Number of clients (default: the task\'s: 4 for fmnist, '
                     'fmnist_shift and cifar10; one per domain otherwise).')
flags.DEFINE_integer('train_per_client', 2000,
                     'Training images drawn for each client (fmnist, '
                     'fmnist_shift, cifar10, digit5).')
flags.DEFINE_enum('partition', 'iid', ['iid', 'dirichlet'],
                  'Label split of fmnist, fmnist_shift and cifar10.')
flags.DEFINE_float('dirichlet_alpha', 0.5,
                   'Dirichlet concentration of --partition=dirichlet '
                   '(smaller: more skew).')
flags.DEFINE_bool('add_noise', False, 'Add Gaussian noise to client inputs, '
                  'std --noise_std * i / (n - 1) for client i.')
flags.DEFINE_float('noise_std', 0.0, 'See --add_noise.')
flags.DEFINE_integer('server_data_size', None,
                     'FedDF: unlabeled server images, disjoint from the '
                     'clients\' (default: 32000 of the training split for '
                     'fmnist and cifar10, 10000 MNIST images for digit5).')
flags.DEFINE_enum('data_source', None, ['idx', 'tfds', 'folder'],
                  'Where the task reads its data (default: the task\'s: IDX '
                  'files for fmnist, TFDS for cifar10, image folders for '
                  'digit5, office_caltech10 and domainnet).')
flags.DEFINE_string('data_dir', None,
                    'IDX directory (fmnist default: Debian\'s '
                    '/usr/share/datasets/fashion-mnist), image-folder root, '
                    'or TFDS data_dir.')
flags.DEFINE_string('output_dir', None, 'Directory for TensorBoard '
                    'summaries, metrics.csv, checkpoints and results.json. '
                    'Rerunning the same command into it resumes after the '
                    'last completed round.')
flags.mark_flag_as_required('output_dir')

FLAGS = flags.FLAGS
# Flags besides the FedCGConfig fields that decide a run's results: a rerun
# into the same --output_dir resumes only if they are unchanged.
RUN_FLAGS = ('algorithm', 'task', 'rounds', 'patience', 'num_clients',
             'train_per_client', 'partition', 'dirichlet_alpha', 'add_noise',
             'noise_std', 'server_data_size', 'data_source', 'data_dir')


def config_from_flags() -> FedCGConfig:
  fields = {f.name for f in dataclasses.fields(FedCGConfig)}
  values = {name: FLAGS[name].value for name in fields if name in FLAGS}
  config = FedCGConfig(**values)
  try:
    return config.validate()
  except ValueError as e:
    raise app.UsageError(f'--{e}') from None


def _no_server_data() -> app.UsageError:
  return app.UsageError(f'--algorithm=feddf needs unlabeled server data, '
                        f'which --task={FLAGS.task} does not provide')


def _check_run_flags():
  common.at_least(1, 'rounds', 'patience', 'num_clients', 'train_per_client',
                  'server_data_size')
  # A flag the run would ignore is refused: its value would otherwise look
  # set in run.json while the run did without it.
  for name, algorithms in ALGORITHM_FLAGS.items():
    if FLAGS[name].present and FLAGS.algorithm not in algorithms:
      raise app.UsageError(
          f'--{name} is only used by --algorithm={"|".join(algorithms)}, '
          f'not --algorithm={FLAGS.algorithm}')
  for name, tasks in TASK_FLAGS.items():
    if FLAGS[name].present and FLAGS.task not in tasks:
      raise app.UsageError(
          f'--{name} is only used by --task={"|".join(tasks)}, not '
          f'--task={FLAGS.task} (each of its clients holds its domain\'s '
          'whole training split)')
  if FLAGS.algorithm == 'feddf' and FLAGS.task not in SERVER_DATA_TASKS:
    raise _no_server_data()
  common.finite('dirichlet_alpha', partition.MIN_DIRICHLET_ALPHA)
  if FLAGS['dirichlet_alpha'].present and FLAGS.partition != 'dirichlet':
    raise app.UsageError('--dirichlet_alpha is only used with '
                         '--partition=dirichlet')
  common.finite('noise_std')
  if FLAGS.noise_std and not FLAGS.add_noise:
    raise app.UsageError('--noise_std is only used with --add_noise')
  if FLAGS.add_noise and not FLAGS.noise_std:
    raise app.UsageError('--add_noise needs --noise_std > 0')


def load_task(config: FedCGConfig):
  """The task the flags name; errors name the flags to fix."""
  from fedcg_tff.algorithms import catalog  # pylint: disable=g-import-not-at-top
  from tasks import registry  # pylint: disable=g-import-not-at-top
  from tasks.options import TaskOptions  # pylint: disable=g-import-not-at-top
  server_size = 0
  if catalog.needs_server_images(FLAGS.algorithm):
    server_size = (FLAGS.server_data_size or
                   registry.DEFAULT_SERVER_SIZE[FLAGS.task])
    if not server_size:
      raise app.UsageError(
          f'--algorithm=feddf needs unlabeled server data, which '
          f'--task={FLAGS.task} does not provide')
  options = TaskOptions(
      num_clients=FLAGS.num_clients, train_per_client=FLAGS.train_per_client,
      seed=config.seed, data_dir=FLAGS.data_dir,
      data_source=FLAGS.data_source, partition=FLAGS.partition,
      dirichlet_alpha=FLAGS.dirichlet_alpha, server_size=server_size,
      add_noise=FLAGS.add_noise, noise_std=FLAGS.noise_std,
      image_size=config.image_size)
  task = common.load_task(FLAGS.task, options)
  if server_size and task.server_images is None:
    raise _no_server_data()
  if server_size:
    # FedDF's server computation holds its images as float32 network inputs.
    size = config.image_size
    gib = server_size * size * size * task.channels * 4 / 2**30
    if gib > MAX_SERVER_GIB:
      raise app.UsageError(
          f'--server_data_size={server_size} at {size}x{size} ({config.model})'
          f' needs {gib:.1f} GiB as float32 inputs on the server, more than '
          f'{MAX_SERVER_GIB} GiB: use a smaller --server_data_size')
  for name, client in zip(task.client_names, task.clients):
    if config.batch_size > len(client.train[1]):
      raise app.UsageError(
          f'--batch_size={config.batch_size} is larger than client {name!r}\'s '
          f'{len(client.train[1])} training examples')
  return task


MAX_SERVER_GIB = 4  # FedDF's server images, as float32 network inputs.

# Test-only fault injection: FEDCG_TEST_INJECT_NAN=<round>:<client> makes
# that client's training images NaN in that (1-based) round, so that tests
# can check how a numerical fault stops a run and how the run resumes.
# FEDCG_TEST_HOLD_ROUND=<round> makes the run wait (up to 10 minutes) before
# that round, with the earlier rounds saved, so that a test's signal arrives
# at a known point however fast the host runs the tiny rounds.
_INJECT_NAN = 'FEDCG_TEST_INJECT_NAN'
_HOLD_ROUND = 'FEDCG_TEST_HOLD_ROUND'


def _with_injected_fault(train_data_fn):
  spec = os.environ.get(_INJECT_NAN)
  hold = os.environ.get(_HOLD_ROUND)
  if not spec and not hold:
    return train_data_fn
  fault_round, fault_client = ((int(v) for v in spec.split(':')) if spec
                               else (None, None))

  def train_data(round_num):
    if hold and round_num + 1 == int(hold):
      time.sleep(600)
    datasets = train_data_fn(round_num)
    if round_num + 1 == fault_round:
      datasets[fault_client] = datasets[fault_client].map(
          lambda x, y: (x * float('nan'), y))
    return datasets

  return train_data


# --- Workers and devices (README, "Speed and scale") ------------------------
common.define_worker_flags()
flags.DEFINE_enum('device', 'cpu', ['cpu', 'gpu'],
                  'Where training runs; gpu needs a CUDA TensorFlow and a '
                  'CUDA build of TFF\'s worker (fedcg_tff/execution/devices.py).')
flags.DEFINE_integer('logical_gpus', 1,
                     'With --device=gpu: logical devices per GPU (needs '
                     '--gpu_memory_mb).')
flags.DEFINE_integer('gpu_memory_mb', None,
                     'With --logical_gpus > 1: memory of each logical GPU.')


def _check_worker_flags():
  common.check_worker_flags()
  if FLAGS.device == 'cpu' and (FLAGS.logical_gpus != 1 or
                                FLAGS.gpu_memory_mb is not None):
    raise app.UsageError('--logical_gpus and --gpu_memory_mb need --device=gpu')
  common.at_least(1, 'logical_gpus', 'gpu_memory_mb')
  if FLAGS.gpu_memory_mb is not None:
    if FLAGS.logical_gpus == 1:
      raise app.UsageError('--gpu_memory_mb is only used with --logical_gpus '
                           '> 1 (one logical GPU grows its memory as needed)')
  elif FLAGS.logical_gpus > 1:
    raise app.UsageError(f'--logical_gpus={FLAGS.logical_gpus} needs '
                         '--gpu_memory_mb (each logical GPU\'s memory)')


def configure_device():
  from fedcg_tff.execution import devices  # pylint: disable=g-import-not-at-top
  try:
    devices.configure(FLAGS.device, FLAGS.logical_gpus, FLAGS.gpu_memory_mb)
  except ValueError as e:
    raise app.UsageError(f'--device={FLAGS.device}: {e}') from None


# --- End of workers and devices ---------------------------------------------


# --- Client sampling (cross-device scale; README, "Client sampling") --------
flags.DEFINE_integer('clients_per_round', None,
                     'Clients sampled each round, from (--seed, round) '
                     '(default: every client, every round). Below the '
                     'number of clients, client states are kept on disk in '
                     '<output_dir>/client_states/.')
flags.DEFINE_bool('client_states_on_disk', False,
                  'Keep client states on disk, one file per client, even '
                  'when every client takes part.')
CLIENT_STATES_DIR = 'client_states'


def client_sampling(num_clients: int):
  """The driver's `ClientSampling` for a task of `num_clients` clients;
  refuses more clients per round than there are (before anything is
  written)."""
  from fedcg_tff.program import client_store  # pylint: disable=g-import-not-at-top
  per_round = FLAGS.clients_per_round
  if per_round is not None and per_round > num_clients:
    given = (f', --num_clients={FLAGS.num_clients}' if FLAGS.num_clients
             else '')
    raise app.UsageError(
        f'--clients_per_round={per_round} is more than the run\'s '
        f'{num_clients} clients (--task={FLAGS.task}{given}): sample at most '
        f'{num_clients}')
  on_disk = FLAGS.client_states_on_disk or (
      per_round is not None and per_round < num_clients)
  return client_store.ClientSampling(
      clients_per_round=per_round,
      states_dir=(os.path.join(FLAGS.output_dir, CLIENT_STATES_DIR)
                  if on_disk else None))


def client_sampling_definition() -> dict:
  """The sampling flags for run.json, recorded only when set: a run without
  them has the same run.json as before they existed (older runs stay
  resumable), and a resume that changes them is refused, naming them."""
  definition = {}
  if FLAGS.clients_per_round is not None:
    definition['clients_per_round'] = FLAGS.clients_per_round
  if FLAGS.client_states_on_disk:
    definition['client_states_on_disk'] = True
  return definition
# --- End of client sampling -------------------------------------------------


# --- Private aggregation: DP (privacy/dp.py), secure sum ---------------------
flags.DEFINE_float('dp_sigma', 0.0,
                   'Gaussian noise std added on each client to what it '
                   'uploads (every coordinate, after clipping to --dp_clip), '
                   'through TF Privacy\'s GaussianSumQuery in a TFF '
                   'DifferentiallyPrivateFactory; 0: off. fedavg, fedprox '
                   'and fedsplit upload their round update; fedcg its '
                   'updates of G and C and its teacher logits, each part '
                   'clipped on its own (DP-FedCG). Uploads are then averaged '
                   'uniformly.')
flags.DEFINE_float('dp_teacher_clip', None,
                   'DP-FedCG: L2 norm the teacher logits are clipped to '
                   '(default: --dp_clip). The logits of 16000 distillation '
                   'inputs have norms in the thousands: a clip of 10 scales '
                   'them down a hundredfold.')
common.define_dp_flags()
flags.DEFINE_enum('aggregation', 'plain', ['plain', 'secure'],
                  'secure: the weighted mean through TFF\'s secure sum '
                  '(privacy/secure_aggregation.py): the server sees only '
                  'the sum of the uploads. fedavg, fedprox, fedsplit and '
                  'fedcg (FedDF and FedGen gather single models).')
flags.DEFINE_float('secure_bound', 2.0**17,
                   'With --aggregation=secure: every n_i-weighted uploaded '
                   'number is clipped to [-bound, bound] and quantised to 32 '
                   'bits before the secure sum (clipped counts are recorded '
                   'as aggregator/... metrics).')


def _check_dp_flags():
  common.finite('dp_sigma')
  common.check_dp_flags()
  if FLAGS.dp_teacher_clip is not None:
    common.finite('dp_teacher_clip', 0.0, strict=True)
  if FLAGS.aggregation == 'secure':
    common.finite('secure_bound', 0.0, strict=True)
    if FLAGS.algorithm not in SECURE_ALGORITHMS:
      raise app.UsageError(
          f'--aggregation=secure applies to --algorithm in '
          f'{SECURE_ALGORITHMS} (whose server needs only a sum), not '
          f'--algorithm={FLAGS.algorithm}')
    if FLAGS.dp_sigma:
      raise app.UsageError('--aggregation=secure and --dp_sigma: choose one '
                           '(the DP aggregator does its own sum)')
  elif FLAGS['secure_bound'].present:
    raise app.UsageError('--secure_bound is only used with '
                         '--aggregation=secure')
  if not FLAGS.dp_sigma:
    for name in ('dp_clip', 'dp_delta', 'dp_teacher_clip'):
      if FLAGS[name].present:
        raise app.UsageError(f'--{name} is only used with --dp_sigma > 0')
    return
  if FLAGS.algorithm not in DP_ALGORITHMS:
    raise app.UsageError(
        f'--dp_sigma applies to --algorithm in {DP_ALGORITHMS}, not '
        f'--algorithm={FLAGS.algorithm}')


def _teacher_clip():
  return (FLAGS.dp_clip if FLAGS.dp_teacher_clip is None
          else FLAGS.dp_teacher_clip)


def dp_definition() -> dict:
  """The DP and secure-aggregation flags for run.json, only when on (so
  other runs keep the run.json they had before these flags existed)."""
  definition = {}
  if FLAGS.aggregation == 'secure':
    definition.update(aggregation='secure', secure_bound=FLAGS.secure_bound)
  if FLAGS.dp_sigma:
    definition.update(dp_sigma=FLAGS.dp_sigma, dp_clip=FLAGS.dp_clip)
    if FLAGS.algorithm == 'fedcg':
      definition['dp_teacher_clip'] = _teacher_clip()
  return definition


def dp_aggregation(clients_per_round: int) -> dict:
  """`catalog.build` arguments for the DP and secure-aggregation flags
  (empty without either)."""
  if FLAGS.aggregation == 'secure':
    from fedcg_tff.privacy import secure_aggregation  # pylint: disable=g-import-not-at-top
    return {'aggregation_factory': secure_aggregation.mean_factory(
        FLAGS.secure_bound)}
  if not FLAGS.dp_sigma:
    return {}
  from fedcg_tff.privacy import dp  # pylint: disable=g-import-not-at-top
  return dp.aggregation(FLAGS.algorithm, FLAGS.dp_sigma, FLAGS.dp_clip,
                        _teacher_clip(), clients_per_round)


def dp_summary(rounds_run: int, rounds_started=None) -> dict:
  """results.json's `dp` entry: sigma, clip(s), noise multiplier(s) and the
  (epsilon, delta) of `rounds_run` rounds of noised uploads and of the
  further round starts `rounds_started` (`run_record.RoundsStarted`)
  recorded."""
  if not FLAGS.dp_sigma:
    return {}
  from fedcg_tff.privacy import dp  # pylint: disable=g-import-not-at-top
  teacher = _teacher_clip() if FLAGS.algorithm == 'fedcg' else None
  extra = rounds_started.extra_releases(rounds_run) if rounds_started else 0
  summary = dp.describe(FLAGS.dp_sigma, FLAGS.dp_clip, rounds_run,
                        FLAGS.dp_delta, teacher_clip=teacher, extra=extra)
  if rounds_started and rounds_started.partial:
    summary['round_starts_partial'] = True
  return {'dp': summary}


def recording_starts(train_data_fn, rounds_started):
  """`train_data_fn` (called once as each round starts, before the round
  runs) that first records the start in `rounds_started`
  (`run_record.RoundsStarted`), for a DP run's accounting."""

  def train_data(round_num):
    rounds_started.start(round_num + 1)
    return train_data_fn(round_num)

  return train_data


def print_dp(d: dict) -> None:
  """The results' DP line (`d`: `dp_summary`'s entry)."""
  if 'dp_teacher_clip' in d:  # DP-FedCG: the teacher's multiplier rules.
    what = (f'update of G and C clipped to {d["dp_clip"]:g} (noise '
            f'multiplier {d["noise_multiplier"]:.3g}) and teacher logits '
            f'clipped to {d["dp_teacher_clip"]:g} (noise multiplier '
            f'{d["teacher_noise_multiplier"]:.3g})')
  else:
    what = (f'update clipped to {d["dp_clip"]:g} (noise multiplier '
            f'{d["noise_multiplier"]:.3g})')
  from fedcg_tff.program import run_record  # pylint: disable=g-import-not-at-top
  extra = d.get('extra_releases', 0)
  releases = (f'{d["releases"]} rounds' if not extra else
              f'{d["releases"]} rounds of uploads ({extra} of them from '
              f'rounds started again after an interruption, '
              f'{run_record.ROUNDS_STARTED_FILE})')
  if d.get('round_starts_partial'):
    releases += (f' (a lower bound: {run_record.ROUNDS_STARTED_FILE} began '
                 'after the run had started, and a round run twice before '
                 'it is counted once)')
  bound = (' (an upper bound: clients sit out rounds they are charged for)'
           if FLAGS.clients_per_round else '')
  print(f'DP: noise std {d["dp_sigma"]:g} on each client {what}; '
        f'({d["epsilon"]:.4g}, {d["dp_delta"]:g})-DP per client after '
        f'{releases}{bound} (a client\'s uploads against zeros; against any '
        f'other client\'s: epsilon {d["epsilon_replace"]:.4g})')


def clipped_counts(csv_path: str) -> dict:
  """Per secure sum, the uploads it clipped over the run (metrics.csv's
  aggregator/.../secure_*_clipped_count columns, summed)."""
  import csv  # pylint: disable=g-import-not-at-top
  totals = {}
  with open(csv_path, newline='') as f:
    for row in csv.DictReader(f):
      for key, value in row.items():
        if key.endswith('clipped_count') and value:
          totals[key] = totals.get(key, 0) + int(float(value))
  return totals
# --- End of private aggregation ---------------------------------------------


def run_definition(config) -> dict:
  """run.json's content for these flags: the config (with the task's
  number of classes and channels) and the run flags."""
  definition = {'config': dataclasses.asdict(config),
                'run': {name: FLAGS[name].value for name in RUN_FLAGS}}
  if not config.replay_draws:
    # Written only when set, so that runs recorded before the flag existed
    # (the same draws) still resume and are still found finished.
    del definition['config']['replay_draws']
  if config.matmul_precision == 'float32':
    # Likewise: runs recorded before the flag existed were float32.
    del definition['config']['matmul_precision']
  definition['run'].update(client_sampling_definition())
  definition['run'].update(dp_definition())
  return definition


def _print_finished(done: dict) -> None:
  accuracy = done.get('mean_test_accuracy_at_best_val')
  print(f'{FLAGS.output_dir} already holds this finished run '
        f'({done.get("rounds_run", "?")} rounds): mean test accuracy at best '
        'validation ' + (f'{100 * accuracy:.2f}%' if accuracy is not None
                         else 'not recorded'))
  print(f'TensorBoard: .venv/bin/tensorboard --logdir '
        f'{os.path.join(FLAGS.output_dir, "tensorboard")}')


def check_flags() -> FedCGConfig:
  """Every check of the parsed flags that reads no file: the run's config."""
  config = config_from_flags()
  _check_run_flags()
  common.at_least(1, 'clients_per_round')
  _check_worker_flags()
  _check_dp_flags()
  if FLAGS.device == 'gpu' and FLAGS.matmul_precision != 'float32':
    raise app.UsageError(
        f'--matmul_precision={FLAGS.matmul_precision} sets oneDNN (CPU) '
        'kernels only: with --device=gpu the run would record it and '
        'compute in float32')
  common.check_precision_flag()
  return config


def check_runs(runs: dict) -> None:
  """Parses and checks each run's flags (label -> argv without the program
  name) as `main` does before reading any file; exits naming the first run
  refused and why. `common.check_run_fedcg_flags` runs it in a child."""
  for label, argv in runs.items():
    FLAGS.unparse_flags()
    try:
      rest = FLAGS(['run_fedcg', *argv])
      if len(rest) > 1:
        raise app.UsageError(f'Unexpected arguments: {rest[1:]}')
      check_flags()
    except (app.UsageError, flags.Error) as e:
      print(f'{label}: {e}', file=sys.stderr)
      sys.exit(common.REFUSED)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config = check_flags()
  # A finished run in --output_dir is reported, and a run with other flags
  # (finished or not) refused, before TensorFlow is imported. What the data
  # decides (classes, channels) is taken from the stored run: the task's
  # flags are compared.
  from fedcg_tff.program import run_record  # pylint: disable=g-import-not-at-top

  # Not yet whether it may be written: a finished run is reported from a
  # read-only directory too.
  common.writable_dir(access=False)

  def from_stored(stored):
    task_shape = {k: stored.get('config', {}).get(k)
                  for k in ('num_classes', 'image_channels')}
    return run_definition(dataclasses.replace(config, **task_shape))

  try:
    done = run_record.finished_run(FLAGS.output_dir, from_stored)
  except (OSError, ValueError) as e:  # FileExistsError is an OSError.
    raise app.UsageError(str(e)) from None
  if done is not None:
    _print_finished(done)
    return
  common.writable_dir()
  configure_device()
  common.configure_precision()

  # TensorFlow starts here, after the flag checks: bad flags fail fast.
  # Data first: a missing data set must not leave an output directory.
  task = load_task(config)
  sampling = client_sampling(task.num_clients)
  # Remote workers answer before anything is written.
  pool = common.worker_pool()
  config = dataclasses.replace(config, num_classes=task.num_classes,
                               image_channels=task.channels)
  try:
    resuming, lock = run_record.claim_output_dir(FLAGS.output_dir,
                                                 run_definition(config))
  except (OSError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  with lock:
    _run(config, task, sampling, pool, resuming)


def _saved(checkpoints) -> str:
  """What a run that stopped on a fault has saved, and what rerunning does."""
  good = checkpoints.latest_round()
  if not good:
    return ('no round was saved yet, and rerunning the same command starts '
            'the run again')
  saved = 'round 1 is' if good == 1 else f'rounds 1-{good} are'
  return (f'{saved} saved in {checkpoints.directory}, and '
          f'rerunning the same command resumes after round {good}')


def _exit_if_out_of_space(error, checkpoints, writing: str = '') -> None:
  """Exits with what to do if `error` is a disk running out of space
  (`writing`: the file being written, when the error may not name it); a
  traceback would bury it. Returns otherwise."""
  from fedcg_tff.program import run_record  # pylint: disable=g-import-not-at-top
  if not run_record.out_of_space(error):
    return
  newest = checkpoints.latest_round()
  sizes = []
  if newest:
    sizes.append(f'a checkpoint of this run takes '
                 f'{run_record.directory_bytes(checkpoints.path(newest)) / 2**20:.1f} MB, '
                 f'and two are kept beside the one being written')
  states = os.path.join(FLAGS.output_dir, 'client_states')
  if os.path.isdir(states):
    sizes.append(f'its client_states/ holds '
                 f'{run_record.directory_bytes(states) / 2**20:.1f} MB')
  need = f' ({"; ".join(sizes)})' if sizes else ''
  sys.exit(f'Out of disk space{" writing " + writing if writing else ""}: '
           f'{run_record.out_of_space_line(error)}\nThe run stopped; '
           f'{_saved(checkpoints)}, once there is space{need}.')


def _exit_if_denied(error, checkpoints) -> None:
  """Exits with what to do if `error` is this user being refused a file
  (the run's checkpoints/, client_states/ or metrics.csv made another
  user's or read-only while it ran, or data it reads); a traceback would
  bury the path. Returns otherwise."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if isinstance(error, PermissionError):
    what = str(error)  # Both paths of a rename.
  elif isinstance(error, tf.errors.PermissionDeniedError):
    what = error.message
  else:
    return
  sys.exit(f'Permission denied: {what}\nThe run stopped; '
           f'{_saved(checkpoints)}, once this user may read and write that '
           'path.')


def _run(config, task, sampling, pool, resuming):
  """Trains (or resumes) the run in --output_dir, then writes and prints
  its results; `main` holds the directory's lock meanwhile."""
  from fedcg_tff.algorithms import catalog  # pylint: disable=g-import-not-at-top
  from fedcg_tff.execution import workers  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import checkpoint  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import client_store  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import round_loop  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import run_files  # pylint: disable=g-import-not-at-top
  from fedcg_tff.program import run_record  # pylint: disable=g-import-not-at-top

  results_path = os.path.join(FLAGS.output_dir, run_record.RESULTS_FILE)
  if resuming and os.path.exists(results_path):  # Finished meanwhile.
    with open(results_path) as f:
      _print_finished(json.load(f))
    return

  rounds_started = None  # A DP run's, read before the long build.
  if FLAGS.dp_sigma:
    try:
      # Rounds ran here before, with no record of their starts: a run
      # begun before the record existed.
      ran_before = resuming and any(
          os.path.exists(os.path.join(FLAGS.output_dir, name))
          for name in ('checkpoints', run_files.METRICS_FILE))
      rounds_started = run_record.RoundsStarted(FLAGS.output_dir, ran_before)
    except ValueError as e:
      sys.exit(str(e))
  runtime.set_local_cpp_context(FLAGS.max_concurrent_clients)
  print(task.describe(), flush=True)
  print(f'{FLAGS.algorithm} with {config.model}; building computations...',
        flush=True)
  size = config.image_size
  try:
    algorithm = catalog.build(FLAGS.algorithm, config, task.num_clients,
                              server_images=task.server_inputs(size),
                              sampling=sampling, workers=pool,
                              **dp_aggregation(sampling.clients_per_round or
                                               task.num_clients))
  except client_store.ForeignStates as e:
    sys.exit(f'Cannot resume: {e} Start in a new --output_dir; no client '
             'state was changed.')
  if pool is not None:
    print(f'clients of each round spread over {len(pool)} TFF workers',
          flush=True)
  writer = run_files.MetricsWriter(FLAGS.output_dir)
  started = time.monotonic()
  checkpoints = checkpoint.Checkpoints(
      os.path.join(FLAGS.output_dir, 'checkpoints'))
  train_data_fn = _with_injected_fault(
      lambda r: task.train_datasets(r, config.batch_size, size,
                                    config.replay_draws))
  if rounds_started is not None:
    train_data_fn = recording_starts(train_data_fn, rounds_started)
  try:
    result = round_loop.run(
        algorithm,
        train_data_fn=train_data_fn,
        val_data=task.val_datasets(size),
        test_data=task.test_datasets(size),
        max_rounds=FLAGS.rounds,
        patience=FLAGS.patience,
        writer=writer,
        log=lambda line: print(line, flush=True),
        checkpoints=checkpoints)
  except checkpoint.StateMismatch as e:
    sys.exit(f'Cannot resume: {e} Resume it with that version, or start '
             'in a new --output_dir; this save was left in place.')
  except client_store.MissingState as e:
    sys.exit(f'Cannot resume: {e}. Restore the client_states files, or '
             'start in a new --output_dir; no client file was deleted.')
  except round_loop.NumericalFault as e:
    sys.exit(f'Numerical fault: {e}. The run stopped; '
             f'{_saved(checkpoints)}.')
  except workers.WorkerLost as e:
    sys.exit(f'Worker lost: {e}. The run stopped; {_saved(checkpoints)}, '
             f'once a worker serves there again (binaries/run_worker.py'
             f'{precision.worker_flag()}).')
  except Exception as e:  # pylint: disable=broad-except
    _exit_if_out_of_space(e, checkpoints)
    _exit_if_denied(e, checkpoints)
    raise

  from fedcg_tff.execution import devices  # pylint: disable=g-import-not-at-top
  tracker = result.tracker
  summary = {
      'algorithm': FLAGS.algorithm,
      'client_init': config.client_init,
      'task': FLAGS.task,
      'client_names': list(task.client_names),
      'rounds_run': result.rounds_run,
      'stopped_early': result.stopped_early,
      'mean_round_seconds': sum(result.round_seconds) / result.rounds_run,
      'best_round': tracker.best_round,
      'best_val_accuracy': tracker.best_val,
      'test_accuracy_at_best_val': tracker.test_at_best,
      'mean_test_accuracy_at_best_val': tracker.mean_test,
      'total_round_seconds': sum(result.round_seconds),
      'host': devices.host_cpu(),  # Round times depend on it several-fold.
  }
  summary.update(dp_summary(result.rounds_run, rounds_started))
  if FLAGS.aggregation == 'secure':
    summary['aggregation'] = 'secure'
    summary['secure_clipped'] = clipped_counts(writer.csv_path)
  try:
    run_record.write_json_atomically(results_path, summary)
  except OSError as e:
    _exit_if_out_of_space(e, checkpoints, writing=results_path)
    raise
  resumed = (f', resumed after round {result.resumed_from}'
             if result.resumed_from else '')
  print(f'\nTest accuracy (%) at each client\'s best-validation round, after '
        f'{result.rounds_run} rounds'
        f'{" (early stop)" if result.stopped_early else ""}{resumed}; '
        f'rounds took {summary["total_round_seconds"]:.0f}s in all, '
        f'{summary["mean_round_seconds"]:.1f}s on average; this invocation '
        f'{time.monotonic() - started:.0f}s:')
  print(tracker.table(), flush=True)
  if 'dp' in summary:
    print_dp(summary['dp'])
  clipped = {k: v for k, v in summary.get('secure_clipped', {}).items() if v}
  if clipped:
    print(f'secure aggregation clipped uploads (raise --secure_bound): '
          f'{clipped}')
  print(f'\nTensorBoard: .venv/bin/tensorboard --logdir '
        f'{writer.tensorboard_dir}')


if __name__ == '__main__':
  logging.set_verbosity(logging.WARNING)
  app.run(main)
