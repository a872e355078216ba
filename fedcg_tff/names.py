"""The names the binaries accept, importable without starting TensorFlow
(so that bad flags fail fast). `tests/run_fedcg_test.py` checks them against
the registries that build the real things."""

# fedcg_tff.algorithms.ALGORITHMS
ALGORITHMS = ('local', 'fedavg', 'fedprox', 'fedsplit', 'feddf', 'fedgen',
              'fedcg')
# tasks.registry.TASKS
TASKS = ('fmnist', 'fmnist_shift', 'cifar10', 'digit5', 'office_caltech10',
         'domainnet')
# algorithms.baselines_process_tff.UPDATE_ALGORITHMS and FedCG: those
# `run_fedcg --dp_sigma` applies to.
DP_ALGORITHMS = ('fedavg', 'fedprox', 'fedsplit', 'fedcg')
# privacy.secure_aggregation.ALGORITHMS: `run_fedcg --aggregation=secure`.
SECURE_ALGORITHMS = ('fedavg', 'fedprox', 'fedsplit', 'fedcg')
# privacy.dlg_tf.THREAT_MODEL_NAMES: `run_privacy_attack --algorithms`.
PRIVACY_ALGORITHMS = ('fedavg', 'fedprox', 'fedavg_dp', 'fedsplit',
                      'fedsplit_private', 'fedcg', 'fedcg_private')
# Flags that only some algorithms or tasks use: `run_fedcg` refuses them
# for the others; the sweep and the privacy attack pass them only to the
# runs that use them (`binaries.common.run_flags_for`).
ALGORITHM_FLAGS = {'prox_mu': ('fedprox',), 'diversity_weight': ('fedgen',),
                   'server_data_size': ('feddf',),
                   'dp_teacher_clip': ('fedcg',)}
# Tasks that draw --train_per_client training images per client; the other
# (domain) tasks give each client its domain's whole training split.
SAMPLED_TASKS = ('fmnist', 'fmnist_shift', 'cifar10', 'digit5')
TASK_FLAGS = {'train_per_client': SAMPLED_TASKS}
# Tasks with FedDF's unlabeled server images (tasks.registry's
# DEFAULT_SERVER_SIZE above 0): `run_fedcg --algorithm=feddf` refuses the
# others before loading anything, so a sweep stops before its first run.
SERVER_DATA_TASKS = ('fmnist', 'fmnist_shift', 'cifar10', 'digit5')
# Tasks drawn from one labelled pool (`tasks.pooled`): their server slice
# has labels, which the inversion attack's shadow extractors train on
# (Digit5's server domain comes unlabelled); the attack refuses the others
# from run.json, before their data loads.
POOLED_TASKS = ('fmnist', 'fmnist_shift', 'cifar10')
