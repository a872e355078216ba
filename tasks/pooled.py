"""Tasks whose clients are drawn from one labelled dataset (FMNIST,
CIFAR-10, feature-shifted FMNIST): IID or Dirichlet label skew, with the
spec's validation/test protocol and FedDF's disjoint server slice."""

from typing import Callable, Sequence

import numpy as np

from tasks import image_task
from tasks import partition
from tasks.options import TaskOptions

Arrays = tuple[np.ndarray, np.ndarray]


def build(name: str, train: Arrays, test: Arrays, options: TaskOptions,
          num_classes: int, mean: Sequence[float], std: Sequence[float],
          default_clients: int = 4,
          client_transforms: Sequence[Callable[[np.ndarray], np.ndarray]]
          | None = None,
          client_names: Sequence[str] = ()) -> image_task.FederatedImageTask:
  """Partitions (train, test) uint8 arrays among the clients.

  `client_transforms[i]`, if given, maps client i's uint8 images (all three
  splits) to the images that client sees: a fixed feature shift.
  """
  num_clients = options.num_clients or default_clients
  if num_clients < 1:
    raise ValueError(f'num_clients must be >= 1, got {num_clients}')
  train = (image_task.as_nhwc(train[0]), np.asarray(train[1], np.int32))
  test = (image_task.as_nhwc(test[0]), np.asarray(test[1], np.int32))
  for split, (_, labels) in (('train', train), ('test', test)):
    bad = labels[(labels < 0) | (labels >= num_classes)]
    if len(bad):
      raise ValueError(f'{name} {split} split has label {int(bad[0])} outside '
                       f'[0, {num_classes})')
  rng = np.random.default_rng(options.seed)
  if options.partition == 'iid':
    indices, server = partition.iid(
        len(train[1]), len(test[1]), num_clients, options.train_per_client,
        rng, options.server_size)
  elif options.partition == 'dirichlet':
    indices, server = partition.dirichlet(
        train[1], test[1], num_clients, options.train_per_client,
        options.dirichlet_alpha, rng, options.server_size)
  else:
    raise ValueError(f'partition must be one of {partition.PARTITIONS}, '
                     f'got {options.partition!r}')
  clients = []
  for i, idx in enumerate(indices):
    shift = client_transforms[i] if client_transforms else (lambda x: x)
    clients.append(image_task.ClientSplit(
        *(_shifted(image_task.take(split, part), shift)
          for split, part in ((train, idx.train), (test, idx.val),
                              (test, idx.test)))))
  return image_task.FederatedImageTask(
      name=name, clients=tuple(clients), num_classes=num_classes,
      channels=train[0].shape[-1], seed=options.seed, mean=tuple(mean),
      std=tuple(std), client_names=tuple(client_names),
      noise_stds=(image_task.noise_stds(num_clients, options.noise_std)
                  if options.add_noise else ()),
      server_images=train[0][server] if options.server_size else None,
      server_labels=train[1][server] if options.server_size else None)


def _shifted(arrays: Arrays, shift) -> Arrays:
  images, labels = arrays
  return shift(images), labels
