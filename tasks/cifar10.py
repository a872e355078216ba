"""CIFAR-10 from TFDS (`cifar10`), 4 or 8 clients (--num_clients), IID or
label-skewed, normalised with the ImageNet mean/std as in the spec."""

from tasks import image_task
from tasks import pooled
from tasks import tfds_loader
from tasks.options import TaskOptions

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
NUM_CLASSES = 10
DATA_SOURCES = ('tfds',)


def build(options: TaskOptions) -> image_task.FederatedImageTask:
  if options.data_source not in (None, *DATA_SOURCES):
    raise ValueError(f"data_source must be 'tfds' for CIFAR-10, got "
                     f'{options.data_source!r}')
  train, test = tfds_loader.load('cifar10', ['train', 'test'],
                                 options.data_dir)
  return pooled.build('cifar10', train, test, options, NUM_CLASSES,
                      IMAGENET_MEAN, IMAGENET_STD, default_clients=4)
