"""Small Fashion-MNIST-shaped IDX files for tests (no real data needed)."""

import gzip
import os

import numpy as np


def write_idx(path, array, compress=True):
  """Writes `array` as an IDX file of unsigned bytes (`path[.gz]`)."""
  header = bytes([0, 0, 0x08, array.ndim]) + b''.join(
      int(d).to_bytes(4, 'big') for d in array.shape)
  data = header + array.astype(np.uint8).tobytes()
  opener = gzip.open if compress else open
  with opener(path + ('.gz' if compress else ''), 'wb') as f:
    f.write(data)


def write_fake_fmnist(directory, n_train=120, n_test=40, compress=True):
  """The four FMNIST IDX files with random images; returns the arrays."""
  rng = np.random.default_rng(0)
  arrays = {
      'train-images-idx3-ubyte': rng.integers(0, 256, (n_train, 28, 28)),
      'train-labels-idx1-ubyte': np.arange(n_train) % 10,
      't10k-images-idx3-ubyte': rng.integers(0, 256, (n_test, 28, 28)),
      't10k-labels-idx1-ubyte': np.arange(n_test) % 10,
  }
  for name, array in arrays.items():
    write_idx(os.path.join(directory, name), array, compress)
  return arrays
