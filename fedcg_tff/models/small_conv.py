"""Stride-1 VALID convolutions on tiny maps, written as one matrix product.

The GAN of FedCG works on 1x1 to 5x5 maps with 2x2 kernels and batches of 8.
On CPU, TensorFlow's oneDNN convolution kernels spend most of such a call on
per-call setup and layout reorders rather than on arithmetic: a 2x2 conv from
3x3x256 to 2x2x512 (a 32x1024 by 1024x512 product) took ~1.1 ms forwards,
four times what the same product takes as a `MatMul` (0.25 ms, near the
core's peak). Written as patch matrix products, a FedCG GAN epoch (250 steps
at batch 8) took 4.2 s of CPU instead of 8.1 s on this machine
(`benchmarks/small_conv_benchmark.py`).

Both functions compute exactly the convolution of `tf.nn.conv2d` /
`tf.nn.conv2d_transpose` with stride 1, VALID padding and no dilation (the
same sums, accumulated in another order, so results agree to float rounding),
and their gradients are TensorFlow's own gradients of slices, pads and
`MatMul`. `applies` says when a Keras layer and its input allow them.
"""

import tensorflow as tf

from fedcg_tff import graph_code


@graph_code.plain
def applies(layer: tf.keras.layers.Layer, inputs) -> bool:
  """Whether `layer` is a stride-1, VALID, undilated, ungrouped NHWC conv
  and `inputs` have a known height and width (the windows are cut at trace
  time)."""
  return (inputs.shape[1:3].is_fully_defined() and
          layer.strides == (1, 1) and layer.padding == 'valid' and
          layer.dilation_rate == (1, 1) and
          getattr(layer, 'groups', 1) == 1 and
          layer.data_format == 'channels_last')


@graph_code.plain
def conv2d(x, kernel):
  """`tf.nn.conv2d(x, kernel, 1, 'VALID')` as patches @ kernel.

  `kernel` is `[kh, kw, c_in, c_out]`. The patches are the kh * kw shifted
  windows of `x`, concatenated on the channel axis in the kernel's
  (row, column, channel) order, so the kernel reshapes to the matrix as is.
  """
  kh, kw, c_in, c_out = kernel.shape
  out_h, out_w = x.shape[1] - kh + 1, x.shape[2] - kw + 1
  # tf.slice, not x[...]: its gradient is a Pad, far cheaper here than the
  # StridedSliceGrad of strided slices.
  patches = tf.concat([tf.slice(x, [0, i, j, 0], [-1, out_h, out_w, -1])
                       for i in range(kh) for j in range(kw)], axis=-1)
  y = tf.matmul(tf.reshape(patches, [-1, kh * kw * c_in]),
                tf.reshape(kernel, [kh * kw * c_in, c_out]))
  return tf.reshape(y, [-1, out_h, out_w, c_out])


@graph_code.plain
def conv2d_transpose(x, kernel):
  """The stride-1 VALID transposed convolution of `x` by `kernel`.

  `kernel` is `[kh, kw, c_out, c_in]` (Keras' `Conv2DTranspose` layout). Each
  input pixel spreads `x[n, p, q] @ kernel[i, j]^T` to output pixel
  (p + i, q + j): one product gives every tap, then each tap's map is padded
  into place and the taps are summed.
  """
  kh, kw, c_out, c_in = kernel.shape
  in_h, in_w = x.shape[1], x.shape[2]
  taps = tf.matmul(tf.reshape(x, [-1, c_in]),
                   tf.reshape(kernel, [kh * kw * c_out, c_in]),
                   transpose_b=True)
  # Unstacked, not sliced: the gradient is one Pack instead of a
  # StridedSliceGrad per tap.
  taps = tf.unstack(tf.reshape(taps, [-1, in_h, in_w, kh * kw, c_out]),
                    axis=3)
  return tf.add_n([
      tf.pad(taps[i * kw + j],
             [[0, 0], [i, kh - 1 - i], [j, kw - 1 - j], [0, 0]])
      for i in range(kh) for j in range(kw)])
