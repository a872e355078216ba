"""Client partitions of a labelled pool: the spec's IID protocol and
Dirichlet label skew.

Both return, per client, index arrays into the training and the test split
(train, validation, test); the task module turns indices into arrays.
"""

import dataclasses

import numpy as np

PARTITIONS = ('iid', 'dirichlet')


@dataclasses.dataclass(frozen=True)
class ClientIndices:
  train: np.ndarray
  val: np.ndarray
  test: np.ndarray


def iid(num_train: int, num_test: int, num_clients: int,
        train_per_client: int, rng: np.random.Generator,
        server_size: int = 0) -> tuple[list[ClientIndices], np.ndarray]:
  """The spec's IID protocol, plus FedDF's unlabeled server slice.

  Each client gets `train_per_client` training examples drawn at random
  (disjoint between clients); the test split is shuffled and cut into
  `2 * num_clients` equal parts: client i validates on part i and tests on
  part `num_clients + i`. The next `server_size` examples of the same
  random order of the training split (so disjoint from every client's) are
  the server's. Returns the clients' indices and the server's.
  """
  needed = num_clients * train_per_client
  _check_pool(num_clients, train_per_client, server_size, num_train)
  parts = 2 * num_clients
  if num_test < parts:
    raise ValueError(f'the test split has {num_test} examples, fewer than '
                     f'the {parts} validation/test parts')
  permutation = rng.permutation(num_train)
  order = permutation[:needed]
  server = permutation[needed:needed + server_size]
  test_order = rng.permutation(num_test)
  part = num_test // parts
  clients = []
  for i in range(num_clients):
    clients.append(ClientIndices(
        train=order[i * train_per_client:(i + 1) * train_per_client],
        val=test_order[i * part:(i + 1) * part],
        test=test_order[(num_clients + i) * part:(num_clients + i + 1) * part]))
  return clients, server


def dirichlet(train_labels: np.ndarray, test_labels: np.ndarray,
              num_clients: int, train_per_client: int, alpha: float,
              rng: np.random.Generator, server_size: int = 0
              ) -> tuple[list[ClientIndices], np.ndarray]:
  """Label skew: each class is shared among the clients in proportions drawn
  from Dirichlet(alpha) (smaller alpha, more skew).

  A pool of `num_clients * train_per_client` training examples is drawn at
  random (the server slice, as in `iid`, comes after it); each class of the
  pool is split among the clients by that class's proportions, so client
  sizes vary around `train_per_client` and sum to the pool. Each class of
  the test split is split by the same proportions, half to validation and
  half to test, so a client is evaluated on its own label distribution.
  """
  if not alpha >= MIN_DIRICHLET_ALPHA:
    raise ValueError(f'dirichlet_alpha must be >= {MIN_DIRICHLET_ALPHA:g}, '
                     f'got {alpha}')
  num_train, num_test = len(train_labels), len(test_labels)
  _check_pool(num_clients, train_per_client, server_size, num_train)
  needed = num_clients * train_per_client
  permutation = rng.permutation(num_train)
  pool, server = permutation[:needed], permutation[needed:needed + server_size]
  classes = np.unique(np.concatenate([train_labels[pool], test_labels]))
  proportions = rng.dirichlet(np.full(num_clients, alpha), size=len(classes))
  train = [[] for _ in range(num_clients)]
  val = [[] for _ in range(num_clients)]
  test = [[] for _ in range(num_clients)]
  test_order = rng.permutation(num_test)
  for c, p in zip(classes, proportions):
    for i, part in enumerate(_split(pool[train_labels[pool] == c], p)):
      train[i].append(part)
    in_class = test_order[test_labels[test_order] == c]
    half = len(in_class) // 2
    for i, part in enumerate(_split(in_class[:half], p)):
      val[i].append(part)
    for i, part in enumerate(_split(in_class[half:], p)):
      test[i].append(part)
  join = lambda parts: rng.permutation(np.concatenate(parts)).astype(np.int64)
  clients = [ClientIndices(join(train[i]), join(val[i]), join(test[i]))
             for i in range(num_clients)]
  for i, c in enumerate(clients):
    if not len(c.train):
      raise ValueError(
          f'client {i} drew no training example (dirichlet_alpha={alpha} '
          'is too small for this pool); raise --dirichlet_alpha or '
          '--train_per_client')
    # Its accuracy would read 0 and pull down the mean over clients.
    for part, indices in (('validation', c.val), ('test', c.test)):
      if not len(indices):
        raise ValueError(
            f'client {i} drew {len(c.train)} training examples but no '
            f'{part} example (each class of the test split\'s halves is '
            f'shared by the proportions of dirichlet_alpha={alpha}, and the '
            'test split is small for the clients); raise --dirichlet_alpha, '
            'lower --num_clients or try another --seed')
  return clients, server


# Below it every class goes to one client, and numpy's Dirichlet sampler
# can run without end (seen at 1e-8 with numpy 1.25).
MIN_DIRICHLET_ALPHA = 1e-3


def _split(indices: np.ndarray, proportions: np.ndarray) -> list[np.ndarray]:
  """`indices` cut into consecutive parts of sizes ~ proportions."""
  cuts = (np.cumsum(proportions)[:-1] * len(indices)).round().astype(int)
  return np.split(indices, cuts)


def _check_pool(num_clients, train_per_client, server_size, num_train):
  needed = num_clients * train_per_client
  if needed + server_size > num_train:
    raise ValueError(
        f'{num_clients} clients x {train_per_client} training examples'
        f'{f" + {server_size} server examples" if server_size else ""} need '
        f'{needed + server_size}, but the training split has {num_train}: '
        'lower --num_clients or --train_per_client' + (
            ' or --server_data_size (FedDF\'s server images; see its '
            'default)' if server_size else ''))

