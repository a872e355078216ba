"""The benchmarks' stand-in for one FMNIST client: 2000 seeded random
32x32 images and labels, batched and cached (timing needs the shapes, not
the pixels), without tf.data's autotuning as the clients' own pipelines
(`tasks.image_task.without_autotune`)."""

import numpy as np
import tensorflow as tf

from tasks import image_task


def client_dataset(batch_size: int, size: int = 2000, seed: int = 0
                   ) -> tf.data.Dataset:
  rng = np.random.default_rng(seed)
  return image_task.without_autotune(tf.data.Dataset.from_tensor_slices((
      rng.normal(size=(size, 32, 32, 1)).astype(np.float32),
      rng.integers(0, 10, size).astype(np.int32))).batch(batch_size).cache())
