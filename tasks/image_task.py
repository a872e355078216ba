"""A federated image-classification task: client splits and their pipelines.

Arrays are preprocessed once (resize, normalise) and kept in memory; each
round asks for fresh training datasets whose shuffling and random flips are
seeded by (task seed, round, client), so a run is reproducible and every
round sees a different order and set of flips.
"""

import dataclasses

import numpy as np
import tensorflow as tf

EVAL_BATCH_SIZE = 500


@dataclasses.dataclass(frozen=True)
class ClientSplit:
  """One client's preprocessed arrays: images NHWC float32, labels int32."""
  train: tuple[np.ndarray, np.ndarray]
  val: tuple[np.ndarray, np.ndarray]
  test: tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass(frozen=True)
class FederatedImageTask:
  name: str
  clients: tuple[ClientSplit, ...]
  num_classes: int
  channels: int
  seed: int
  # Unlabeled server images (float32 NHWC, preprocessed) for FedDF's
  # distillation, disjoint from every client's data; None if not drawn.
  server_images: np.ndarray | None = None

  @property
  def num_clients(self) -> int:
    return len(self.clients)

  def train_datasets(self, round_num: int,
                     batch_size: int) -> list[tf.data.Dataset]:
    """Per client: shuffled, randomly flipped training batches for a round.

    Each pass over a dataset (one local epoch) reshuffles and redraws flips.
    """
    return [
        _train_pipeline(c.train, batch_size,
                        seed=(self.seed * 1_000_003 + round_num) * 1_009 + i)
        for i, c in enumerate(self.clients)
    ]

  def val_datasets(self) -> list[tf.data.Dataset]:
    return [_eval_pipeline(c.val) for c in self.clients]

  def test_datasets(self) -> list[tf.data.Dataset]:
    return [_eval_pipeline(c.test) for c in self.clients]


def _train_pipeline(arrays, batch_size, seed):
  images, labels = arrays
  # Separate seeds for the order and the flips: with one seed the two
  # streams coincide and whether an image is flipped depends on its index.
  shuffle_seed, flip_seed = (
      int(s) for s in np.random.SeedSequence(seed).generate_state(2) >> 1)
  ds = tf.data.Dataset.from_tensor_slices((images, labels))
  ds = ds.shuffle(len(labels), seed=shuffle_seed,
                  reshuffle_each_iteration=True)
  flips = tf.data.Dataset.random(seed=flip_seed,
                                 rerandomize_each_iteration=True)
  ds = tf.data.Dataset.zip((ds, flips)).map(
      _flip, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  return ds.batch(batch_size)


def _flip(example, draw):
  image, label = example
  flip = tf.equal(tf.math.floormod(draw, 2), 1)
  image = tf.cond(flip, lambda: tf.reverse(image, axis=[1]), lambda: image)
  return image, label


def _eval_pipeline(arrays):
  return tf.data.Dataset.from_tensor_slices(arrays).batch(EVAL_BATCH_SIZE)


def preprocess(images: np.ndarray, mean, std, size: int = 32) -> np.ndarray:
  """uint8 NHWC (or NHW) images -> float32 NHWC, resized and normalised."""
  if images.ndim == 3:
    images = images[..., None]
  out = []
  for start in range(0, len(images), 10_000):  # Bounded memory for big sets.
    chunk = tf.convert_to_tensor(images[start:start + 10_000], tf.float32)
    if chunk.shape[1:3] != (size, size):
      chunk = tf.image.resize(chunk, (size, size), method='bilinear')
    out.append(chunk.numpy() / 255.0)
  x = np.concatenate(out) if out else np.zeros((0, size, size, images.shape[-1]))
  mean = np.asarray(mean, np.float32).reshape(1, 1, 1, -1)
  std = np.asarray(std, np.float32).reshape(1, 1, 1, -1)
  return ((x - mean) / std).astype(np.float32)


def iid_split(train: tuple[np.ndarray, np.ndarray],
              test: tuple[np.ndarray, np.ndarray],
              num_clients: int,
              train_per_client: int,
              rng: np.random.Generator,
              server_size: int = 0) -> tuple[list[ClientSplit], np.ndarray]:
  """The spec's IID protocol, plus FedDF's unlabeled server data.

  Each client gets `train_per_client` training examples drawn at random
  (disjoint between clients); the test split is shuffled and cut into
  `2 * num_clients` equal parts: client i validates on part i and tests on
  part `num_clients + i`. The next `server_size` examples of the same
  random order of the training split (so disjoint from every client's) are
  returned as the server's images, without labels.
  """
  x_train, y_train = train
  x_test, y_test = test
  needed = num_clients * train_per_client
  if needed + server_size > len(y_train):
    raise ValueError(
        f'{num_clients} clients x {train_per_client} training examples'
        f'{f" + {server_size} server examples" if server_size else ""} need '
        f'{needed + server_size}, but the training split has {len(y_train)}')
  parts = 2 * num_clients
  if len(y_test) < parts:
    raise ValueError(f'the test split has {len(y_test)} examples, fewer than '
                     f'the {parts} validation/test parts')
  permutation = rng.permutation(len(y_train))
  order = permutation[:needed]
  server = permutation[needed:needed + server_size]
  test_order = rng.permutation(len(y_test))
  part = len(y_test) // parts
  clients = []
  for i in range(num_clients):
    tr = order[i * train_per_client:(i + 1) * train_per_client]
    va = test_order[i * part:(i + 1) * part]
    te = test_order[(num_clients + i) * part:(num_clients + i + 1) * part]
    clients.append(ClientSplit(
        train=(x_train[tr], y_train[tr].astype(np.int32)),
        val=(x_test[va], y_test[va].astype(np.int32)),
        test=(x_test[te], y_test[te].astype(np.int32))))
  return clients, x_train[server]
