"""DomainNet, ten-class subset (non-IID by domain): clipart, infograph,
quickdraw, real and sketch are the five clients. From image folders
`<data_dir>/<domain>/<class>/*.jpg` or, with --data_source=tfds, from TFDS's
`domainnet/<domain>` (its train and test splits pooled, restricted to the
ten classes). Each domain is split 50/25/25 into train/validation/test with
the run's seed; images RGB at `image_size`, ImageNet mean/std.
"""

import numpy as np

from tasks import domain_split
from tasks import image_task
from tasks import tfds_loader
from tasks.cifar10 import IMAGENET_MEAN, IMAGENET_STD
from tasks.options import TaskOptions

DOMAINS = ('clipart', 'infograph', 'quickdraw', 'real', 'sketch')
# Where DomainNet can come from; the first is the default.
DATA_SOURCES = ('folder', 'tfds')
# The ten-class subset used for DomainNet in FedBN and FedCG.
CLASSES = ['bird', 'feather', 'headphones', 'ice_cream', 'teapot', 'tiger',
           'whale', 'windmill', 'wine_glass', 'zebra']


def _from_tfds(domain: str, options: TaskOptions):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  name = f'domainnet/{domain}'
  names = tfds.builder(name, data_dir=options.data_dir).info.features[
      'label'].names
  missing = [c for c in CLASSES if c not in names]
  if missing:
    raise ValueError(f'TFDS {name} lacks the classes {missing}')
  remap = np.full(len(names), -1, np.int32)
  for new, c in enumerate(CLASSES):
    remap[names.index(c)] = new
  parts = tfds_loader.load(name, ['train', 'test'], options.data_dir,
                           image_size=options.image_size, channels=3,
                           keep_labels=[names.index(c) for c in CLASSES])
  images = np.concatenate([p[0] for p in parts])
  labels = remap[np.concatenate([p[1] for p in parts])]
  keep = labels >= 0
  return images[keep], labels[keep]


def build(options: TaskOptions) -> image_task.FederatedImageTask:
  domain_split.check_options(options, DOMAINS, 'domainnet',
                                 sources=DATA_SOURCES)
  source = options.data_source or DATA_SOURCES[0]
  if source == 'tfds':
    load = lambda domain: _from_tfds(domain, options)
  else:
    root = domain_split.folder_root(options, 'domainnet',
                                    ' (or use --data_source=tfds)')
    load = domain_split.class_folder_loader(root, CLASSES, options,
                                            'domainnet')
  splits = domain_split.split_each_domain(DOMAINS, load, options)
  return domain_split.build('domainnet', DOMAINS, splits, options,
                            len(CLASSES), IMAGENET_MEAN, IMAGENET_STD)
