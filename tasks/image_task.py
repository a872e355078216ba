"""A federated image-classification task: client splits and their pipelines.

Images are kept as uint8 NHWC arrays at the size they were loaded with (so
a 224x224 ResNet task does not hold float copies of every client's data);
each pipeline converts, resizes to the network's input size, normalises,
adds the client's Gaussian input noise if the task has any, and (training
only) flips at random. Each round asks for fresh training datasets whose
shuffling, flips and noise are seeded by (task seed, round, client), so a run
is reproducible and every round sees a different order, flips and noise
(under FedCGConfig.replay_draws, round 0's of client 0 in every round and
for every client, as the published code's reseeded loaders give).
Each pass over a training dataset (each new iterator) redraws them: the
passes must be made in a fixed order (fedcg_tff/algorithms/training_tf.py,
PASS_ORDER_NOTE). tf.data combines these op seeds with TF's global seed:
the same order needs the same global seed when the datasets are made (none
in the binaries, which never set one before; a notebook that calls
`tf.random.set_seed` gets another, equally reproducible, order).
"""

import collections.abc
import dataclasses
import operator

import numpy as np
import tensorflow as tf

from fedcg_tff import graph_code

EVAL_BATCH_SIZE = 500
# Largest per-client cache of prepared (float32) training images.
MAX_CACHE_BYTES = 256 * 2**20


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
  # Their labels (FedDF ignores them; the inversion attack's labelled
  # auxiliary data uses them); None with no server images.
  server_labels: np.ndarray | None = None

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
                     image_size: int = 32,
                     replay: bool = False) -> 'ClientDatasets':
    """Per client: shuffled, randomly flipped training batches for a round.

    Each pass over a dataset (one local epoch) reshuffles and redraws flips
    and noise. `replay` (FedCGConfig.replay_draws): every round's and
    every client's draws are round 0's of client 0 (input noise still at
    each client's own std), as the published code's loaders give after
    it reseeds them. A client's pipeline is built when it is first
    indexed: with client sampling only the round's clients are (building
    all 100 of a 100-client FMNIST task took 2.5 s a round, more than
    training 10).
    """
    def seed(i):
      return data_seed(self.seed, *((0, 0) if replay else (round_num, i)))

    return ClientDatasets(
        len(self.clients),
        lambda i: self._pipeline(
            i, self.clients[i].train, image_size, batch_size, seed=seed(i),
            noise_key=0 if replay else i))

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

  def _pipeline(self, client, arrays, image_size, batch_size=None, seed=None,
                noise_key=None):
    """`noise_key` keys the input noise with the draws (default: the
    client's index)."""
    noise_key = client if noise_key is None else noise_key
    images, labels = arrays
    mean, std, noise_std = self.mean, self.std, float(self.noise_stds[client])
    if seed is None:  # Evaluation: fixed order, fixed noise per example.
      ds = tf.data.Dataset.from_tensor_slices((images, labels))
      draws = tf.data.Dataset.range(len(labels))
      flip = False
      batch_size = EVAL_BATCH_SIZE
      prepared = False
    else:
      # Separate seeds for the order and the flips: with one seed the two
      # streams coincide and whether an image is flipped depends on its
      # index.
      shuffle_seed, draw_seed = (
          int(s) for s in seed.generate_state(2) >> 1)
      # Conversion, resizing and normalisation do not change from pass to
      # pass: done on the first pass and cached (a round makes three passes,
      # counting, stage 1, stage 2); noise and flips are redrawn each pass.
      # Only while the cache stays small (FMNIST: 8 MB a client; not
      # 224x224 ResNet inputs).
      ds = tf.data.Dataset.from_tensor_slices((images, labels))
      prepared = (len(labels) * image_size**2 * images.shape[-1] * 4 <=
                  MAX_CACHE_BYTES)
      if prepared:
        ds = ds.map(
            lambda image, label: (
                _prepare(image, image_size, mean, std), label),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).cache()
      ds = ds.shuffle(len(labels), seed=shuffle_seed,
                      reshuffle_each_iteration=True)
      draws = tf.data.Dataset.random(seed=draw_seed,
                                     rerandomize_each_iteration=True)
      flip = True

    @graph_code.plain  # Its Python `if`s are on Python values.
    def transform(example, draw):
      image, label = example
      if not prepared:
        image = _prepare(image, image_size, mean, std)
      if noise_std:
        image += noise_std * tf.random.stateless_normal(
            tf.shape(image), tf.stack([draw, tf.constant(noise_key,
                                                         tf.int64)]))
      if flip:
        image = tf.cond(tf.equal(tf.math.floormod(draw, 2), 1),
                        lambda: tf.reverse(image, axis=[1]), lambda: image)
      return image, label

    ds = tf.data.Dataset.zip((ds, draws)).map(
        transform, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return without_autotune(ds.batch(batch_size))


def data_seed(run_seed: int, round_num: int,
              client: int) -> np.random.SeedSequence:
  """What keys client `client`'s data order, flips and input noise in a
  round: distinct for every (run seed, round, client).

  Clients below 1009 keep the integer key every run before 2026-12-05 used,
  (run_seed * 1 000 003 + round) * 1009 + client, so those runs' data
  draws do not change. That integer alone repeats from client 1009 on (client
  c + 1009 in round r would draw as client c in round r + 1); those clients
  take the key of client c mod 1009 with c // 1009 as NumPy's spawn key,
  which no plain integer key below 2**128 reaches (ours stay below 2**62).
  """
  block, position = divmod(client, 1_009)
  key = (run_seed * 1_000_003 + round_num) * 1_009 + position
  return np.random.SeedSequence(key, spawn_key=(block,) if block else ())


def without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """`dataset` with tf.data's autotuning off (the same elements in the same
  order: only the pipeline's threads and buffers change).

  A worker runs two clients at once on a two-core machine, one compute
  thread each. With autotuning on, on the Intel Xeon host, one GAN epoch
  alone on one CPU took 5.11 or 10.23 s of wall time for 4.6-6.4 s of CPU
  (with it off: wall = CPU), and a benchmark round of 2 + 2 epochs took
  41.2 and 40.7 s against 28.2 and 31.0 s with it off (docs/speed.md).
  The 5.11 s step matches the period of tf.data's autotuning
  thread after nine doublings from 10 ms, which an epoch's end appears to
  wait for: our reading, not traced. The maps' AUTOTUNE parallelism then
  falls back to a fixed one.
  """
  options = tf.data.Options()
  options.autotune.enabled = False
  return dataset.with_options(options)


class ClientDatasets(collections.abc.Sequence):
  """A list of per-client datasets whose items are built on first access
  (and kept); an item can be replaced, like a list's."""

  def __init__(self, size: int, build):
    self._size = size
    self._build = build
    self._items: dict[int, tf.data.Dataset] = {}

  def __len__(self) -> int:
    return self._size

  def _index(self, i) -> int:
    i = operator.index(i)
    if i < 0:
      i += self._size
    if not 0 <= i < self._size:
      raise IndexError(f'client {i} is not in [0, {self._size})')
    return i

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(self._size))]
    i = self._index(i)
    if i not in self._items:
      self._items[i] = self._build(i)
    return self._items[i]

  def __setitem__(self, i, dataset) -> None:
    self._items[self._index(i)] = dataset


def resize(images, image_size: int):
  """Float HWC or NHWC images resized to `image_size` squared, bilinearly,
  as the published code's torchvision `Resize` does on PIL images.

  Shrinking, PIL widens its bilinear filter by the scale factor, so that each
  output pixel averages the input it covers; here `antialias=True` does the
  same. Plain bilinear sampling would read only the 2 x 2 input pixels
  nearest each output pixel's centre: a 300-pixel photo (Office-Caltech10,
  DomainNet) brought to LeNet's 32 would skip most of its pixels and alias.
  Enlarging (FMNIST's and MNIST's 28 -> 32, USPS's 16 -> 32), the two
  filters are the same and plain bilinear is kept: the antialiased kernel computes it with other
  float rounding, which would change inputs that runs already used. Where
  the size is known only when the graph runs (TFDS images), the choice is a
  `tf.cond`.
  """
  size = (image_size, image_size)
  plain = lambda: tf.image.resize(images, size, method='bilinear')
  averaged = lambda: tf.image.resize(images, size, method='bilinear',
                                     antialias=True)
  height, width = images.shape[-3], images.shape[-2]
  if height is not None and width is not None:
    return averaged() if max(height, width) > image_size else plain()
  shape = tf.shape(images)
  return tf.cond(tf.maximum(shape[-3], shape[-2]) > image_size, averaged,
                 plain)


def resize_uint8(image, image_size: int):
  """A uint8 image `resize`d, rounded back to uint8 (what the loaders of
  stored images keep)."""
  x = resize(tf.cast(image, tf.float32), image_size)
  return tf.cast(tf.clip_by_value(tf.round(x), 0, 255), tf.uint8)


@graph_code.plain  # Each client's pipeline traces it: see graph_code.
def _prepare(image, image_size, mean, std):
  """uint8 HWC -> float32, resized to `image_size`, normalised."""
  x = tf.cast(image, tf.float32)
  if image.shape[0] != image_size or image.shape[1] != image_size:
    x = resize(x, image_size)
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


def prepare_images(images: np.ndarray, image_size: int,
                   mean: tuple[float, ...], std: tuple[float, ...]
                   ) -> np.ndarray:
  """uint8 NHWC images as the networks see them in evaluation (resized,
  normalised; no flip, no input noise): float32 NHWC."""
  ds = tf.data.Dataset.from_tensor_slices(as_nhwc(images)).map(
      lambda x: _prepare(x, image_size, mean, std)).batch(1000)
  return np.concatenate(list(ds.as_numpy_iterator()))
