"""The names the binaries accept, importable without starting TensorFlow
(so that bad flags fail fast). `tests/run_fedcg_test.py` checks them against
the registries that build the real things."""

# fedcg_tff.algorithms.ALGORITHMS
ALGORITHMS = ('local', 'fedavg', 'fedprox', 'fedsplit', 'feddf', 'fedgen',
              'fedcg')
# tasks.registry.TASKS
TASKS = ('fmnist', 'fmnist_shift', 'cifar10', 'digit5', 'office_caltech10',
         'domainnet')
