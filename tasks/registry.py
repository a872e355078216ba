"""Every task by name. Adding a task is adding a module with
`build(TaskOptions) -> FederatedImageTask` and a line here."""

from tasks import cifar10
from tasks import digit5
from tasks import domain_split
from tasks import domainnet
from tasks import fmnist
from tasks import fmnist_shift
from tasks import image_task
from tasks import office_caltech10
from tasks.options import TaskOptions

TASKS = {
    'fmnist': fmnist.build,
    'fmnist_shift': fmnist_shift.build,
    'cifar10': cifar10.build,
    'digit5': digit5.build,
    'office_caltech10': office_caltech10.build,
    'domainnet': domainnet.build,
}

# FedDF's unlabeled server images by default, per task (0: the task has no
# server data in the spec's protocol).
DEFAULT_SERVER_SIZE = {'fmnist': fmnist.SERVER_SIZE,
                       'fmnist_shift': fmnist.SERVER_SIZE,
                       'cifar10': 32_000, 'digit5': 10_000,
                       'office_caltech10': 0, 'domainnet': 0}


# Each task's data sources (`--data_source`), its default first.
DATA_SOURCES = {'fmnist': fmnist.DATA_SOURCES,
                'fmnist_shift': fmnist.DATA_SOURCES,
                'cifar10': cifar10.DATA_SOURCES,
                'digit5': domain_split.FOLDER_ONLY,
                'office_caltech10': domain_split.FOLDER_ONLY,
                'domainnet': domainnet.DATA_SOURCES}


def data_source(name: str, data_source_flag: str | None) -> str:
  """The source a task reads with `--data_source` set to the flag's value
  (None: the task's default)."""
  return data_source_flag or DATA_SOURCES[name][0]


def build(name: str, options: TaskOptions) -> image_task.FederatedImageTask:
  if name not in TASKS:
    raise ValueError(f'task must be one of {tuple(TASKS)}, got {name!r}')
  return TASKS[name](options)
