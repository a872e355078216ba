"""Office-Caltech10 (non-IID by domain): Amazon, DSLR, Webcam and Caltech are
the four clients, from `<data_dir>/<domain>/<class>/*.jpg` (domains
`amazon`, `dslr`, `webcam`, `caltech`; the ten shared classes below). Each
domain is split 50/25/25 into train/validation/test with the run's seed.
Images are RGB at `image_size`, normalised with the ImageNet mean/std.
"""

from tasks import domain_split
from tasks import image_task
from tasks.cifar10 import IMAGENET_MEAN, IMAGENET_STD
from tasks.options import TaskOptions

DOMAINS = ('amazon', 'dslr', 'webcam', 'caltech')
DATA_SOURCES = domain_split.FOLDER_ONLY
CLASSES = ['back_pack', 'bike', 'calculator', 'headphones', 'keyboard',
           'laptop_computer', 'monitor', 'mouse', 'mug', 'projector']


def build(options: TaskOptions) -> image_task.FederatedImageTask:
  domain_split.check_options(options, DOMAINS, 'office_caltech10',
                             DATA_SOURCES)
  root = domain_split.folder_root(options, 'office_caltech10')
  load = domain_split.class_folder_loader(root, CLASSES, options,
                                          'office_caltech10')
  splits = domain_split.split_each_domain(DOMAINS, load, options)
  return domain_split.build('office_caltech10', DOMAINS, splits, options,
                            len(CLASSES), IMAGENET_MEAN, IMAGENET_STD)
