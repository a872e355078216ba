"""Keras builders of the LeNet-5 split networks (FEDCG_SPEC.md, PartyNetworks):
the extractor E, classifier C, conditional generator G and conditional
discriminator D, for 32x32 inputs.

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
  (`layers.torch_default_init`): kernel and bias uniform in +-1/sqrt(fan_in).
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

import tensorflow as tf

from fedcg_tff.models import layers


FEATURE_SHAPE = (5, 5, 16)


IMAGE_SIZE = 32


def build_extractor(channels: int = 1) -> tf.keras.Model:
  """E: conv5-6, avgpool2, sigmoid, conv5-16, avgpool2, sigmoid -> 5x5x16."""
  x = inputs = tf.keras.Input((IMAGE_SIZE, IMAGE_SIZE, channels), name='image')
  for i, filters in enumerate((6, 16)):
    x = layers.BandedConv2D(
        filters, 5, name=f'conv{i + 1}',
        **layers.torch_default_init(x.shape[-1] * 5 * 5))(x)
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
        **layers.torch_default_init(x.shape[-1]))(x)
  logits = tf.keras.layers.Dense(
      num_classes, name='logits', **layers.torch_default_init(x.shape[-1]))(x)
  return tf.keras.Model(inputs, logits, name='classifier')


def build_generator(num_classes: int = 10,
                    noise_dim: int = 100) -> tf.keras.Model:
  """G(z, y): [z, emb(y)] as a 1x1 map, four 2x2 transposed convs -> 5x5x16."""
  z, y, x = layers.generator_inputs(num_classes, noise_dim)
  widths = (512, 256, 128)
  for i, filters in enumerate(widths):
    x = layers.SmallConv2DTranspose(
        filters, 2, use_bias=False,
        kernel_initializer=layers.gan_kernel_init(),
        name=f'deconv{i + 1}')(x)
    x = layers.gan_batch_norm()(x)
    x = tf.keras.layers.LeakyReLU(layers.LEAKY_SLOPE)(x)
  x = layers.SmallConv2DTranspose(
      FEATURE_SHAPE[-1], 2, use_bias=False, activation='sigmoid',
      kernel_initializer=layers.gan_kernel_init(),
      name=f'deconv{len(widths) + 1}')(x)
  return tf.keras.Model([z, y], x, name='generator')


def build_discriminator(num_classes: int = 10) -> tf.keras.Model:
  """D(f, y): [f, emb(y) tiled to 5x5], four spectral-norm 2x2 convs -> logit."""
  f, y, x = layers.discriminator_inputs(num_classes, FEATURE_SHAPE)
  widths = (128, 256, 512)
  for i, filters in enumerate(widths):
    x = layers.SpectralNormConv2D(
        filters, 2, use_bias=False,
        kernel_initializer=layers.gan_kernel_init(),
        name=f'conv{i + 1}')(x)
    x = layers.gan_batch_norm()(x)
    x = tf.keras.layers.LeakyReLU(layers.LEAKY_SLOPE)(x)
  x = layers.SpectralNormConv2D(
      1, 2, use_bias=False,
      kernel_initializer=layers.gan_kernel_init(),
      name=f'conv{len(widths) + 1}')(x)
  logit = tf.keras.layers.Reshape(())(x)
  return tf.keras.Model([f, y], logit, name='discriminator')
