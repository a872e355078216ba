"""Fashion-MNIST, 4 clients, IID or label-skewed (FEDCG_SPEC.md, Data
protocol).

Reads the four original IDX files (gzip or not) from a directory — by default
where Debian's `dataset-fashion-mnist` package puts them — or, with
`source='tfds'`, loads `fashion_mnist` through TensorFlow Datasets (which
downloads it where the network allows).
"""

import gzip
import os
import zlib

import numpy as np

from tasks import image_folder
from tasks import image_task
from tasks import pooled
from tasks import tfds_loader
from tasks.options import TaskOptions

DEBIAN_DIR = '/usr/share/datasets/fashion-mnist'
MEAN, STD = (0.5,), (0.5,)
NUM_CLASSES = 10
# FedDF's unlabeled server images by default (a disjoint training slice).
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
  try:
    with opener(path, 'rb') as f:
      data = f.read()
  # gzip.BadGzipFile is an OSError; a corrupt stream raises zlib.error.
  except (OSError, EOFError, zlib.error) as e:
    kind = 'zlib.error' if isinstance(e, zlib.error) else type(e).__name__
    raise ValueError(f'{path}: unreadable ({kind}: {e})') from None
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
  image_folder.refuse_if_blocked(os.path.join(data_dir, stem), 'IDX file')
  raise FileNotFoundError(
      f'{stem}[.gz] not found in {data_dir!r}: install Debian\'s '
      '`dataset-fashion-mnist` package, point --data_dir at the four IDX '
      'files, or use --data_source=tfds')


def load_idx(data_dir: str = DEBIAN_DIR):
  """((train_images, train_labels), (test_images, test_labels)) as uint8."""
  paths = {k: _find(data_dir, v) for k, v in _FILES.items()}
  arrays = {k: read_idx(p) for k, p in paths.items()}
  for key, array in arrays.items():
    expected = 3 if key.endswith('images') else 1
    if array.ndim != expected:
      raise ValueError(f'{paths[key]}: expected {expected} dimension(s) '
                       f'({"[n, height, width]" if expected == 3 else "[n]"}),'
                       f' found shape {array.shape}')
  for split in ('train', 'test'):
    n_img, n_lab = len(arrays[f'{split}_images']), len(arrays[f'{split}_labels'])
    if n_img != n_lab:
      raise ValueError(f'{data_dir}: {split} has {n_img} images but '
                       f'{n_lab} labels')
  return ((arrays['train_images'], arrays['train_labels']),
          (arrays['test_images'], arrays['test_labels']))


def load_tfds(data_dir=None):
  """The same arrays from TensorFlow Datasets' `fashion_mnist`."""
  return tuple(tfds_loader.load('fashion_mnist', ['train', 'test'], data_dir))


# Where FMNIST can come from; the first is the default.
DATA_SOURCES = ('idx', 'tfds')


def load(options: TaskOptions):
  """(train, test) uint8 arrays from the source the options name."""
  source = options.data_source or DATA_SOURCES[0]
  if source == 'idx':
    return load_idx(options.data_dir or DEBIAN_DIR)
  if source == 'tfds':
    return load_tfds(options.data_dir)
  raise ValueError(f"data_source must be 'idx' or 'tfds' for FMNIST, "
                   f'got {source!r}')


def build(options: TaskOptions) -> image_task.FederatedImageTask:
  """The FMNIST task: same seed, same partition. With `server_size`,
  unlabeled training images disjoint from the clients' go to the server
  (FedDF's data; 32 000 by default in the binary)."""
  train, test = load(options)
  return pooled.build('fmnist', train, test, options, NUM_CLASSES, MEAN, STD)
