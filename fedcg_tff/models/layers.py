"""Keras layers and initialisers the project's networks share (LeNet-5 and
ResNet-18 families alike).

* `SpectralNormConv2D`: the discriminator's spectrally normalised
  convolution (Keras' `SpectralNormalization` wrapper fails inside TFF's
  graph-mode layers). `SmallConv2DTranspose`: Keras' transposed convolution
  computed by `small_conv` on the GAN's tiny maps.
* Initialisers as the published code has them: DCGAN's N(0, 0.02) kernels
  and N(1, 0.02) batch-norm scales for G and D (`gan_kernel_init`,
  `gan_batch_norm`), PyTorch's layer defaults for E and C
  (`torch_default_init`), N(0, 1) label embeddings (`label_embedding`, as
  `torch.nn.Embedding`).
* Batch norm with PyTorch's momentum and epsilon, and the moving averages
  of a pass the original runs twice (`repeated_moving_average_updates`).
"""

import contextlib

import tensorflow as tf

from fedcg_tff import graph_code
from fedcg_tff.models import small_conv

_PAIRING = graph_code.TraceSwitch()


@contextlib.contextmanager
def paired_passes():
  """Within, a network built of these layers, called in training mode, takes
  two passes stacked on the batch axis (first half, then second half) and
  computes exactly what two training-mode calls in that order compute:
  batch norm normalises each half with its own statistics and updates its
  moving averages with the first half and then the second, and each
  spectral-norm convolution runs its power iteration once per half (the
  first half's sigma, then the second's). What it saves is work: every
  convolution is one product over both halves (twice the rows, half the
  calls), which is where a GAN step's time goes at batch 8.

  The discriminator's real and fake passes of FedCG's stage 2 use it
  (`fedcg_tf.train_gan`); the spec's "D sees real and fake batches in
  separate passes" holds: the statistics are per pass. Only trace-time
  Python state: the traced graph holds the split computation.
  """
  with _PAIRING.set():
    yield


@graph_code.plain
def _paired(training) -> bool:
  return bool(training) and _PAIRING.value


LEAKY_SLOPE = 0.2
BN_MOMENTUM = 0.9  # PyTorch's momentum 0.1 in Keras' convention.
BN_EPSILON = 1e-5  # PyTorch's default.


def gan_kernel_init():
  return tf.keras.initializers.RandomNormal(0.0, 0.02)


class PairedBatchNormalization(tf.keras.layers.BatchNormalization):
  """Keras' batch norm; under `paired_passes` in training mode, one call
  per half of the batch, in order (see there)."""

  def call(self, inputs, training=None):
    if not _paired(training):
      return super().call(inputs, training=training)
    first, second = tf.split(inputs, 2)
    first = super().call(first, training=training)
    return tf.concat([first, super().call(second, training=training)], 0)


@contextlib.contextmanager
def repeated_moving_average_updates(model: tf.keras.Model, times: int):
  """Within, a training-mode call of `model` moves each batch norm's moving
  averages as `times` such calls on the same batch would: with momentum m,
  t updates from the same batch statistics b give m^t * avg + (1 - m^t) * b,
  so the layers' momentum is m^t while the block lasts. It is read when a
  call is traced.

  Why: the published code's FedCG stage 2 runs G in training mode twice per
  step on the same (z, y) with the same weights, once for D's step and again
  for G's, so G's moving averages take two updates from one batch's
  statistics. `fedcg_tf.train_gan` runs G once and uses its output for both
  steps; this keeps the original's moving averages without the second pass.
  """
  norms = [m for m in model.submodules
           if isinstance(m, tf.keras.layers.BatchNormalization)]
  saved = [norm.momentum for norm in norms]
  try:
    for norm, momentum in zip(norms, saved):
      norm.momentum = momentum ** times
    yield
  finally:
    for norm, momentum in zip(norms, saved):
      norm.momentum = momentum


def gan_batch_norm():
  return PairedBatchNormalization(
      momentum=BN_MOMENTUM,
      epsilon=BN_EPSILON,
      gamma_initializer=tf.keras.initializers.RandomNormal(1.0, 0.02),
      beta_initializer='zeros',
  )


def torch_default_init(fan_in: int) -> dict:
  """Initialisers of a PyTorch `Conv2d` / `Linear` layer, as Keras layer
  arguments: kernel and bias uniform in +-1/sqrt(fan_in), fan_in being the
  inputs of one output unit (in_channels * kh * kw for a convolution).

  PyTorch's kernel draw is `kaiming_uniform_(a=sqrt(5))`: bound
  gain * sqrt(3 / fan_in) with gain sqrt(2 / (1 + a^2)) = sqrt(1 / 3), which
  is 1/sqrt(fan_in); its bias bound is 1/sqrt(fan_in) too. Both are plain
  `RandomUniform`s here (so `model_weights.sample_initial` redraws them).
  """
  bound = 1.0 / float(fan_in) ** 0.5
  init = lambda: tf.keras.initializers.RandomUniform(-bound, bound)
  return {'kernel_initializer': init(), 'bias_initializer': init()}


def label_embedding(num_classes, name):
  return tf.keras.layers.Embedding(
      num_classes, num_classes,
      embeddings_initializer=tf.keras.initializers.RandomNormal(0.0, 1.0),
      name=name)


def generator_inputs(num_classes: int, noise_dim: int):
  """G's inputs (noise z, label y) and what both generators' transposed
  convs start from: [z, emb(y)] as a 1x1 map with noise_dim + num_classes
  channels. Returns (z, y, that map)."""
  z = tf.keras.Input((noise_dim,), name='noise')
  y = tf.keras.Input((), dtype=tf.int32, name='label')
  emb = label_embedding(num_classes, 'label_embedding')(y)
  x = tf.keras.layers.Concatenate()([z, emb])
  return z, y, tf.keras.layers.Reshape((1, 1, noise_dim + num_classes))(x)


def discriminator_inputs(num_classes: int, feature_shape):
  """D's inputs (features f, label y) and what both discriminators' convs
  start from: [f, emb(y) tiled over f's height and width]. Returns
  (f, y, that map)."""
  f = tf.keras.Input(feature_shape, name='features')
  y = tf.keras.Input((), dtype=tf.int32, name='label')
  emb = label_embedding(num_classes, 'label_embedding')(y)
  emb = tf.keras.layers.Reshape((1, 1, num_classes))(emb)
  emb = tf.keras.layers.UpSampling2D(feature_shape[:2])(emb)
  return f, y, tf.keras.layers.Concatenate()([f, emb])


@graph_code.plain
def _bias_and_activation(layer: tf.keras.layers.Layer, outputs):
  """What a Keras conv layer applies after its convolution."""
  if layer.use_bias:
    data_format = layer._tf_data_format  # pylint: disable=protected-access
    outputs = tf.nn.bias_add(outputs, layer.bias, data_format=data_format)
  if layer.activation is not None:
    outputs = layer.activation(outputs)
  return outputs


class SpectralNormConv2D(tf.keras.layers.Conv2D):
  """A `Conv2D` whose kernel is divided by its largest singular value.

  The singular value is estimated by power iteration on the kernel reshaped to
  `[kh * kw * c_in, c_out]`, keeping the left vector `u` as a non-trainable
  weight that is refined `power_iterations` times per training call (as
  `torch.nn.utils.spectral_norm` does). Keras' own `SpectralNormalization`
  wrapper cannot be used: it branches on `training` with a Python `if`, which
  fails on the symbolic tensors of the graph-mode layers TFF builds.
  Stride-1 VALID convolutions are computed by `small_conv` (with its
  bfloat16 route if `bfloat16_products`, by default if built within
  `small_conv.bfloat16_products()`; the power iteration stays float32).
  """

  def __init__(self, *args, power_iterations: int = 1,
               bfloat16_products: bool | None = None, **kwargs):
    super().__init__(*args, **kwargs)
    if power_iterations < 1:
      raise ValueError(f'power_iterations must be >= 1, got {power_iterations}')
    self.power_iterations = power_iterations
    self.bfloat16_products = _bfloat16_products(bfloat16_products)

  def build(self, input_shape):
    super().build(input_shape)
    self.sn_u_initializer = tf.keras.initializers.RandomNormal(0.0, 1.0)
    self.sn_u = self.add_weight(
        name='sn_u',
        shape=(1, self.filters),
        initializer=self.sn_u_initializer,
        trainable=False,
    )

  def _matrix(self):
    return tf.reshape(self.kernel, [-1, self.filters])

  def _power_iteration(self, u):
    """`power_iterations` steps from u. Returns the new u and the last v
    (constants) and v W as a function of W. sigma = (v W) u^T needs the
    very product the last step normalised into u, so it is computed once:
    one kernel-sized pass fewer per training call, with the values and
    gradients of recomputing it (tests/lenet_test.py). For D's 1024x512
    kernel, sigma and its gradient take 177 us instead of 224 us (one
    thread, median of 5 x 2000 calls, Intel Xeon AVX-512, 2026-12-03)."""
    w = self._matrix()
    for _ in range(self.power_iterations):
      v = tf.stop_gradient(
          tf.math.l2_normalize(tf.matmul(u, w, transpose_b=True)))
      v_w = tf.matmul(v, w)
      u = tf.stop_gradient(tf.math.l2_normalize(v_w))
    return u, v, v_w

  @graph_code.plain
  def _power_iterations(self, passes: int):
    """The power iteration of each of `passes` training passes, in order:
    the first from the stored u, each next from the u before it (what
    that many training calls compute). Returns each pass's (u, v, v W) and
    the op storing the last u."""
    u = self.sn_u
    steps = []
    for _ in range(passes):
      u, v, v_w = self._power_iteration(u)
      steps.append((u, v, v_w))
    return steps, self.sn_u.assign(u)

  @graph_code.plain
  def spectral_norm(self, training: bool = False) -> tf.Tensor:
    """The estimate u^T W v of the kernel's largest singular value.

    With `training=True` the power iteration runs and `u` is updated first.
    Gradients flow through W (u and v are constants), as in PyTorch.
    """
    if training:
      ((u, _, v_w),), stored = self._power_iterations(1)
      with tf.control_dependencies([stored]):
        return _sigma(v_w, u)
    w = self._matrix()
    u = self.sn_u
    v = tf.math.l2_normalize(tf.matmul(u, w, transpose_b=True))
    return tf.squeeze(tf.matmul(tf.matmul(v, w), u, transpose_b=True))

  def normalized_kernel(self, training: bool = False) -> tf.Tensor:
    """The kernel divided by its estimated spectral norm (for inspection)."""
    return self.kernel / self.spectral_norm(training)

  def call(self, inputs, training=None):
    # conv(x, W / sigma) == conv(x, W) / sigma: dividing the small output
    # instead of the kernel (up to 512k weights) saves a kernel-sized division
    # forwards and several kernel-sized ops in the gradient.
    # In training, one power iteration and sigma per pass (equal parts of
    # the batch): see paired_passes.
    passes = (2 if _paired(training) else 1) if training else 0
    if small_conv.applies(self, inputs):
      if passes:
        steps, stored = self._power_iterations(passes)
        with tf.control_dependencies([stored]):
          return _bias_and_activation(self, small_conv.conv2d(
              inputs, self.kernel,
              _sigma_divided_product(steps, self.bfloat16_products)))
      outputs = small_conv.conv2d(inputs, self.kernel,
                                  bfloat16=self.bfloat16_products)
    else:
      outputs = self.convolution_op(inputs, self.kernel)
    if not passes:
      return _bias_and_activation(self, outputs / self.spectral_norm())
    steps, stored = self._power_iterations(passes)
    with tf.control_dependencies([stored]):
      outputs = tf.concat([part / _sigma(v_w, u) for part, (u, _, v_w)
                           in zip(tf.split(outputs, passes), steps)], 0)
    return _bias_and_activation(self, outputs)

  def get_config(self):
    config = super().get_config()
    config['power_iterations'] = self.power_iterations
    config['bfloat16_products'] = self.bfloat16_products
    return config


@graph_code.plain
def _sigma(v_w, u):
  """sigma = (v W) u^T from the power iteration's last v W and u."""
  return tf.squeeze(tf.matmul(v_w, u, transpose_b=True))


def _bfloat16_products(given: bool | None) -> bool:
  """A layer's `bfloat16_products`: as given, else as it is built
  (`small_conv.bfloat16_products`)."""
  return small_conv.building_bfloat16() if given is None else bool(given)


@graph_code.plain
def _sigma_divided_product(steps, bfloat16: bool = False):
  """For `small_conv.conv2d` in training: patches @ W with the h-th of
  len(steps) equal row blocks divided by its pass's sigma_h = v_h W u_h^T
  (`_power_iterations`' steps; v_h, u_h constants).

  The values of dividing the conv's output by `spectral_norm(training=True)`
  once per pass, and its gradients to float rounding, but W's gradient is
  one product: dsigma_h / dW = v_h^T u_h, so dW = patches^T dY + sum_h
  v_h^T (u_h dsigma_h) = [patches; v_1; ...]^T [dY; u_1 dsigma_1; ...],
  a row per pass appended, where TF's gradient makes a [k, c_out] product
  per sigma and sums them (on the Zen 3 host the first pass's took 1.1 ms
  of a 20 ms GAN step for D's 1024 x 512 kernel). First order only: the
  gradient treats each sigma as the constant its rows carry. `bfloat16`:
  both products by `small_conv.matmul`'s bfloat16 route.
  """
  us = [u for u, _, _ in steps]
  vs = [v for _, v, _ in steps]
  sigmas = [_sigma(tf.stop_gradient(v_w), u) for u, _, v_w in steps]

  @tf.custom_gradient
  def product(patches, matrix):
    parts = tf.split(small_conv.matmul(patches, matrix, bfloat16),
                     len(sigmas))
    outputs = [part / sigma for part, sigma in zip(parts, sigmas)]

    def gradient(d_outputs):
      d_outputs = tf.split(d_outputs, len(sigmas))
      d_product = tf.concat(
          [d / sigma for d, sigma in zip(d_outputs, sigmas)], 0)
      d_sigmas = [-tf.reduce_sum(d * out) / sigma
                  for d, out, sigma in zip(d_outputs, outputs, sigmas)]
      d_matrix = small_conv.matmul(
          tf.concat([patches] + vs, 0),
          tf.concat([d_product] + [d * u for d, u in zip(d_sigmas, us)], 0),
          bfloat16, transpose_a=True)
      return (small_conv.times_transposed(d_product, matrix, bfloat16),
              d_matrix)

    return tf.concat(outputs, 0), gradient

  return product


class BandedConv2D(tf.keras.layers.Conv2D):
  """Keras' Conv2D, computed by `small_conv.banded_conv2d` where
  `small_conv.bands` says it is faster (a single input channel)."""

  def convolution_op(self, inputs, kernel):
    if small_conv.bands(self, inputs):
      return small_conv.banded_conv2d(inputs, kernel)
    return super().convolution_op(inputs, kernel)


class SmallConv2DTranspose(tf.keras.layers.Conv2DTranspose):
  """A `Conv2DTranspose` computed by `small_conv` where it applies.

  Same weights, names and function as the Keras layer; only faster on the
  generator's tiny maps (see `small_conv`). `bfloat16_products`: as in
  `SpectralNormConv2D`.
  """

  def __init__(self, *args, bfloat16_products: bool | None = None, **kwargs):
    super().__init__(*args, **kwargs)
    self.bfloat16_products = _bfloat16_products(bfloat16_products)

  def call(self, inputs):
    if not small_conv.applies(self, inputs):
      return super().call(inputs)
    return _bias_and_activation(
        self, small_conv.conv2d_transpose(inputs, self.kernel,
                                          self.bfloat16_products))

  def get_config(self):
    config = super().get_config()
    config['bfloat16_products'] = self.bfloat16_products
    return config
