"""Stride-1 VALID convolutions on tiny maps, written as one matrix product.

The GAN of FedCG works on 1x1 to 5x5 maps with 2x2 kernels and batches of 8.
On CPU, TensorFlow's oneDNN convolution kernels spend most of such a call on
per-call setup and layout reorders rather than on arithmetic: a 2x2 conv from
3x3x256 to 2x2x512 (a 32x1024 by 1024x512 product) took ~1.1 ms forwards,
four times what the same product takes as a `MatMul` (0.25 ms, near the
core's peak). Written as patch matrix products, a FedCG GAN epoch (250 steps
at batch 8) took 4.2 s of CPU instead of 8.1 s on this machine
(`benchmarks/small_conv_benchmark.py`).

Stride-1 VALID convolutions of a single input channel (LeNet's first, 5x5
on 32x32 images) are slow in oneDNN too, for want of channels to vectorise
over: `banded_conv2d` makes each of them one product with a banded matrix
(see `bands`).

The functions compute exactly the convolution of `tf.nn.conv2d` /
`tf.nn.conv2d_transpose` with stride 1, VALID padding and no dilation (the
same sums, accumulated in another order, so results agree to float rounding;
`conv2d` with a `product` of the caller's computes what that product does).
Their gradients are TensorFlow's own for the slices, pads, tiles and
transposes and, for `conv2d`'s and `conv2d_transpose`'s products, the
products TensorFlow's gradient takes, a @ b^T among them run in the
orientation `times_transposed` picks (see ORIENT_MAX_ROWS);
`banded_conv2d`'s product is a plain `tf.matmul`. Both tricks are for
oneDNN's AVX2 kernels, and are off where it runs AVX-512 ones
(`host_tuned_choices`).
`applies` says when a Keras layer and its input allow them.

With `bfloat16=True` (the opt-in `FedCGConfig.matmul_precision='bfloat16'`)
the products run in oneDNN's matmul primitive (`matmul`), which the
process's oneDNN floating-point mode lets round their inputs to bfloat16:
no longer float32 sums, see `matmul`.
"""

import contextlib

import tensorflow as tf

from fedcg_tff import graph_code
from fedcg_tff.execution import devices


def host_tuned_choices(cpuinfo: str | None = None) -> tuple[bool, bool]:
  """(ORIENTED_PRODUCTS, BANDED_CONVS) for this host (or the one
  `cpuinfo`'s /proc/cpuinfo text describes): neither where oneDNN runs its
  AVX-512 kernels (`devices.runs_avx512_kernels`), both elsewhere.

  Each works around a slow oneDNN AVX2 kernel, and oneDNN picks its
  kernels by the ISA the CPU reports. Both won on the AVX2 hosts (AMD Zen 3,
  see ORIENT_MAX_ROWS and `bands`; Zen 1,
  results/benchmarks/zen1_amd_avx2_20261205.txt). On an Intel Xeon with
  AVX-512 (family 6 model 167, 2026-12-06, one thread, batch 8;
  `benchmarks/small_conv_benchmark.py`,
  results/benchmarks/kernel_choices_intel_avx512_model167_20261206.txt)
  each lost at the kernel: oneDNN's AVX-512 sgemm ran a @ b^T directly
  faster than swapped at every shape the rule swaps but one (by up to
  1.25x; 5% the other way at a [32, 512] by b [1024, 512]), and its
  direct convolution ran E's conv1 in 0.10 / 0.22 ms (forward / with the
  kernel gradient) against 0.24 / 0.38 ms banded. The epochs gained
  little: one client's GAN epoch 0-2% faster with neither, a stage-1
  epoch within 2% either way, in two runs of 7 and 15 interleaved
  repeats (a first run of 5 had shown 6% and 12%). Not measured: the
  AMD AVX-512 hosts (Zen 4, Zen 5), the Intel model 106 host, and hosts
  without AVX2 (they get the AVX2 hosts' choice). The choice is made
  where the computations are traced (the driver): workers on another
  host kind (`--worker_addresses`) run the driver's.
  """
  avx512 = devices.runs_avx512_kernels(cpuinfo)
  return not avx512, not avx512


# Whether `times_transposed` may compute a @ b^T as (b @ a^T)^T, and whether
# `bands` may pick `banded_conv2d`; read at trace time, set for the host
# (tests and benchmarks set them to compare or pin a choice).
ORIENTED_PRODUCTS, BANDED_CONVS = host_tuned_choices()
# When `times_transposed` swaps: a has at most this many rows and b at least
# this many elements. On the AMD EPYC Zen 3 host (AVX2, 2026-12-05; one
# thread, best of 5 x 200 calls; benchmarks/small_conv_benchmark.py,
# figures in results/benchmarks/product_orientation_amd_zen3_avx2_20261205.txt),
# TF's oneDNN sgemm ran a @ b^T with a [32, 512] and b [1024, 512] (G's
# second transposed conv, D's third conv's input gradient at batch 8) at
# 15 GFLOP/s and its swap at 82; at batch 16 (a [64, 512]) at 22 and 81.
# At 512 or more rows of a, or b of 8-13 k weights (D's first conv, G's
# last), the swap was the slower, by up to 1.6x.
ORIENT_MAX_ROWS = 256
ORIENT_MIN_WEIGHTS = 65536
# `bands`' widest input (the measured one: LeNet's 32x32 images).
BANDED_MAX_WIDTH = 32


@graph_code.plain
def applies(layer: tf.keras.layers.Layer, inputs) -> bool:
  """Whether `layer` is a stride-1, VALID, undilated, ungrouped NHWC conv
  and `inputs` have a known height and width (the windows are cut at trace
  time)."""
  return (inputs.shape.rank == 4 and inputs.shape[1:3].is_fully_defined() and
          layer.strides == (1, 1) and layer.padding == 'valid' and
          layer.dilation_rate == (1, 1) and
          getattr(layer, 'groups', 1) == 1 and
          layer.data_format == 'channels_last')


@graph_code.plain
def conv2d(x, kernel, product=None, bfloat16: bool = False):
  """`tf.nn.conv2d(x, kernel, 1, 'VALID')` as patches @ kernel.

  `kernel` is `[kh, kw, c_in, c_out]`. The patches are the kh * kw shifted
  windows of `x`, concatenated on the channel axis in the kernel's
  (row, column, channel) order, so the kernel reshapes to the matrix as is.
  `product(patches, matrix)` replaces the plain product where the caller
  folds more into it (the spectral norm's division by sigma), and then
  decides the route of its products itself (`bfloat16` is not read);
  otherwise `bfloat16`: the products by `matmul`'s bfloat16 route.
  """
  kh, kw, c_in, c_out = kernel.shape
  out_h, out_w = x.shape[1] - kh + 1, x.shape[2] - kw + 1
  # tf.slice, not x[...]: its gradient is a Pad, far cheaper here than the
  # StridedSliceGrad of strided slices.
  patches = tf.concat([tf.slice(x, [0, i, j, 0], [-1, out_h, out_w, -1])
                       for i in range(kh) for j in range(kw)], axis=-1)
  y = (product or _patch_product(bfloat16))(
      tf.reshape(patches, [-1, kh * kw * c_in]),
      tf.reshape(kernel, [kh * kw * c_in, c_out]))
  return tf.reshape(y, [-1, out_h, out_w, c_out])


@graph_code.plain
def bands(layer: tf.keras.layers.Layer, inputs) -> bool:
  """Whether `banded_conv2d` should run `layer` on `inputs`: where `applies`
  does, on a single input channel at most BANDED_MAX_WIDTH wide (E's first
  convolution on grey 32x32 images).

  Why there: oneDNN's direct convolution has no input channels to vectorise
  over, and with LeNet's 6 output channels few outputs either. On the Zen 3
  host (2026-12-05, one thread, batch 8; benchmarks/small_conv_benchmark.py)
  E's conv1 (32x32x1 by 5x5x1x6) took 0.566-0.696 ms forwards and
  1.252-1.285 ms with its kernel gradient as `tf.nn.conv2d`, 0.288 and
  0.490 ms banded. On 3 input channels the two were about even (0.711 /
  1.573 against 0.764 / 1.510 ms), and E's conv2 (6 channels) was 1.4-1.9x
  slower banded: those keep oneDNN's kernel. Wider images were not
  measured: the product's extra work grows with width / kw. Only where
  BANDED_CONVS (not on AVX-512 hosts: `host_tuned_choices`).
  """
  return (BANDED_CONVS and applies(layer, inputs) and
          inputs.shape[-1] == 1 and
          inputs.shape[2] <= BANDED_MAX_WIDTH)


@graph_code.plain
def banded_conv2d(x, kernel):
  """`tf.nn.conv2d(x, kernel, 1, 'VALID')` as one product of row windows and
  a banded matrix.

  Output row r needs input rows r .. r + kh - 1: laid side by side they are
  one row of `[kh * width * c_in]` values, and the convolution of that row
  is its product with a fixed `[kh * width * c_in, out_w * c_out]` matrix
  holding kernel[i, jj - j, c, o] at row (i, jj, c), column (j, o) where
  0 <= jj - j < kw, and zeros elsewhere. The product does about width / kw
  times the convolution's multiplications, all of them as one well-shaped
  matrix product: the same sums (plus exact zeros) in another order, so the
  convolution to float rounding.
  """
  kh, kw, c_in, c_out = kernel.shape
  out_h, width = x.shape[1] - kh + 1, x.shape[2]
  rows = tf.concat([tf.reshape(tf.slice(x, [0, i, 0, 0], [-1, out_h, -1, -1]),
                               [-1, out_h, width * c_in]) for i in range(kh)],
                   axis=-1)
  y = tf.matmul(tf.reshape(rows, [-1, kh * width * c_in]),
                _band(kernel, width))
  return tf.reshape(y, [-1, out_h, width - kw + 1, c_out])


@graph_code.plain
def _band(kernel, width):
  """`banded_conv2d`'s matrix, made by copies only (a gather of its 27 k
  entries took 157 us a step, far more than the copies): each kernel row's
  taps padded with zeros to width + 1 and repeated out_w times; cut to
  out_w * width values, row j of that [out_w, width] reading is the taps
  shifted right by j, since (j * width + jj) mod (width + 1) = jj - j
  modulo width + 1, which lands in the zeros unless 0 <= jj - j < kw."""
  kh, kw, c_in, c_out = kernel.shape
  out_w = width - kw + 1
  padded = tf.pad(kernel, [[0, 0], [0, width + 1 - kw], [0, 0], [0, 0]])
  repeated = tf.slice(tf.tile(padded, [1, out_w, 1, 1]), [0, 0, 0, 0],
                      [-1, out_w * width, -1, -1])
  shifted = tf.reshape(repeated, [kh, out_w, width, c_in, c_out])
  return tf.reshape(tf.transpose(shifted, [0, 2, 3, 1, 4]),
                    [kh * width * c_in, out_w * c_out])


@graph_code.plain
def conv2d_transpose(x, kernel, bfloat16: bool = False):
  """The stride-1 VALID transposed convolution of `x` by `kernel`.

  `kernel` is `[kh, kw, c_out, c_in]` (Keras' `Conv2DTranspose` layout). Each
  input pixel spreads `x[n, p, q] @ kernel[i, j]^T` to output pixel
  (p + i, q + j): one product gives every tap, then each tap's map is padded
  into place and the taps are summed. `bfloat16`: as in `conv2d`.
  """
  kh, kw, c_out, c_in = kernel.shape
  in_h, in_w = x.shape[1], x.shape[2]
  taps = _tap_product(bfloat16)(tf.reshape(x, [-1, c_in]),
                      tf.reshape(kernel, [kh * kw * c_out, c_in]))
  # Unstacked, not sliced: the gradient is one Pack instead of a
  # StridedSliceGrad per tap.
  taps = tf.unstack(tf.reshape(taps, [-1, in_h, in_w, kh * kw, c_out]),
                    axis=3)
  return tf.add_n([
      tf.pad(taps[i * kw + j],
             [[0, 0], [i, kh - 1 - i], [j, kw - 1 - j], [0, 0]])
      for i in range(kh) for j in range(kw)])


@graph_code.plain
def times_transposed(a, b, bfloat16: bool = False):
  """a @ b^T for a `[m, k]` and b `[n, k]` (a weight matrix).

  oneDNN's sgemm runs this product slowly when a has few rows and b is
  large (see ORIENT_MAX_ROWS), and fast as b @ a^T, whose small result is
  then transposed: the same sums, accumulated in another order. The row
  count is usually known only when the graph runs (the batch), so the
  choice is then a `tf.cond`. `bfloat16`: by `matmul`'s bfloat16 route.
  """
  direct = lambda: matmul(a, b, bfloat16, transpose_b=True)
  swapped = lambda: tf.transpose(matmul(b, a, bfloat16, transpose_b=True))
  swaps = _swaps(a, b)
  if isinstance(swaps, bool):
    return swapped() if swaps else direct()
  return tf.cond(swaps, swapped, direct)


@graph_code.plain
def _swaps(a, b):
  """Whether `times_transposed` swaps: a bool, or a boolean tensor when a's
  row count is known only when the graph runs."""
  if not ORIENTED_PRODUCTS or b.shape.num_elements() < ORIENT_MIN_WEIGHTS:
    return False
  if a.shape[0] is not None:
    return a.shape[0] <= ORIENT_MAX_ROWS
  return tf.shape(a)[0] <= ORIENT_MAX_ROWS


# The two products below are `tf.matmul`'s, with TF's gradients, but every
# a @ b^T among them goes through `times_transposed`: conv2d's input
# gradient dpatches = dy @ w^T, and conv2d_transpose's forward product
# x @ k^T itself. Each is made for one `bfloat16` setting, which its
# gradient's products keep.


def _patch_product(bfloat16: bool):
  """patches @ matrix, with dpatches by `times_transposed`."""

  @tf.custom_gradient
  def product(patches, matrix):

    def gradient(dy):
      return (times_transposed(dy, matrix, bfloat16),
              matmul(patches, dy, bfloat16, transpose_a=True))

    return matmul(patches, matrix, bfloat16), gradient

  return product


def _tap_product(bfloat16: bool):
  """x @ matrix^T by `times_transposed`, with TF's gradients of it."""

  @tf.custom_gradient
  def product(x, matrix):

    def gradient(dtaps):
      return (matmul(dtaps, matrix, bfloat16),
              matmul(dtaps, x, bfloat16, transpose_a=True))

    return times_transposed(x, matrix, bfloat16), gradient

  return product


# ---------------------------------------------------------------------------
# The opt-in bfloat16 products.

# The bfloat16 route's smallest dimension: a product with a known m, k or
# n below it stays float32 `MatMul`. On the Intel model 167 host (AMX,
# 2026-12-06, one thread; results/benchmarks/
# bfloat16_products_intel_avx512_model167_20261206.txt) the route lost at
# D's last conv (n = 1: 8.9 -> 27.8 us) and, with the batch of 8 as m or
# k, at G's first transposed conv's gradients (42.7 -> 70.9 and
# 120.8 -> 155.2 us; 0.81x and 0.84x in benchmarks/
# bfloat16_products_benchmark.py); the batch is known only when the graph
# runs, so those two take the route (see `matmul`). G's last transposed
# conv's input gradient (128 x 64 x 128) lost once (21.4 -> 23.1 us) and
# won in the benchmark (1.2-1.3x).
BFLOAT16_MIN_DIM = 16


@graph_code.plain
def matmul(a, b, bfloat16: bool = False, transpose_a: bool = False,
           transpose_b: bool = False):
  """`tf.matmul` of two matrices, or, with `bfloat16`, the same product as
  a batch of one (`BatchMatMulV2`), where every known dimension is at least
  BFLOAT16_MIN_DIM.

  Why: TF runs a 2-D float32 `MatMul` through oneDNN's sgemm, which is
  float32 whatever the process's oneDNN settings, and a batched one through
  oneDNN's matmul primitive, which takes the floating-point mode TF sets
  from TF_SET_ONEDNN_FPMATH_MODE: BF16 lets it round the inputs to
  bfloat16 (8 bits of mantissa) and accumulate in float32, on AMX or
  AVX512-BF16 units. Set by the binaries for
  `FedCGConfig.matmul_precision='bfloat16'` (`execution.precision`).
  Without that setting the route computes the float32 product, mostly
  slower than `MatMul` (0.8-2.8x its time at the GAN's 28 shapes here,
  1.1x or more at 17), so it is taken only when asked for.
  """
  m, k = (a.shape[1], a.shape[0]) if transpose_a else a.shape
  n = b.shape[0] if transpose_b else b.shape[1]
  if not bfloat16 or any(d is not None and d < BFLOAT16_MIN_DIM
                         for d in (m, k, n)):
    return tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
  return tf.matmul(a[tf.newaxis], b[tf.newaxis], transpose_a=transpose_a,
                   transpose_b=transpose_b)[0]


_BUILDING = graph_code.TraceSwitch()


@contextlib.contextmanager
def bfloat16_products(on: bool = True):
  """Within, the layers of `models.layers` that use this module are built
  to take the bfloat16 route (`building_bfloat16`): how a network builder
  hands `FedCGConfig.matmul_precision` to its layers without every
  builder taking it (`training_tf.PartyNetworks`)."""
  with _BUILDING.set(on):
    yield


def building_bfloat16() -> bool:
  """Whether layers built now take the bfloat16 route."""
  return _BUILDING.value
