"""Reading TFDS image datasets into uint8 arrays, with a clear error when a
dataset is not there.

Nothing is downloaded from here: on an offline machine a download would hang
in retries. A missing dataset is reported with the command that prepares it
(`tfds build <name>`, on a machine with access, into the same data_dir).
"""

from typing import Sequence

import numpy as np

from tasks import image_folder
from tasks import image_task


def load(name: str, splits: list[str], data_dir: str | None = None,
         image_size: int | None = None, channels: int | None = None,
         keep_labels: Sequence[int] | None = None
         ) -> list[tuple[np.ndarray, np.ndarray]]:
  """(images uint8 NHWC, labels int32) per split of TFDS dataset `name`.

  With `image_size`, every image is resized to that square size as it is
  read (`image_task.resize`: bilinear, averaging when it shrinks), which
  also lets datasets of varying image sizes (DomainNet) be stacked; with
  `channels=3`, grey images are repeated over RGB. With `keep_labels`, only
  the examples of those (TFDS) labels are kept, before they are resized or
  held: DomainNet's ten classes of 345 (a large domain's 173 000 images
  would take about 26 GB at 224 x 224 if all were stacked first).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  # Where TFDS looks (--data_dir, else $TFDS_DATA_DIR, else its default),
  # for the messages below.
  where = tfds.core.utils.file_utils.get_default_data_dir(data_dir)
  try:
    datasets = tfds.load(name, split=splits, data_dir=data_dir,
                         download=False)
  except Exception as e:  # pylint: disable=broad-except
    # TFDS raises DatasetNotFoundError, AssertionError or FileNotFoundError
    # depending on what is missing; all mean the same to the user.
    raise FileNotFoundError(
        f'TFDS dataset {name!r} (splits {splits}) is not prepared in {where} '
        f'and is not downloaded from here: run `tfds build {name} '
        f'--data_dir={where}` where the network allows, or use the '
        f'image-folder source ({type(e).__name__}: {e})') from None

  def convert(example):
    image = example['image']
    if channels == 3 and image.shape[-1] == 1:
      image = tf.image.grayscale_to_rgb(image)
    if image_size is not None:
      image = image_task.resize_uint8(image, image_size)
    return image, example['label']

  out = []
  for split, ds in zip(splits, datasets):
    # Batched reads: `batch_size=-1` aborts under tfds.testing.mock_data.
    images, labels = [], []
    try:
      if keep_labels is not None:
        wanted = tf.constant(list(keep_labels), tf.int64)
        ds = ds.filter(lambda example: tf.reduce_any(
            tf.cast(example['label'], tf.int64) == wanted))
      for batch in ds.map(convert).batch(10_000).as_numpy_iterator():
        images.append(batch[0])
        labels.append(batch[1])
    # A shard cut short or deleted (not, say, memory running out).
    except (tf.errors.DataLossError, tf.errors.NotFoundError,
            tf.errors.FailedPreconditionError) as e:
      raise ValueError(
          f'TFDS dataset {name!r} in {where} is damaged: split {split!r} '
          f'cannot be read ({type(e).__name__}: '
          f'{image_folder.op_error_text(e)}); prepare it '
          f'again with `tfds build {name} --data_dir={where}`') from None
    images = np.concatenate(images)
    if images.ndim == 3:
      images = images[..., None]
    out.append((images.astype(np.uint8), np.concatenate(labels).astype(
        np.int32)))
  return out
