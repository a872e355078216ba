"""The ResNet-18 split of the spec (224x224 inputs), NHWC.

E = stem + layer1 + layer2, then a sigmoid: features 28x28x128.
C = layer3 + layer4 + global average pool + dense: logits.
G(z, y) and D(f, y) have the LeNet pair's structure (label embedding, BN,
LeakyReLU 0.2, spectral norm in D) with 4x4 kernels and two stride-2 stages
to reach (G) or leave (D) the 28x28 feature map.

Residual blocks follow torchvision's BasicBlock (3x3 convs without bias,
batch norm, 1x1 projection shortcut when the shape changes); batch norm uses
PyTorch's momentum and epsilon, as in `layers`.

Strided layers pad as torchvision's do, the same on every side (`_padded`),
not as Keras' 'same', which on these even sizes pads one row and column
more after the map than before it (0 and 1 for the 3x3 conv and the pool,
2 and 3 for the 7x7 stem): its windows would sit one pixel off
torchvision's, and in a downsampling block the 3x3 conv's windows would be
centred one pixel off the pixels the 1x1 shortcut reads.
"""

import tensorflow as tf

from fedcg_tff.models import layers

FEATURE_SHAPE = (28, 28, 128)
IMAGE_SIZE = 224


def _bn():
  return tf.keras.layers.BatchNormalization(
      momentum=layers.BN_MOMENTUM, epsilon=layers.BN_EPSILON)


def _padded(layer, pad: int, name: str):
  """`layer` ('valid') on its input zero-padded by `pad` on every side, as
  torchvision's `padding=pad`. (Its max pool pads with -inf; it follows a
  ReLU, so zeros give the same maxima.)"""
  return lambda x: layer(tf.keras.layers.ZeroPadding2D(pad, name=name)(x))


def _block(x, filters, stride, name):
  shortcut = x
  y = _padded(tf.keras.layers.Conv2D(filters, 3, stride, use_bias=False,
                                     name=f'{name}_conv1'),
              1, f'{name}_pad')(x)
  y = tf.keras.layers.ReLU()(_bn()(y))
  y = tf.keras.layers.Conv2D(filters, 3, padding='same', use_bias=False,
                             name=f'{name}_conv2')(y)
  y = _bn()(y)
  if stride != 1 or x.shape[-1] != filters:
    shortcut = tf.keras.layers.Conv2D(filters, 1, stride, use_bias=False,
                                      name=f'{name}_down')(x)
    shortcut = _bn()(shortcut)
  return tf.keras.layers.ReLU()(tf.keras.layers.Add()([y, shortcut]))


def _layer(x, filters, stride, name):
  x = _block(x, filters, stride, f'{name}_0')
  return _block(x, filters, 1, f'{name}_1')


def build_extractor(channels: int = 3) -> tf.keras.Model:
  x = inputs = tf.keras.Input((IMAGE_SIZE, IMAGE_SIZE, channels), name='image')
  x = _padded(tf.keras.layers.Conv2D(64, 7, 2, use_bias=False,
                                     name='stem_conv'), 3, 'stem_pad')(x)
  x = tf.keras.layers.ReLU()(_bn()(x))
  x = _padded(tf.keras.layers.MaxPooling2D(3, 2, name='stem_pool'), 1,
              'stem_pool_pad')(x)
  x = _layer(x, 64, 1, 'layer1')
  x = _layer(x, 128, 2, 'layer2')
  x = tf.keras.layers.Activation('sigmoid')(x)
  return tf.keras.Model(inputs, x, name='extractor')


def build_classifier(num_classes: int = 10) -> tf.keras.Model:
  x = inputs = tf.keras.Input(FEATURE_SHAPE, name='features')
  x = _layer(x, 256, 2, 'layer3')
  x = _layer(x, 512, 2, 'layer4')
  x = tf.keras.layers.GlobalAveragePooling2D()(x)
  logits = tf.keras.layers.Dense(num_classes, name='logits')(x)
  return tf.keras.Model(inputs, logits, name='classifier')


def build_generator(num_classes: int = 10,
                    noise_dim: int = 100) -> tf.keras.Model:
  """1x1 -> 4 -> 7 (4x4 valid) -> 14 -> 28 (4x4 stride 2) x 128, sigmoid."""
  z, y, x = layers.generator_inputs(num_classes, noise_dim)
  for i, (filters, stride, padding) in enumerate(
      ((512, 1, 'valid'), (256, 1, 'valid'), (128, 2, 'same'))):
    x = layers.SmallConv2DTranspose(
        filters, 4, stride, padding=padding, use_bias=False,
        kernel_initializer=layers.gan_kernel_init(),
        name=f'deconv{i + 1}')(x)
    x = layers.gan_batch_norm()(x)
    x = tf.keras.layers.LeakyReLU(layers.LEAKY_SLOPE)(x)
  x = layers.SmallConv2DTranspose(
      FEATURE_SHAPE[-1], 4, 2, padding='same', use_bias=False,
      activation='sigmoid', kernel_initializer=layers.gan_kernel_init(),
      name='deconv4')(x)
  return tf.keras.Model([z, y], x, name='generator')


def build_discriminator(num_classes: int = 10) -> tf.keras.Model:
  """28 -> 14 -> 7 (4x4 stride 2) -> 4 -> 1 (4x4 valid) -> logit."""
  f, y, x = layers.discriminator_inputs(num_classes, FEATURE_SHAPE)
  for i, (filters, stride, padding) in enumerate(
      ((128, 2, 'same'), (256, 2, 'same'), (512, 1, 'valid'))):
    x = layers.SpectralNormConv2D(
        filters, 4, stride, padding=padding, use_bias=False,
        kernel_initializer=layers.gan_kernel_init(), name=f'conv{i + 1}')(x)
    x = layers.gan_batch_norm()(x)
    x = tf.keras.layers.LeakyReLU(layers.LEAKY_SLOPE)(x)
  x = layers.SpectralNormConv2D(
      1, 4, use_bias=False, kernel_initializer=layers.gan_kernel_init(),
      name='conv4')(x)
  return tf.keras.Model([f, y], tf.keras.layers.Reshape(())(x),
                        name='discriminator')
