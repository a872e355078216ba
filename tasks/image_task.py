"""A federated image-classification task: client splits and their pipelines.

Images are kept as uint8 NHWC arrays at the size they were loaded with (so
a 224x224 ResNet task does not hold float copies of every client's data);
each pipeline converts, resizes to the network's input size, normalises,
adds the client's Gaussian input noise if the task has any, and (training
only) flips at random. Each round asks for fresh training datasets whose
shuffling, flips and noise are seeded by (task seed, round, client), so a run
is reproducible and every round sees a different order, flips and noise.
Each pass over a training dataset (each new iterator) redraws them: the
passes must be made in a fixed order (fedcg_tff/training_tf.py,
PASS_ORDER_NOTE).
"""

import dataclasses

import numpy as np
import tensorflow as tf

EVAL_BATCH_SIZE = 500


@dataclasses.dataclass(frozen=True)
class ClientSplit:
  """One client's arrays: images uint8 NHWC, labels int32."""
  train: tuple[np.ndarray, np.ndarray]
  val: tuple[np.ndarray, np.ndarray]
  test: tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass(frozen=True)
class FederatedImageTask:
  """Clients' data and how to feed it to the networks."""
  name: str
  clients: tuple[ClientSplit, ...]
  num_classes: int
  channels: int
  seed: int
  mean: tuple[float, ...]  # Per channel, of images scaled to [0, 1].
  std: tuple[float, ...]
  client_names: tuple[str, ...] = ()
  # Std of the Gaussian noise added to client i's normalised inputs.
  noise_stds: tuple[float, ...] = ()
  # Unlabeled server images (uint8 NHWC) for FedDF's distillation, disjoint
  # from every client's data; None if the task has none.
  server_images: np.ndarray | None = None

  def __post_init__(self):
    if not self.client_names:
      object.__setattr__(self, 'client_names',
                         tuple(f'client_{i}' for i in range(len(self.clients))))
    if not self.noise_stds:
      object.__setattr__(self, 'noise_stds', (0.0,) * len(self.clients))

  @property
  def num_clients(self) -> int:
    return len(self.clients)

  def train_datasets(self, round_num: int, batch_size: int,
                     image_size: int = 32) -> list[tf.data.Dataset]:
    """Per client: shuffled, randomly flipped training batches for a round.

    Each pass over a dataset (one local epoch) reshuffles and redraws flips
    and noise.
    """
    return [
        self._pipeline(i, c.train, image_size, batch_size,
                       seed=(self.seed * 1_000_003 + round_num) * 1_009 + i)
        for i, c in enumerate(self.clients)
    ]

  def val_datasets(self, image_size: int = 32) -> list[tf.data.Dataset]:
    return [self._pipeline(i, c.val, image_size) for i, c in
            enumerate(self.clients)]

  def test_datasets(self, image_size: int = 32) -> list[tf.data.Dataset]:
    return [self._pipeline(i, c.test, image_size) for i, c in
            enumerate(self.clients)]

  def server_inputs(self, image_size: int = 32) -> np.ndarray | None:
    """FedDF's server images, preprocessed like the clients' (no noise)."""
    if self.server_images is None:
      return None
    ds = tf.data.Dataset.from_tensor_slices(self.server_images).map(
        lambda x: _prepare(x, image_size, self.mean, self.std)).batch(1000)
    return np.concatenate(list(ds.as_numpy_iterator()))

  def describe(self) -> str:
    """What a run prints at start: clients, split sizes, label histograms."""
    lines = [f'task {self.name}: {self.num_clients} clients, '
             f'{self.num_classes} classes, {self.channels} channel(s), '
             f'stored {self.clients[0].train[0].shape[1]}x'
             f'{self.clients[0].train[0].shape[2]}']
    for name, c, std in zip(self.client_names, self.clients, self.noise_stds):
      histogram = np.bincount(c.train[1], minlength=self.num_classes)
      lines.append(
          f'  {name}: train {len(c.train[1])} / val {len(c.val[1])} / test '
          f'{len(c.test[1])}{f", input noise std {std:.3g}" if std else ""}'
          f'; train labels {histogram.tolist()}')
    if self.server_images is not None:
      lines.append(f'  server: {len(self.server_images)} unlabeled images')
    return '\n'.join(lines)

  def _pipeline(self, client, arrays, image_size, batch_size=None, seed=None):
    images, labels = arrays
    mean, std, noise_std = self.mean, self.std, float(self.noise_stds[client])
    if seed is None:  # Evaluation: fixed order, fixed noise per example.
      ds = tf.data.Dataset.from_tensor_slices((images, labels))
      draws = tf.data.Dataset.range(len(labels))
      flip = False
      batch_size = EVAL_BATCH_SIZE
    else:
      # Separate seeds for the order and the flips: with one seed the two
      # streams coincide and whether an image is flipped depends on its
      # index.
      shuffle_seed, draw_seed = (
          int(s) for s in np.random.SeedSequence(seed).generate_state(2) >> 1)
      ds = tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(
          len(labels), seed=shuffle_seed, reshuffle_each_iteration=True)
      draws = tf.data.Dataset.random(seed=draw_seed,
                                     rerandomize_each_iteration=True)
      flip = True

    def transform(example, draw):
      image, label = example
      image = _prepare(image, image_size, mean, std)
      if noise_std:
        image += noise_std * tf.random.stateless_normal(
            tf.shape(image), tf.stack([draw, tf.constant(client, tf.int64)]))
      if flip:
        image = tf.cond(tf.equal(tf.math.floormod(draw, 2), 1),
                        lambda: tf.reverse(image, axis=[1]), lambda: image)
      return image, label

    ds = tf.data.Dataset.zip((ds, draws)).map(
        transform, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.batch(batch_size)


def _prepare(image, image_size, mean, std):
  """uint8 HWC -> float32, resized to `image_size`, normalised."""
  x = tf.cast(image, tf.float32)
  if image.shape[0] != image_size or image.shape[1] != image_size:
    x = tf.image.resize(x, (image_size, image_size), method='bilinear')
  x = x / 255.0
  return (x - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)


def as_nhwc(images: np.ndarray) -> np.ndarray:
  """uint8 NHW or NHWC -> NHWC."""
  images = np.asarray(images)
  return images[..., None] if images.ndim == 3 else images


def noise_stds(num_clients: int, noise_std: float) -> tuple[float, ...]:
  """The spec's per-client input noise: client i gets noise_std·i/(n − 1)."""
  if noise_std < 0:
    raise ValueError(f'noise_std must be >= 0, got {noise_std}')
  if num_clients == 1:
    return (0.0,)
  return tuple(noise_std * i / (num_clients - 1) for i in range(num_clients))


def take(arrays, indices) -> tuple[np.ndarray, np.ndarray]:
  images, labels = arrays
  return images[indices], labels[indices].astype(np.int32)
