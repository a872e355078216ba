r"""Times the GAN's convolutions: TensorFlow's kernels against `small_conv`.

  .venv/bin/python -m benchmarks.small_conv_benchmark

For each stride-1 VALID convolution of the LeNet GAN (2x2 kernels) and of
the ResNet one (4x4 kernels), at batch 8 on one intra-op thread (as in a
TFF worker running one client per core), prints the CPU time of a forward
pass plus both gradients, in a compiled loop, with `tf.nn.conv2d` /
`tf.nn.conv2d_transpose` and with `small_conv`; then the CPU time of a
whole FedCG GAN epoch (2000 images) with the Keras layers and with ours.
"""

import time

import numpy as np
import tensorflow as tf

from benchmarks import synthetic
from fedcg_tff.config import FedCGConfig
from fedcg_tff.models import layers
from fedcg_tff.models import small_conv

BATCH = 8
REPEATS = 50
# (input height = width, c_in, c_out, kernel size)
CONVS = [(5, 26, 128, 2), (4, 128, 256, 2), (3, 256, 512, 2), (2, 512, 1, 2),
         (7, 256, 512, 4), (4, 512, 1, 4)]
TRANSPOSED = [(1, 110, 512, 2), (2, 512, 256, 2), (3, 256, 128, 2),
              (4, 128, 16, 2), (1, 110, 512, 4), (4, 512, 256, 4)]


def _cpu_ms_per_step(conv, x, kernel):
  """CPU ms of conv(x, kernel) and its two gradients, in a tf.function loop."""

  @tf.function
  def loop(x, kernel):
    total = tf.zeros_like(kernel)
    for _ in tf.range(REPEATS):
      with tf.GradientTape() as tape:
        tape.watch([x, kernel])
        y = conv(x, kernel + 0.0 * total)  # A dependency between steps.
        loss = tf.reduce_sum(y * y)
      grad_x, grad_kernel = tape.gradient(loss, [x, kernel])
      total += grad_kernel + tf.reduce_sum(grad_x)
    return total

  loop(x, kernel)
  start = time.process_time()
  loop(x, kernel)
  return (time.process_time() - start) / REPEATS * 1e3


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


def main():
  tf.get_logger().setLevel('ERROR')  # One loop is traced per shape, on purpose.
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  rng = np.random.default_rng(0)
  print(f'forward + both gradients, batch {BATCH}, CPU ms per step:')
  print('  kind       input         kernel   tf.nn  small_conv')
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
      print(f'  {"transpose" if transposed else "conv":9s}  '
            f'{size}x{size}x{c_in:<4d}  {k}x{k}->{c_out:<4d} '
            f'{_cpu_ms_per_step(native, x, kernel):6.3f}  '
            f'{_cpu_ms_per_step(ours, x, kernel):6.3f}')
  epoch = _gan_epoch_cpu_seconds()
  print('GAN epoch (2000 images, batch 8), median CPU s: '
        f'Keras layers {epoch["keras"]:.2f}, '
        f'small_conv {epoch["small_conv"]:.2f}')


if __name__ == '__main__':
  main()
