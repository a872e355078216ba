r"""Times the GAN's convolutions: TensorFlow's kernels against `small_conv`.

  .venv/bin/python -m benchmarks.small_conv_benchmark

For each stride-1 VALID convolution of the LeNet GAN (2x2 kernels) and of
the ResNet one (4x4 kernels), at batch 8 on one intra-op thread (as in a
TFF worker running one client per core), prints the CPU time of a forward
pass plus both gradients, in a compiled loop, with `tf.nn.conv2d` /
`tf.nn.conv2d_transpose` and with `small_conv`, its products in the
orientation `small_conv.times_transposed`'s AVX2 rule picks and in TF's
own; then E's 5x5 convolutions with `tf.nn.conv2d` and as
`small_conv.banded_conv2d` (forward, and forward + kernel gradient) and
which one the AVX2 rule picks; then a @ b^T both ways for the GAN's shapes
of it (few rows in a, a weight matrix b), which is what ORIENT_MAX_ROWS
and ORIENT_MIN_WEIGHTS rest on; then the CPU time of a whole FedCG GAN
epoch (2000 images) with the Keras layers and with ours, as this host
runs them. The tables pin the AVX2 hosts' choices whatever the host
(`small_conv.host_tuned_choices` turns both off where oneDNN runs AVX-512
kernels), so they show on any host what the rule picks and what each way
costs; the first line says what this host runs.
"""

import contextlib
import time

import numpy as np
import tensorflow as tf

from benchmarks import synthetic
from fedcg_tff.config import FedCGConfig
from fedcg_tff.execution import devices
from fedcg_tff.models import layers
from fedcg_tff.models import small_conv

BATCH = 8
REPEATS = 50
# (input height = width, c_in, c_out, kernel size)
CONVS = [(5, 26, 128, 2), (4, 128, 256, 2), (3, 256, 512, 2), (2, 512, 1, 2),
         (7, 256, 512, 4), (4, 512, 1, 4)]
TRANSPOSED = [(1, 110, 512, 2), (2, 512, 256, 2), (3, 256, 128, 2),
              (4, 128, 16, 2), (1, 110, 512, 4), (4, 512, 256, 4)]
# a @ b^T as (rows of a, b's shape), b [n, k] a weight matrix: D's input
# gradients (conv1-3) at batch 8 and 16 (the G step's and the paired D
# step's); G's transposed convs (deconv1, deconv4; deconv2 and deconv3 have
# the shapes of D's conv3 and conv2 at batch 8) at batch 8 and on stage 1's
# chunks of 512 examples; the ORIENT_MAX_ROWS boundary.
PRODUCTS = [(128, (104, 128)), (72, (512, 256)), (32, (1024, 512)),
            (256, (104, 128)), (144, (512, 256)), (64, (1024, 512)),
            (8, (2048, 110)), (128, (64, 128)),
            (512, (2048, 110)), (2048, (1024, 512)), (4608, (512, 256)),
            (256, (1024, 512)), (257, (1024, 512))]


def _cpu_ms_per_step(conv, x, kernel, gradients=('x', 'kernel')):
  """CPU ms of conv(x, kernel) and the `gradients` asked for, in a
  tf.function loop."""

  @tf.function
  def loop(x, kernel):
    total = tf.zeros_like(kernel)
    for _ in tf.range(REPEATS):
      with tf.GradientTape() as tape:
        tape.watch([x, kernel])
        y = conv(x, kernel + 0.0 * total)  # A dependency between steps.
        loss = tf.reduce_sum(y * y)
      if not gradients:
        total += loss
        continue
      grads = dict(zip(gradients, tape.gradient(
          loss, [{'x': x, 'kernel': kernel}[g] for g in gradients])))
      total += grads['kernel'] + tf.reduce_sum(grads.get('x', 0.0))
    return total

  loop(x, kernel)
  start = time.process_time()
  loop(x, kernel)
  return (time.process_time() - start) / REPEATS * 1e3


def _product_us(product, a, b, repeats=200):
  """Best of 5 wall-clock us of product(a, b), in a tf.function loop."""

  @tf.function
  def loop(a, b):
    total = tf.constant(0.0)
    for _ in tf.range(repeats):
      total += tf.reduce_sum(product(a + 0.0 * total, b))
    return total

  loop(a, b)
  best = float('inf')
  for _ in range(5):
    start = time.perf_counter()
    loop(a, b).numpy()
    best = min(best, time.perf_counter() - start)
  return best / repeats * 1e6


def _banded_table(rng):
  """E's 5x5 convolutions (LeNet; on 3 channels for colour images) with
  tf.nn.conv2d and with small_conv.banded_conv2d: what `small_conv.bands`
  rests on. The image needs no gradient in training."""
  print(f"E's convolutions, batch {BATCH}, CPU ms per step: forward, "
        'forward + kernel gradient')
  print('  input      kernel    tf.nn           banded          '
        'picked')
  conv = lambda a, w: tf.nn.conv2d(a, w, 1, 'VALID')
  for size, c_in, c_out in ((32, 1, 6), (32, 3, 6), (14, 6, 16)):
    x = tf.constant(rng.normal(size=(BATCH, size, size, c_in)), tf.float32)
    kernel = tf.constant(rng.normal(size=(5, 5, c_in, c_out)), tf.float32)
    times = [f'{_cpu_ms_per_step(f, x, kernel, g):6.3f}'
             for f in (conv, small_conv.banded_conv2d)
             for g in ((), ('kernel',))]
    layer = tf.keras.layers.Conv2D(c_out, 5)
    picked = small_conv.bands(layer, tf.keras.Input((size, size, c_in)))
    print(f'  {size}x{size}x{c_in:<2d}  5x5->{c_out:<3d}  {times[0]}  '
          f'{times[1]}  {times[2]}  {times[3]}  '
          f'{"banded" if picked else "tf.nn"}')


def _orientation_table(rng):
  print('a @ b^T, one thread, best of 5 x 200 calls: us (GFLOP/s)')
  print('  rows of a  b          a @ b^T          (b @ a^T)^T    picked')
  for rows, shape in PRODUCTS:
    a = tf.constant(rng.normal(size=(rows, shape[1])), tf.float32)
    b = tf.constant(rng.normal(size=shape), tf.float32)
    flops = 2 * rows * shape[0] * shape[1]
    direct = _product_us(lambda a, b: tf.matmul(a, b, transpose_b=True), a, b)
    swapped = _product_us(
        lambda a, b: tf.transpose(tf.matmul(b, a, transpose_b=True)), a, b)
    picked = ('swapped' if 'Transpose' in [
        op.type for op in tf.function(small_conv.times_transposed)
        .get_concrete_function(a, b).graph.get_operations()] else 'direct')
    print(f'  {rows:9d}  {shape[0]:4d}x{shape[1]:<4d}  '
          f'{direct:7.0f} ({flops / direct / 1e3:3.0f})  '
          f'{swapped:7.0f} ({flops / swapped / 1e3:3.0f})  {picked}')


def _gan_epoch_cpu_seconds(repeats=5):
  """Median CPU s of a GAN epoch with our layers and with Keras' own."""
  config = FedCGConfig(local_epochs=1, gan_epochs=1)
  dataset = synthetic.client_dataset(config.batch_size)
  ours = (layers.SpectralNormConv2D.call, layers.SmallConv2DTranspose.call)

  def keras_sn_call(layer, inputs, training=None):
    kernel = layer.normalized_kernel(training=bool(training))
    return layer.convolution_op(inputs, kernel)

  epochs = {}
  try:
    for name in ('small_conv', 'keras'):
      if name == 'keras':  # Traced with the layers' former computation.
        layers.SpectralNormConv2D.call = keras_sn_call
        layers.SmallConv2DTranspose.call = (
            tf.keras.layers.Conv2DTranspose.call)
      epochs[name] = synthetic.gan_epoch(config, dataset)
      epochs[name]()  # Trace.
  finally:
    layers.SpectralNormConv2D.call, layers.SmallConv2DTranspose.call = ours
  times = {name: [] for name in epochs}
  for _ in range(repeats):  # Interleaved: this VM's speed drifts.
    for name, epoch in epochs.items():
      start = time.process_time()
      epoch()
      times[name].append(time.process_time() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


@contextlib.contextmanager
def _choices(**flags):
  """Within, small_conv's module flags (ORIENTED_PRODUCTS, BANDED_CONVS)
  set as given, read by whatever is traced there; restored after."""
  previous = {name: getattr(small_conv, name) for name in flags}
  for name, value in flags.items():
    setattr(small_conv, name, value)
  try:
    yield
  finally:
    for name, value in previous.items():
      setattr(small_conv, name, value)


def main():
  tf.get_logger().setLevel('ERROR')  # One loop is traced per shape, on purpose.
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  rng = np.random.default_rng(0)
  print(f'{devices.host_cpu()}: this host runs ORIENTED_PRODUCTS='
        f'{small_conv.ORIENTED_PRODUCTS}, BANDED_CONVS='
        f'{small_conv.BANDED_CONVS} (small_conv.host_tuned_choices); the '
        "tables' small_conv and picked columns are the AVX2 rule's")
  # The AVX2 hosts' choices whatever this host's
  # (`small_conv.host_tuned_choices`): the tables show what that rule picks
  # and what each way costs here.
  with _choices(ORIENTED_PRODUCTS=True, BANDED_CONVS=True):
    _tables(rng)
  epoch = _gan_epoch_cpu_seconds()
  print('GAN epoch (2000 images, batch 8), median CPU s: '
        f'Keras layers {epoch["keras"]:.2f}, '
        f'small_conv {epoch["small_conv"]:.2f} (this host\'s choices)')


def _tables(rng):
  """The per-convolution, banded and orientation tables."""
  print(f'forward + both gradients, batch {BATCH}, CPU ms per step:')
  print('  kind       input         kernel   tf.nn  small_conv  '
        "(TF's orientation)")
  for transposed, shapes in ((False, CONVS), (True, TRANSPOSED)):
    for size, c_in, c_out, k in shapes:
      x = tf.constant(rng.normal(size=(BATCH, size, size, c_in)), tf.float32)
      kernel_shape = (k, k, c_out, c_in) if transposed else (k, k, c_in, c_out)
      kernel = tf.constant(rng.normal(size=kernel_shape), tf.float32)
      if transposed:
        out_shape = [BATCH, size + k - 1, size + k - 1, c_out]
        native = lambda a, w, s=out_shape: tf.nn.conv2d_transpose(
            a, w, s, 1, 'VALID')
        ours = small_conv.conv2d_transpose
      else:
        native = lambda a, w: tf.nn.conv2d(a, w, 1, 'VALID')
        ours = small_conv.conv2d
      with _choices(ORIENTED_PRODUCTS=False):
        tf_oriented = _cpu_ms_per_step(ours, x, kernel)
      print(f'  {"transpose" if transposed else "conv":9s}  '
            f'{size}x{size}x{c_in:<4d}  {k}x{k}->{c_out:<4d} '
            f'{_cpu_ms_per_step(native, x, kernel):6.3f}  '
            f'{_cpu_ms_per_step(ours, x, kernel):10.3f}  '
            f'{tf_oriented:6.3f}')
  _banded_table(rng)
  _orientation_table(rng)


if __name__ == '__main__':
  main()
