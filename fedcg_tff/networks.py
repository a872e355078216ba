"""Keras builders for FedCG's LeNet-5 split networks (FEDCG_SPEC.md, Networks).

Shapes are NHWC: the extractor's 16x5x5 feature map of the spec is a
`(5, 5, 16)` tensor here. All builders are plain Keras and work both eagerly
and inside the graph-mode (Keras v1) context of a TFF computation.

Choices the spec leaves open, made to match the published PyTorch code:
* The extractor's and classifier's layers keep their bias (PyTorch's default);
  only the generator's and discriminator's convolutions are bias-free.
* The N(0, 0.02) kernel / N(1, 0.02) batch-norm initialisation (DCGAN's) is
  applied to the generator and discriminator, which is where the published
  code applies it.
* E and C keep PyTorch's layer defaults, as the published code leaves them
  (`torch_default_init`): kernel and bias uniform in +-1/sqrt(fan_in).
  Keras' Glorot-uniform kernels with zero biases are up to 2.3x wider in
  the classifier, and with sigmoid activations they learn several points
  faster in the first rounds than the published code (issue 15's curves);
  every comparison with the paper depends on starting alike, so Keras'
  scheme is not offered.
* Label embeddings are initialised N(0, 1), as `torch.nn.Embedding` is.
* The discriminator returns the *logit* of "real"; the spec's final sigmoid is
  applied inside the binary cross-entropy (`from_logits=True`), which is the
  same function computed without the overflow of log(sigmoid(x)).
"""

from typing import Sequence

import tensorflow as tf

from fedcg_tff import small_conv

FEATURE_SHAPE = (5, 5, 16)
IMAGE_SIZE = 32
LEAKY_SLOPE = 0.2
BN_MOMENTUM = 0.9  # PyTorch's momentum 0.1 in Keras' convention.
BN_EPSILON = 1e-5  # PyTorch's default.


def gan_kernel_init():
  return tf.keras.initializers.RandomNormal(0.0, 0.02)


def gan_batch_norm():
  return tf.keras.layers.BatchNormalization(
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
  `RandomUniform`s here (so `sample_initial_weights` redraws them).
  """
  bound = 1.0 / float(fan_in) ** 0.5
  init = lambda: tf.keras.initializers.RandomUniform(-bound, bound)
  return {'kernel_initializer': init(), 'bias_initializer': init()}


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
  Stride-1 VALID convolutions are computed by `small_conv`.
  """

  def __init__(self, *args, power_iterations: int = 1, **kwargs):
    super().__init__(*args, **kwargs)
    if power_iterations < 1:
      raise ValueError(f'power_iterations must be >= 1, got {power_iterations}')
    self.power_iterations = power_iterations

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

  def _power_iteration(self):
    w = self._matrix()
    u = self.sn_u
    for _ in range(self.power_iterations):
      v = tf.math.l2_normalize(tf.matmul(u, w, transpose_b=True))
      u = tf.math.l2_normalize(tf.matmul(v, w))
    return tf.stop_gradient(u), tf.stop_gradient(v)

  def spectral_norm(self, training: bool = False) -> tf.Tensor:
    """The estimate u^T W v of the kernel's largest singular value.

    With `training=True` the power iteration runs and `u` is updated first.
    Gradients flow through W (u and v are constants), as in PyTorch.
    """
    w = self._matrix()
    if training:
      u, v = self._power_iteration()
      with tf.control_dependencies([self.sn_u.assign(u)]):
        return tf.squeeze(tf.matmul(tf.matmul(v, w), u, transpose_b=True))
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
    sigma = self.spectral_norm(training=bool(training))
    if small_conv.applies(self, inputs):
      outputs = small_conv.conv2d(inputs, self.kernel) / sigma
    else:
      outputs = self.convolution_op(inputs, self.kernel) / sigma
    return _bias_and_activation(self, outputs)

  def get_config(self):
    config = super().get_config()
    config['power_iterations'] = self.power_iterations
    return config


class SmallConv2DTranspose(tf.keras.layers.Conv2DTranspose):
  """A `Conv2DTranspose` computed by `small_conv` where it applies.

  Same weights, names and function as the Keras layer; only faster on the
  generator's tiny maps (see `small_conv`).
  """

  def call(self, inputs):
    if not small_conv.applies(self, inputs):
      return super().call(inputs)
    return _bias_and_activation(
        self, small_conv.conv2d_transpose(inputs, self.kernel))


def build_extractor(channels: int = 1) -> tf.keras.Model:
  """E: conv5-6, avgpool2, sigmoid, conv5-16, avgpool2, sigmoid -> 5x5x16."""
  x = inputs = tf.keras.Input((IMAGE_SIZE, IMAGE_SIZE, channels), name='image')
  for i, filters in enumerate((6, 16)):
    x = tf.keras.layers.Conv2D(
        filters, 5, name=f'conv{i + 1}',
        **torch_default_init(x.shape[-1] * 5 * 5))(x)
    x = tf.keras.layers.AveragePooling2D(2)(x)
    x = tf.keras.layers.Activation('sigmoid')(x)
  return tf.keras.Model(inputs, x, name='extractor')


def build_classifier(num_classes: int = 10) -> tf.keras.Model:
  """C: flatten, dense 120, sigmoid, dense 84, sigmoid, dense num_classes."""
  x = inputs = tf.keras.Input(FEATURE_SHAPE, name='features')
  x = tf.keras.layers.Flatten()(x)
  for i, units in enumerate((120, 84)):
    x = tf.keras.layers.Dense(
        units, activation='sigmoid', name=f'fc{i + 1}',
        **torch_default_init(x.shape[-1]))(x)
  logits = tf.keras.layers.Dense(
      num_classes, name='logits', **torch_default_init(x.shape[-1]))(x)
  return tf.keras.Model(inputs, logits, name='classifier')


def label_embedding(num_classes, name):
  return tf.keras.layers.Embedding(
      num_classes, num_classes,
      embeddings_initializer=tf.keras.initializers.RandomNormal(0.0, 1.0),
      name=name)


def build_generator(num_classes: int = 10,
                    noise_dim: int = 100) -> tf.keras.Model:
  """G(z, y): [z, emb(y)] as a 1x1 map, four 2x2 transposed convs -> 5x5x16."""
  z = tf.keras.Input((noise_dim,), name='noise')
  y = tf.keras.Input((), dtype=tf.int32, name='label')
  emb = label_embedding(num_classes, 'label_embedding')(y)
  x = tf.keras.layers.Concatenate()([z, emb])
  x = tf.keras.layers.Reshape((1, 1, noise_dim + num_classes))(x)
  widths = (512, 256, 128)
  for i, filters in enumerate(widths):
    x = SmallConv2DTranspose(
        filters, 2, use_bias=False,
        kernel_initializer=gan_kernel_init(),
        name=f'deconv{i + 1}')(x)
    x = gan_batch_norm()(x)
    x = tf.keras.layers.LeakyReLU(LEAKY_SLOPE)(x)
  x = SmallConv2DTranspose(
      FEATURE_SHAPE[-1], 2, use_bias=False, activation='sigmoid',
      kernel_initializer=gan_kernel_init(),
      name=f'deconv{len(widths) + 1}')(x)
  return tf.keras.Model([z, y], x, name='generator')


def build_discriminator(num_classes: int = 10) -> tf.keras.Model:
  """D(f, y): [f, tiled emb(y)], four spectral-norm 2x2 convs -> logit."""
  f = tf.keras.Input(FEATURE_SHAPE, name='features')
  y = tf.keras.Input((), dtype=tf.int32, name='label')
  emb = label_embedding(num_classes, 'label_embedding')(y)
  emb = tf.keras.layers.Reshape((1, 1, num_classes))(emb)
  emb = tf.keras.layers.UpSampling2D(FEATURE_SHAPE[:2])(emb)  # tile to 5x5
  x = tf.keras.layers.Concatenate()([f, emb])
  widths = (128, 256, 512)
  for i, filters in enumerate(widths):
    x = SpectralNormConv2D(
        filters, 2, use_bias=False,
        kernel_initializer=gan_kernel_init(),
        name=f'conv{i + 1}')(x)
    x = gan_batch_norm()(x)
    x = tf.keras.layers.LeakyReLU(LEAKY_SLOPE)(x)
  x = SpectralNormConv2D(
      1, 2, use_bias=False,
      kernel_initializer=gan_kernel_init(),
      name=f'conv{len(widths) + 1}')(x)
  logit = tf.keras.layers.Reshape(())(x)
  return tf.keras.Model([f, y], logit, name='discriminator')


# Weights cross TFF boundaries as plain tuples of tensors, in `model.weights`
# order (trainable and non-trainable: batch-norm statistics and the spectral
# norm's `u` travel with the network they belong to).


def weight_values(model: tf.keras.Model) -> tuple[tf.Tensor, ...]:
  """All of `model`'s weights as a tuple of tensors (read, not variables)."""
  return tuple(tf.identity(v) for v in model.weights)


def assign_weights(model: tf.keras.Model, values: Sequence[tf.Tensor]):
  """Assigns `values` (as from `weight_values`) to `model`; returns the ops."""
  if len(values) != len(model.weights):
    raise ValueError(f'{model.name} has {len(model.weights)} weights, '
                     f'got {len(values)} values')
  return [v.assign(t) for v, t in zip(model.weights, values)]


def _initializer_by_variable(model: tf.keras.Model) -> dict[int, object]:
  """Maps id(variable) to the Keras initialiser that created it."""
  found = {}
  for layer in model.submodules:
    if not isinstance(layer, tf.keras.layers.Layer):
      continue
    for attr, init in vars(layer).items():
      if not attr.endswith('_initializer'):
        continue
      variable = getattr(layer, attr[:-len('_initializer')], None)
      if isinstance(variable, tf.Variable):
        found[id(variable)] = tf.keras.initializers.get(init)
  return found


def _stateless_sample(init, shape, dtype, seed):
  """A draw from `init`'s distribution with a stateless `seed` (shape [2]).

  Dispatches on the class name because Keras hands out its v1 initialiser
  classes instead of the v2 ones when layers are built in graph mode (as
  inside a TFF computation); both carry the same attributes.
  """
  kind = type(init).__name__.lower().replace('_', '').replace('initializer', '')
  if kind == 'zeros':
    return tf.zeros(shape, dtype)
  if kind == 'ones':
    return tf.ones(shape, dtype)
  if kind in ('randomuniform', 'uniform'):
    return tf.random.stateless_uniform(shape, seed, init.minval, init.maxval,
                                       dtype)
  if kind in ('randomnormal', 'normal'):
    return tf.random.stateless_normal(shape, seed, init.mean, init.stddev,
                                      dtype)
  if kind == 'glorotuniform':
    receptive = 1
    for dim in shape[:-2]:
      receptive *= dim
    fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
    limit = (6.0 / (fan_in + fan_out)) ** 0.5
    return tf.random.stateless_uniform(shape, seed, -limit, limit, dtype)
  raise TypeError(f'No stateless sampler for initialiser {init!r}')


def sample_initial_weights(model: tf.keras.Model, seed) -> tuple[tf.Tensor, ...]:
  """Fresh initial weights for `model`, a deterministic function of `seed`.

  Keras initialisers take only Python seeds, but a TFF computation is traced
  once for all clients, each with its own seed tensor. So every weight is
  redrawn here with stateless ops from the distribution of the initialiser
  that created it (one seed stream per weight, salted by the model's name).
  """
  initializers = _initializer_by_variable(model)
  salt = sum(ord(c) * 31**i for i, c in enumerate(model.name)) % (1 << 30)
  values = []
  for index, variable in enumerate(model.weights):
    init = initializers.get(id(variable))
    if init is None:
      raise TypeError(f'{model.name}: no initialiser found for {variable.name}')
    key = tf.constant(salt * 4096 + index, tf.int64)
    values.append(_stateless_sample(
        init, variable.shape, variable.dtype,
        tf.stack([tf.cast(seed, tf.int64), key])))
  return tuple(values)
