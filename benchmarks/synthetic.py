"""The benchmarks' stand-in for one FMNIST client: 2000 seeded random
32x32 images and labels, batched and cached (timing needs the shapes, not
the pixels), without tf.data's autotuning as the clients' own pipelines
(`tasks.image_task.without_autotune`), and one client's GAN epoch on it.

Importing it loads TFF (the optimizers), so it loads `runtime` too, for its
exit hook: the benchmarks using it exit without TFF's `ServiceManager`
traceback."""

import numpy as np
import tensorflow as tf

from fedcg_tff.algorithms import fedcg_tf
from fedcg_tff.execution import runtime  # pylint: disable=unused-import
from tasks import image_task


def client_dataset(batch_size: int, size: int = 2000, seed: int = 0
                   ) -> tf.data.Dataset:
  rng = np.random.default_rng(seed)
  return image_task.without_autotune(tf.data.Dataset.from_tensor_slices((
      rng.normal(size=(size, 32, 32, 1)).astype(np.float32),
      rng.integers(0, 10, size).astype(np.int32))).batch(batch_size).cache())


def gan_epoch(config, dataset: tf.data.Dataset):
  """A `tf.function` running `config.gan_epochs` of stage 2 for one fresh
  client (networks and optimizer states of seed 1) over `dataset`, as a
  round's client runs it; D's passes are traced as `fedcg_tf.PAIRED_D_PASSES`
  is set at the first call."""
  nets = fedcg_tf.PartyNetworks(config)
  state = fedcg_tf.initial_client_state(config, 1)
  return tf.function(lambda: fedcg_tf.train_gan(
      nets, state.discriminator_optimizer, state.generator_optimizer,
      dataset, state.seed, 0))
