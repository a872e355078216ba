r"""Prints the time of FedCG's per-client and server pieces (plain TF, CPU).

  .venv/bin/python -m benchmarks.step_loop_benchmark

Figures to compare with the published PyTorch code on the same machine kind
(4 FMNIST clients, 2000 images each, batch 8: ~1.2 s per classification
epoch and ~10 s per GAN epoch per client). Also shows why the training loops
iterate `iter(dataset)`: the same step inside `for batch in dataset` (which
AutoGraph lowers to `dataset.reduce`) against `for batch in iter(dataset)`.
Random images stand in for FMNIST: the cost does not depend on pixel values.
"""

import time

import tensorflow as tf

from benchmarks import synthetic
from fedcg_tff.algorithms import fedcg_tf
from fedcg_tff.algorithms import training_tf
from fedcg_tff.config import FedCGConfig


def _best_of(fn, repeats=3):
  fn()  # Trace and warm up.
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def main():
  config = FedCGConfig(local_epochs=1, gan_epochs=1)
  dataset = synthetic.client_dataset(config.batch_size)
  nets = fedcg_tf.PartyNetworks(config)
  state = fedcg_tf.initial_client_state(config, 1)
  server = fedcg_tf.initial_server_state(config, ())
  noise, labels = fedcg_tf.distillation_inputs(config, 0)
  gamma = tf.constant(0.5)

  stage1 = tf.function(lambda: fedcg_tf.train_classification(
      nets, state.classification_optimizer, dataset, gamma, state.seed, 0))
  stage2 = synthetic.gan_epoch(config, dataset)
  teacher = tf.function(lambda: fedcg_tf.generated_logits(
      nets.generator, nets.classifier, noise, labels))
  logits = teacher()
  server_nets = fedcg_tf.PartyNetworks(config)
  distill = tf.function(lambda: fedcg_tf.distill(
      server_nets, server.optimizer_state, noise, labels, logits))

  print(f'{tf.config.threading.get_intra_op_parallelism_threads()=}')
  print('per client, 2000 images, batch 8:')
  print(f'  stage 1, one classification epoch: {_best_of(stage1):6.2f} s')
  print(f'  stage 2, one GAN epoch:            {_best_of(stage2):6.2f} s')
  print(f'  teacher logits, {config.distill_samples} samples:  '
        f'{_best_of(teacher):6.2f} s')
  print(f'server: distillation, {config.distill_steps} steps:     '
        f'{_best_of(distill, 1):6.2f} s')

  # The loop form: one stage-1 step per batch, 250 batches.
  optimizer = training_tf.classification_optimizer(config)
  variables = (nets.extractor.trainable_variables +
               nets.classifier.trainable_variables)

  def step(xb, yb, opt_state):
    with tf.GradientTape() as tape:
      logits = nets.classifier(nets.extractor(xb, training=True),
                               training=True)
      loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
          yb, logits, from_logits=True))
    return training_tf.apply_gradients(optimizer, opt_state, variables,
                                       tape.gradient(loss, variables))

  @tf.function
  def over_dataset():
    s = state.classification_optimizer
    for xb, yb in dataset:
      s = step(xb, yb, s)
    return s

  @tf.function
  def over_iterator():
    s = state.classification_optimizer
    for xb, yb in iter(dataset):
      s = step(xb, yb, s)
    return s

  steps = 2000 // config.batch_size
  for name, fn in (('for batch in dataset', over_dataset),
                   ('for batch in iter(dataset)', over_iterator)):
    print(f'  {name:28s}: {1000 * _best_of(fn) / steps:6.2f} ms per step')


if __name__ == '__main__':
  main()
