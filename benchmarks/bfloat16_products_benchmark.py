r"""What `--matmul_precision=bfloat16` buys on this host: every product
shape of a GAN step (batch 8, D's paired passes) as float32 `MatMul` and
by `small_conv.matmul`'s bfloat16 route, and one client's GAN and stage-1
epochs (2000 images, batch 8, one thread) in each precision.

  .venv/bin/python -m benchmarks.bfloat16_products_benchmark

TensorFlow reads oneDNN's floating-point mode once per process, so each
precision runs in child processes of its own (float32 without the
variable, bfloat16 with TF_SET_ONEDNN_FPMATH_MODE=BF16, as
`execution.precision` sets it), alternated (this VM's speed drifts);
times are CPU seconds of epochs and microseconds a product (best of 3 x
200 calls, each call with an add of a's and of the output's size that
keeps it dependent on the one before). The products are traced as a
training step has them, the batch unknown: products with a known
dimension under 16 (D's last conv) stay `MatMul` on both sides. On a
host without bfloat16 units the opt-in is refused; the benchmark says so
and times the route anyway (what oneDNN does there was not checked).
Random images stand in for FMNIST.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np

# (name, m, k, n, transpose_a, transpose_b): a is [m, k] ([k, m] if
# transposed), b [k, n] ([n, k]); D's products on both passes (16
# examples), then D's on the fake pass of G's step, then G's.
SHAPES = (
    ('D1 forward', 256, 104, 128, 0, 0), ('D1 kernel grad', 104, 258, 128, 1, 0),
    ('D1 input grad', 256, 128, 104, 0, 1),
    ('D2 forward', 144, 512, 256, 0, 0), ('D2 kernel grad', 512, 146, 256, 1, 0),
    ('D2 input grad', 144, 256, 512, 0, 1),
    ('D3 forward', 64, 1024, 512, 0, 0), ('D3 kernel grad', 1024, 66, 512, 1, 0),
    ('D3 input grad', 64, 512, 1024, 0, 1), ('D4 forward', 16, 2048, 1, 0, 0),
    ('G step: D1 forward', 128, 104, 128, 0, 0),
    ('G step: D2 forward', 72, 512, 256, 0, 0),
    ('G step: D3 forward', 32, 1024, 512, 0, 0),
    ('G step: D3 input grad', 32, 512, 1024, 0, 1),
    ('G step: D2 input grad', 72, 256, 512, 0, 1),
    ('G step: D1 input grad', 128, 128, 104, 0, 1),
    ('G1 forward', 8, 110, 2048, 0, 1), ('G2 forward', 32, 512, 1024, 0, 1),
    ('G3 forward', 72, 256, 512, 0, 1), ('G4 forward', 128, 128, 64, 0, 1),
    ('G4 input grad', 128, 64, 128, 0, 0), ('G3 input grad', 72, 512, 256, 0, 0),
    ('G2 input grad', 32, 1024, 512, 0, 0), ('G1 input grad', 8, 2048, 110, 0, 0),
    ('G1 kernel grad', 2048, 8, 110, 1, 0), ('G2 kernel grad', 1024, 32, 512, 1, 0),
    ('G3 kernel grad', 512, 72, 256, 1, 0), ('G4 kernel grad', 64, 128, 128, 1, 0),
)
PAIRS = 2  # Alternated pairs of child processes.
EPOCHS = 3  # Epochs timed in each child (the first traced before).


def _child(precision: str) -> dict:
  """Times, in this process (its oneDNN mode set by the parent, checked
  here)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from benchmarks import synthetic  # pylint: disable=g-import-not-at-top
  from fedcg_tff.algorithms import fedcg_tf  # pylint: disable=g-import-not-at-top
  from fedcg_tff.config import FedCGConfig  # pylint: disable=g-import-not-at-top
  from fedcg_tff.models import small_conv  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  from fedcg_tff.execution import precision as settings  # pylint: disable=g-import-not-at-top
  reason = settings.problem(precision)
  if reason and precision == 'float32':
    raise RuntimeError(f'float32 child: {reason}')
  if precision == 'bfloat16' and os.environ.get(settings.TF_FPMATH) != 'BF16':
    raise RuntimeError(f'bfloat16 child without {settings.TF_FPMATH}=BF16')
  bfloat16 = precision == 'bfloat16'
  products = {}
  for name, m, k, n, ta, tb in SHAPES:
    a = tf.random.normal([k, m] if ta else [m, k])
    b = tf.random.normal([n, k] if tb else [k, n])

    # a's first axis grows with the batch (m of a forward or input-gradient
    # product, k of a kernel gradient's), which a training step's graph
    # does not know when it is built: traced so here too, the route is
    # taken where training takes it (G1's products with the batch of 8).
    @tf.function(input_signature=[tf.TensorSpec([None, a.shape[1]])])
    def loop(a, b=b, ta=ta, tb=tb, m=m, n=n):
      total = tf.zeros([m, n])
      for _ in tf.range(200):
        # The sum keeps each call dependent on the one before.
        total += small_conv.matmul(a + total[0, 0] * 0.0, b, bfloat16,
                                   transpose_a=bool(ta),
                                   transpose_b=bool(tb))
      return total

    loop(a)
    best = float('inf')
    for _ in range(3):
      start = time.perf_counter()
      loop(a)
      best = min(best, time.perf_counter() - start)
    products[name] = best / 200 * 1e6
  config = FedCGConfig(local_epochs=1, gan_epochs=1,
                       matmul_precision=precision)
  dataset = synthetic.client_dataset(config.batch_size)
  gan = synthetic.gan_epoch(config, dataset)
  nets = fedcg_tf.PartyNetworks(config)
  state = fedcg_tf.initial_client_state(config, 1)
  stage1 = tf.function(lambda: fedcg_tf.train_classification(
      nets, state.classification_optimizer, dataset, tf.constant(0.5),
      state.seed, 0))
  epochs = {'GAN epoch': [], 'stage-1 epoch': []}
  gan(), stage1()
  for _ in range(EPOCHS):
    for name, epoch in (('GAN epoch', gan), ('stage-1 epoch', stage1)):
      start = time.process_time()
      epoch()
      epochs[name].append(time.process_time() - start)
  return {'products_us': products, 'epochs_s': epochs}


def _run_child(precision: str) -> dict:
  from fedcg_tff.execution import child_env  # pylint: disable=g-import-not-at-top
  from fedcg_tff.execution import precision as settings  # pylint: disable=g-import-not-at-top
  env = child_env.environment(TF_CPP_MIN_LOG_LEVEL='3')
  env.pop(settings.ONEDNN_FPMATH, None)
  env.pop(settings.TF_FPMATH, None)
  if precision == 'bfloat16':
    env[settings.TF_FPMATH] = 'BF16'
  done = subprocess.run(
      [sys.executable, '-m', 'benchmarks.bfloat16_products_benchmark',
       f'--child={precision}'], env=env, capture_output=True, text=True,
      check=False)
  if done.returncode:
    raise RuntimeError(f'the {precision} child failed: {done.stderr[-2000:]}')
  return json.loads(done.stdout.strip().splitlines()[-1])


def main():
  from fedcg_tff.execution import devices  # pylint: disable=g-import-not-at-top
  from fedcg_tff.execution import precision as settings  # pylint: disable=g-import-not-at-top
  runs = {'float32': [], 'bfloat16': []}
  for _ in range(PAIRS):
    for precision in runs:
      runs[precision].append(_run_child(precision))
  units = ('' if settings.has_bfloat16_arithmetic() else
           ' (NO bfloat16 units here: --matmul_precision=bfloat16 is refused)')
  print(f'{devices.host_cpu()}{units}; one thread; {PAIRS} alternated pairs '
        'of processes')
  print('products, us a call (best over the processes): float32 MatMul / '
        'the bfloat16 route, and their ratio')
  best = {p: {name: min(r['products_us'][name] for r in runs[p])
              for name, *_ in SHAPES} for p in runs}
  for name, m, k, n, _, _ in SHAPES:
    f32, b16 = best['float32'][name], best['bfloat16'][name]
    print(f'  {name:24s} {m:5d} x {k:4d} x {n:4d}  {f32:8.1f} / {b16:8.1f}'
          f'  {f32 / b16:5.2f}x')
  print(f'epochs, CPU s (median of {EPOCHS} in each of {PAIRS} processes):')
  for name in ('GAN epoch', 'stage-1 epoch'):
    line = '; '.join(
        f'{p} ' + ', '.join(f'{np.median(r["epochs_s"][name]):.3f}'
                           for r in runs[p]) for p in runs)
    print(f'  {name:14s} {line}')


if __name__ == '__main__':
  if len(sys.argv) == 2 and sys.argv[1] in ('--child=float32',
                                            '--child=bfloat16'):
    print(json.dumps(_child(sys.argv[1].split('=', 1)[1])))
  elif len(sys.argv) > 1:
    sys.exit(f'usage: python -m benchmarks.bfloat16_products_benchmark '
             f'(unexpected: {" ".join(sys.argv[1:])})')
  else:
    main()
