"""Tasks with one client per domain (Digit5, Office-Caltech10, DomainNet):
the domains' arrays become clients."""

from typing import Sequence

import os
from typing import Callable

import numpy as np

from tasks import image_folder
from tasks import image_task
from tasks.options import TaskOptions

# Office-Caltech10 and DomainNet: each domain split train/validation/test.
FRACTIONS = (0.5, 0.25, 0.25)
FOLDER_LAYOUT = '<data_dir>/<domain>/<class>/*.jpg'

Arrays = tuple[np.ndarray, np.ndarray]


# Where a domain task's images come from unless it says otherwise.
FOLDER_ONLY = ('folder',)


def check_options(options: TaskOptions, domains: Sequence[str],
                      task: str, sources: Sequence[str] = FOLDER_ONLY) -> None:
  """Flags that a domain task does not take are errors, not ignored."""
  if options.data_source not in (None, *sources):
    raise ValueError(f'data_source must be one of {tuple(sources)} for '
                     f'{task}, got {options.data_source!r}')
  if options.num_clients not in (None, len(domains)):
    raise ValueError(
        f'{task} has one client per domain ({", ".join(domains)}): '
        f'num_clients must be {len(domains)} or unset, got '
        f'{options.num_clients}')
  if options.partition != 'iid':
    raise ValueError(f'{task} is split by domain; partition '
                     f'{options.partition!r} applies to fmnist and cifar10')


def folder_root(options: TaskOptions, task: str, hint: str = '') -> str:
  """The image-folder root of `task`, which must exist."""
  if options.data_dir is None:
    raise FileNotFoundError(f'{task} needs --data_dir: a folder laid out '
                            f'{FOLDER_LAYOUT}{hint}')
  return image_folder.require_dir(options.data_dir, f'{task} root (--data_dir)')


def class_folder_loader(root: str, classes: list[str], options: TaskOptions,
                        task: str) -> Callable[[str], Arrays]:
  """domain -> arrays of `<root>/<domain>/<class>/*` (RGB, `image_size`)."""

  def load(domain: str) -> Arrays:
    directory = image_folder.require_dir(os.path.join(root, domain),
                                         f'{task} domain {domain!r}')
    return image_folder.load_class_folders(directory, classes,
                                           options.image_size, channels=3)

  return load


def split_each_domain(domains: Sequence[str], load: Callable[[str], Arrays],
                      options: TaskOptions) -> list[image_task.ClientSplit]:
  """Each domain's arrays split 50/25/25 with the run's seed."""
  rng = np.random.default_rng(options.seed)
  return [image_task.ClientSplit(*split_fractions(load(d), FRACTIONS, rng))
          for d in domains]


def split_fractions(arrays: Arrays, fractions: Sequence[float],
                    rng: np.random.Generator) -> list[Arrays]:
  """`arrays` shuffled and cut into consecutive parts of these fractions."""
  order = rng.permutation(len(arrays[1]))
  cuts = (np.cumsum(fractions)[:-1] * len(order)).round().astype(int)
  return [image_task.take(arrays, part) for part in np.split(order, cuts)]


def sample(arrays: Arrays, count: int, rng: np.random.Generator,
           what: str, flag: str = 'train_per_client') -> Arrays:
  """`count` examples drawn at random without replacement; `flag` is the
  flag that asked for them, named if there are too few."""
  if count > len(arrays[1]):
    raise ValueError(f'{what} has {len(arrays[1])} examples, fewer than the '
                     f'{count} requested ({flag})')
  return image_task.take(arrays, rng.permutation(len(arrays[1]))[:count])


def build(name: str, domains: Sequence[str],
          splits: Sequence[image_task.ClientSplit], options: TaskOptions,
          num_classes: int, mean, std,
          server_images: np.ndarray | None = None
          ) -> image_task.FederatedImageTask:
  """One client per domain, with the optional per-client input noise."""
  for domain, split in zip(domains, splits):
    for part, (_, labels) in zip(('train', 'validation', 'test'),
                                 (split.train, split.val, split.test)):
      if not len(labels):
        raise ValueError(f'{name} domain {domain!r} has no {part} example')
      bad = labels[(labels < 0) | (labels >= num_classes)]
      if len(bad):
        raise ValueError(f'{name} domain {domain!r}: label {int(bad[0])} '
                         f'outside [0, {num_classes})')
  channels = splits[0].train[0].shape[-1]
  return image_task.FederatedImageTask(
      name=name, clients=tuple(splits), num_classes=num_classes,
      channels=channels, seed=options.seed, mean=tuple(mean), std=tuple(std),
      client_names=tuple(domains),
      noise_stds=(image_task.noise_stds(len(domains), options.noise_std)
                  if options.add_noise else ()),
      server_images=server_images)
