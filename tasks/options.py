"""The options every task builder takes (the binaries' task flags)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class TaskOptions:
  """How to build a task. Field names are the binaries' flag names."""
  # None: the task's own number (4 for FMNIST and CIFAR-10; one client per
  # domain for Digit5, Office-Caltech10 and DomainNet).
  num_clients: int | None = None
  train_per_client: int = 2000
  seed: int = 1
  # Where the data is: IDX directory (FMNIST), image-folder root (Digit5,
  # Office, DomainNet) or TFDS data_dir, depending on the task and source.
  data_dir: str | None = None
  # 'idx' / 'folder' / 'tfds'; None: the task's default.
  data_source: str | None = None
  partition: str = 'iid'  # Label-pool tasks only: 'iid' or 'dirichlet'.
  dirichlet_alpha: float = 0.5
  server_size: int = 0  # FedDF's unlabeled server images (0: none).
  add_noise: bool = False
  noise_std: float = 0.0  # Client i gets noise_std * i / (n - 1).
  # Side of the square images kept in memory: the network's input size
  # (32 for LeNet, 224 for ResNet-18) for tasks read from image files.
  image_size: int = 32
