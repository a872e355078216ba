"""Digit5 (non-IID by domain): MNIST-M, SVHN, SynDigits and USPS are the
four clients; MNIST is held out as FedDF's server data.

Each domain comes from an image folder
`<data_dir>/<domain>/{train_images,test_images}/<digit>/*.png` (domains
`mnistm`, `svhn`, `syn`, `usps`, `mnist`; digit folders `0`..`9`), or, for
the domains TFDS has (`svhn` as `svhn_cropped`, `mnist`), from TFDS when that
folder is absent. Per domain: `train_per_client` training images drawn at
random (2000 in the spec); the test split is halved into validation and test.
All images are RGB (grey domains are repeated over three channels) at
`image_size`, normalised with the ImageNet mean/std.
"""

import os

import numpy as np

from tasks import domain_split
from tasks import image_folder
from tasks import image_task
from tasks import tfds_loader
from tasks.cifar10 import IMAGENET_MEAN, IMAGENET_STD
from tasks.options import TaskOptions

DOMAINS = ('mnistm', 'svhn', 'syn', 'usps')
DATA_SOURCES = domain_split.FOLDER_ONLY
SERVER_DOMAIN = 'mnist'
TFDS_NAMES = {'svhn': 'svhn_cropped', 'mnist': 'mnist'}
CLASSES = [str(d) for d in range(10)]
LAYOUT = '<data_dir>/<domain>/{train_images,test_images}/<digit>/*.png'


def load_domain(domain: str, options: TaskOptions,
                parts: tuple[str, ...] = ('train', 'test')):
  """Per part ('train', 'test'), uint8 RGB arrays of one domain, from its
  folder or TFDS."""
  root = options.data_dir
  folder = os.path.join(root, domain) if root else None
  if folder and os.path.isdir(folder):
    return tuple(image_folder.load_class_folders(
        os.path.join(folder, f'{part}_images'), CLASSES, options.image_size,
        channels=3) for part in parts)
  where = f'folder {folder or "<data_dir>/" + domain!r} not found (expected '
  where += f'{LAYOUT}; pass --data_dir)'
  if domain not in TFDS_NAMES:
    raise FileNotFoundError(f'Digit5 domain {domain!r}: {where}, and TFDS '
                            f'has no {domain} dataset')
  try:
    return tuple(tfds_loader.load(TFDS_NAMES[domain], list(parts),
                                  image_size=options.image_size, channels=3))
  except FileNotFoundError as e:
    # The folder is what most users meant (e.g. `SVHN` for `svhn`).
    raise FileNotFoundError(f'Digit5 domain {domain!r}: {where}; nor is it '
                            f'in TFDS: {e}') from None


def build(options: TaskOptions) -> image_task.FederatedImageTask:
  domain_split.check_options(options, DOMAINS, 'digit5', DATA_SOURCES)
  if options.data_dir is None:
    # Without a root only the TFDS domains could load: say what is missing.
    missing = [d for d in DOMAINS if d not in TFDS_NAMES]
    raise FileNotFoundError(
        f'digit5 needs --data_dir: domains {missing} are read from image '
        f'folders laid out {LAYOUT}')
  image_folder.require_dir(options.data_dir, 'Digit5 root (--data_dir)')
  rng = np.random.default_rng(options.seed)
  splits = []
  for domain in DOMAINS:
    train, test = load_domain(domain, options)
    train = domain_split.sample(train, options.train_per_client, rng,
                                f'Digit5 domain {domain!r} training split')
    val, test = domain_split.split_fractions(test, (0.5, 0.5), rng)
    splits.append(image_task.ClientSplit(train, val, test))
  server = None
  if options.server_size:
    server_train, = load_domain(SERVER_DOMAIN, options, ('train',))
    server = domain_split.sample(server_train, options.server_size, rng,
                                 'Digit5 server domain mnist',
                                 flag='server_data_size')[0]
  return domain_split.build('digit5', DOMAINS, splits, options, 10,
                            IMAGENET_MEAN, IMAGENET_STD, server)
