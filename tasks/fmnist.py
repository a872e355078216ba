"""Fashion-MNIST, 4 IID clients (FEDCG_SPEC.md, Data protocol).

Reads the four original IDX files (gzip or not) from a directory — by default
where Debian's `dataset-fashion-mnist` package puts them — or, with
`source='tfds'`, loads `fashion_mnist` through TensorFlow Datasets (which
downloads it where the network allows).
"""

import gzip
import os

import numpy as np

from tasks import image_task

DEBIAN_DIR = '/usr/share/datasets/fashion-mnist'
MEAN, STD = (0.5,), (0.5,)
NUM_CLASSES = 10
# FedDF's unlabeled server images in the spec's FMNIST protocol.
SERVER_SIZE = 32_000
_FILES = {
    'train_images': 'train-images-idx3-ubyte',
    'train_labels': 'train-labels-idx1-ubyte',
    'test_images': 't10k-images-idx3-ubyte',
    'test_labels': 't10k-labels-idx1-ubyte',
}


def read_idx(path: str) -> np.ndarray:
  """Reads an IDX file (optionally gzip-compressed) into a numpy array."""
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'rb') as f:
    data = f.read()
  if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
    raise ValueError(f'{path}: not an IDX file of unsigned bytes')
  ndim = data[3]
  header = 4 + 4 * ndim
  if len(data) < header:
    raise ValueError(f'{path}: truncated IDX header')
  shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], 'big')
                for i in range(ndim))
  expected = int(np.prod(shape))
  if len(data) - header != expected:
    raise ValueError(f'{path}: header announces {expected} bytes of data for '
                     f'shape {shape}, file has {len(data) - header}')
  return np.frombuffer(data, np.uint8, offset=header).reshape(shape)


def _find(data_dir: str, stem: str) -> str:
  for name in (stem + '.gz', stem):
    path = os.path.join(data_dir, name)
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(
      f'{stem}[.gz] not found in {data_dir!r}: install Debian\'s '
      '`dataset-fashion-mnist` package, point --data_dir at the four IDX '
      'files, or use --data_source=tfds')


def load_idx(data_dir: str = DEBIAN_DIR):
  """((train_images, train_labels), (test_images, test_labels)) as uint8."""
  arrays = {k: read_idx(_find(data_dir, v)) for k, v in _FILES.items()}
  for split in ('train', 'test'):
    n_img, n_lab = len(arrays[f'{split}_images']), len(arrays[f'{split}_labels'])
    if n_img != n_lab:
      raise ValueError(f'{data_dir}: {split} has {n_img} images but '
                       f'{n_lab} labels')
  return ((arrays['train_images'], arrays['train_labels']),
          (arrays['test_images'], arrays['test_labels']))


def load_tfds(data_dir=None):
  """The same arrays from TensorFlow Datasets' `fashion_mnist`."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  splits = tfds.load('fashion_mnist', split=['train', 'test'],
                     as_supervised=True, data_dir=data_dir)
  # Batched reads, not `batch_size=-1`: with TF 2.14 that aborts the
  # process under `tfds.testing.mock_data`.
  return tuple(_to_arrays(ds) for ds in splits)


def _to_arrays(dataset):
  batches = list(dataset.batch(10_000).as_numpy_iterator())
  return (np.concatenate([b[0] for b in batches]),
          np.concatenate([b[1] for b in batches]))


def build_task(num_clients: int = 4,
               train_per_client: int = 2000,
               seed: int = 1,
               source: str = 'idx',
               data_dir: str | None = None,
               server_size: int = 0) -> image_task.FederatedImageTask:
  """The FMNIST task: same seed, same partition. `server_size` unlabeled
  training images, disjoint from the clients', go to the server (FedDF's
  data; the spec's protocol uses 32 000)."""
  if source == 'idx':
    train, test = load_idx(data_dir or DEBIAN_DIR)
  elif source == 'tfds':
    train, test = load_tfds(data_dir)
  else:
    raise ValueError(f"source must be 'idx' or 'tfds', got {source!r}")
  rng = np.random.default_rng(seed)
  splits, server = image_task.iid_split(train, test, num_clients,
                                        train_per_client, rng, server_size)
  prep = lambda xy: (image_task.preprocess(xy[0], MEAN, STD), xy[1])
  clients = tuple(
      image_task.ClientSplit(prep(s.train), prep(s.val), prep(s.test))
      for s in splits)
  return image_task.FederatedImageTask(
      name='fmnist', clients=clients, num_classes=NUM_CLASSES, channels=1,
      seed=seed,
      server_images=(image_task.preprocess(server, MEAN, STD)
                     if server_size else None))
