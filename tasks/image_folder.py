"""Images from class folders (`<dir>/<class>/*.png|jpg`), decoded to uint8
arrays of one square size, with errors that name the path at fault."""

import os

import numpy as np
import tensorflow as tf

IMAGE_EXTENSIONS = ('.png', '.jpg', '.jpeg', '.bmp', '.gif')


def require_dir(path: str, what: str) -> str:
  """`path` if it is a directory; else FileNotFoundError naming `what`."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f'{what} not found: {path!r} is not a directory')
  return path


def load_class_folders(directory: str, classes: list[str], image_size: int,
                       channels: int = 3) -> tuple[np.ndarray, np.ndarray]:
  """(images uint8 [n, size, size, channels], labels int32) from
  `<directory>/<class>/*`, label = index of the class in `classes`.

  Every class folder must exist and hold at least one image; an image that
  cannot be decoded is an error naming the file.
  """
  require_dir(directory, 'image folder')
  images, labels = [], []
  for label, name in enumerate(classes):
    class_dir = os.path.join(directory, name)
    if not os.path.isdir(class_dir):
      raise FileNotFoundError(
          f'class folder {class_dir!r} is missing: {directory!r} must hold '
          f'one folder per class ({", ".join(classes)})')
    files = sorted(f for f in os.listdir(class_dir)
                   if f.lower().endswith(IMAGE_EXTENSIONS))
    if not files:
      raise ValueError(f'class folder {class_dir!r} holds no image '
                       f'({"/".join(IMAGE_EXTENSIONS)})')
    for f in files:
      images.append(read_image(os.path.join(class_dir, f), image_size,
                               channels))
      labels.append(label)
  return np.stack(images), np.asarray(labels, np.int32)


def read_image(path: str, image_size: int, channels: int) -> np.ndarray:
  """One image file as uint8 [size, size, channels] (bilinear resize)."""
  try:
    image = tf.io.decode_image(tf.io.read_file(path), channels=channels,
                               expand_animations=False)
  except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError) as e:
    raise ValueError(f'{path}: unreadable image ({e.message.strip()})') from None
  if image.shape[0] != image_size or image.shape[1] != image_size:
    image = tf.image.resize(tf.cast(image, tf.float32),
                            (image_size, image_size), method='bilinear')
    image = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
  return image.numpy()
