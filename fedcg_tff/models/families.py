"""The two network families by name: LeNet-5 (`lenet`, 32x32 inputs) and
the ResNet-18 split (`resnet`, 224x224). Everything that builds networks for
a config goes through here."""

import tensorflow as tf

from fedcg_tff.models import lenet
from fedcg_tff.models import resnet

MODELS = ('lenet', 'resnet18')
_FAMILIES = {'lenet': lenet, 'resnet18': resnet}


def _family(model: str):
  if model not in _FAMILIES:
    raise ValueError(f'model must be one of {MODELS}, got {model!r}')
  return _FAMILIES[model]


def image_size(model: str) -> int:
  """The side of the square images `model`'s extractor takes."""
  return _family(model).IMAGE_SIZE


def feature_shape(model: str) -> tuple[int, int, int]:
  """`model`'s extractor output shape, which the generator imitates."""
  return _family(model).FEATURE_SHAPE


def build_extractor(model: str, channels: int) -> tf.keras.Model:
  return _family(model).build_extractor(channels)


def build_classifier(model: str, num_classes: int) -> tf.keras.Model:
  return _family(model).build_classifier(num_classes)


def build_generator(model: str, num_classes: int,
                    noise_dim: int) -> tf.keras.Model:
  return _family(model).build_generator(num_classes, noise_dim)


def build_discriminator(model: str, num_classes: int) -> tf.keras.Model:
  return _family(model).build_discriminator(num_classes)
