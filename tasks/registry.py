"""Every task by name. Adding a task is adding a module with
`build(TaskOptions) -> FederatedImageTask` and `DATA_SOURCES` (the
`--data_source` values it reads, its default first) and a line here."""

from tasks import cifar10
from tasks import digit5
from tasks import domainnet
from tasks import fmnist
from tasks import fmnist_shift
from tasks import image_task
from tasks import office_caltech10
from tasks.options import TaskOptions

_MODULES = {
    'fmnist': fmnist,
    'fmnist_shift': fmnist_shift,
    'cifar10': cifar10,
    'digit5': digit5,
    'office_caltech10': office_caltech10,
    'domainnet': domainnet,
}
TASKS = {name: module.build for name, module in _MODULES.items()}
DATA_SOURCES = {name: module.DATA_SOURCES for name, module in _MODULES.items()}

# FedDF's unlabeled server images by default, per task (0: the task has no
# server data in the spec's protocol).
DEFAULT_SERVER_SIZE = {'fmnist': fmnist.SERVER_SIZE,
                       'fmnist_shift': fmnist.SERVER_SIZE,
                       'cifar10': 32_000, 'digit5': 10_000,
                       'office_caltech10': 0, 'domainnet': 0}


def data_source(name: str, data_source_flag: str | None) -> str:
  """The source a task reads with `--data_source` set to the flag's value
  (None: the task's default)."""
  return data_source_flag or DATA_SOURCES[name][0]


def build(name: str, options: TaskOptions) -> image_task.FederatedImageTask:
  if name not in TASKS:
    raise ValueError(f'task must be one of {tuple(TASKS)}, got {name!r}')
  return TASKS[name](options)
