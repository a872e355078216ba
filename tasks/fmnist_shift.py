"""Feature-shifted Fashion-MNIST: a non-IID task that runs offline.

The paper's non-IID columns (Digit5, Office-Caltech10, DomainNet) differ by
domain: every client sees the same classes drawn differently. Those datasets
cannot be downloaded here, so this task makes domains out of the real
Fashion-MNIST that Debian ships: client i sees all of its images (train,
validation and test) through its own fixed transformation, in this order:

  rotate     rotated 90 degrees
  invert     255 - x
  blur       Gaussian blur, sigma 1.5 pixels
  noise      fixed additive Gaussian noise, std 40 grey levels (per image)
  contrast   contrast reduced to 40% around mid-grey

(cycling for more than five clients). The partition is the FMNIST one (IID
labels, or Dirichlet with --partition), so only the input domain differs.
"""

import numpy as np
from scipy import ndimage

from tasks import fmnist
from tasks import image_task
from tasks import pooled
from tasks.options import TaskOptions

SHIFTS = ('rotate', 'invert', 'blur', 'noise', 'contrast')
DATA_SOURCES = fmnist.DATA_SOURCES  # Its images are FMNIST's.


def shift(kind: str, images: np.ndarray, seed: int) -> np.ndarray:
  """uint8 NHWC images as a client with shift `kind` sees them."""
  x = images.astype(np.float32)
  if kind == 'rotate':
    x = np.rot90(x, k=1, axes=(1, 2))
  elif kind == 'invert':
    x = 255.0 - x
  elif kind == 'blur':
    x = ndimage.gaussian_filter(x, sigma=(0, 1.5, 1.5, 0))
  elif kind == 'noise':
    x = x + np.random.default_rng(seed).normal(0.0, 40.0, x.shape)
  elif kind == 'contrast':
    x = 127.5 + 0.4 * (x - 127.5)
  else:
    raise ValueError(f'unknown shift {kind!r}; known: {SHIFTS}')
  return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def build(options: TaskOptions) -> image_task.FederatedImageTask:
  train, test = fmnist.load(options)
  num_clients = options.num_clients or 4
  kinds = [SHIFTS[i % len(SHIFTS)] for i in range(num_clients)]
  transforms = [
      (lambda x, k=k, i=i: shift(k, x, options.seed * 7919 + i))
      for i, k in enumerate(kinds)]
  return pooled.build('fmnist_shift', train, test, options,
                      fmnist.NUM_CLASSES, fmnist.MEAN, fmnist.STD,
                      default_clients=4, client_transforms=transforms,
                      client_names=[f'client_{i}_{k}'
                                    for i, k in enumerate(kinds)])
