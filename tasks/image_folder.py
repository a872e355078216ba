"""Images from class folders (`<dir>/<class>/*.png|jpg`), decoded to uint8
arrays of one square size, with errors that name the path at fault."""

import os
import re

import numpy as np
import tensorflow as tf

from tasks import image_task

IMAGE_EXTENSIONS = ('.png', '.jpg', '.jpeg', '.bmp', '.gif')


def _blocked_by(path: str) -> str | None:
  """The nearest existing directory above a `path` that looks missing, if
  this user may not enter it (then `os.path.isdir` and `isfile` say False
  whether or not `path` is there: a data set unpacked by another user)."""
  here = os.path.abspath(path)
  while not os.path.exists(here):
    here = os.path.dirname(here)
  if here == os.path.abspath(path) or not os.path.isdir(here):
    return None
  return None if os.access(here, os.X_OK) else here


def refuse_if_blocked(path: str, what: str) -> None:
  """ValueError naming `what` and the directory this user may not enter,
  if that is why `path` looks missing."""
  blocked = _blocked_by(path)
  if blocked:
    raise ValueError(f'{what} {path!r} cannot be read: this user may not '
                     f'enter {blocked!r}')


def require_dir(path: str, what: str) -> str:
  """`path` if it is a directory; else FileNotFoundError naming `what` (or
  `refuse_if_blocked`'s error)."""
  if not os.path.isdir(path):
    refuse_if_blocked(path, what)
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
      refuse_if_blocked(class_dir, 'class folder')
      raise FileNotFoundError(
          f'class folder {class_dir!r} is missing: {directory!r} must hold '
          f'one folder per class ({", ".join(classes)})')
    try:
      files = sorted(f for f in os.listdir(class_dir)
                     if f.lower().endswith(IMAGE_EXTENSIONS))
    except OSError as e:  # E.g. unpacked by another user (mode 700).
      raise ValueError(f'class folder {class_dir!r} cannot be listed '
                       f'({e.strerror})') from None
    if not files:
      raise ValueError(f'class folder {class_dir!r} holds no image '
                       f'({"/".join(IMAGE_EXTENSIONS)})')
    for f in files:
      images.append(read_image(os.path.join(class_dir, f), image_size,
                               channels))
      labels.append(label)
  return np.stack(images), np.asarray(labels, np.int32)


def read_image(path: str, image_size: int, channels: int) -> np.ndarray:
  """One image file as uint8 [size, size, channels] (`image_task.resize`)."""
  # Read by Python, not tf.io.read_file: its errors name the cause, and a
  # file name that is not UTF-8 (from an archive made elsewhere) is read.
  try:
    with open(path, 'rb') as f:
      data = f.read()
  except OSError as e:  # Unreadable, a directory, a broken link.
    raise ValueError(f'{path!r}: cannot read ({e.strerror})') from None
  try:
    image = tf.io.decode_image(data, channels=channels,
                               expand_animations=False)
  except tf.errors.OpError as e:
    raise ValueError(f'{path!r}: unreadable image ({op_error_text(e)})'
                     ) from None
  if image.shape[0] != image_size or image.shape[1] != image_size:
    image = image_task.resize_uint8(image, image_size)
  return image.numpy()


def op_error_text(error) -> str:
  """A TF op error's message without TF's node name and op suffix."""
  return re.sub(r'\{\{.*?\}\}|\[Op:.*$', '', error.message).strip()
