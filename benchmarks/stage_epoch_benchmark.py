r"""CPU seconds of one client's stage-1 and stage-2 epoch (2000 images,
batch 8, one thread, as a TFF worker runs a client), for the variants a
speed change chooses between, timed interleaved (this VM's speed drifts).

  .venv/bin/python -m benchmarks.stage_epoch_benchmark
  TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python -m benchmarks.stage_epoch_benchmark

Variants: D's real and fake passes paired into one stacked call
(`layers.paired_passes`, the default) or as two calls; the two kernel
choices `small_conv.host_tuned_choices` makes for this host (the GAN's
products swapped into the orientation oneDNN's AVX2 sgemm runs fastest,
E's conv1 as a banded product: both on AVX2 hosts, neither on AVX-512
ones) each flipped; stage 1's frozen G run on a chunk of steps'
examples at once (`training_tf.FrozenNetworkLoss`: 512 examples a call,
the default, or a whole epoch's 2000) or once a step (8 a call, as before
the chunks); the same for a FedGen client's update (one local epoch, the
frozen G feeding C). The host's CPU model is printed with the figures;
each variant's name gives its settings.
Random images stand in for FMNIST: the cost does not depend on pixel
values.
"""

import functools
import os
import time

import numpy as np
import tensorflow as tf

from benchmarks import synthetic
from fedcg_tff.algorithms import baselines_tf
from fedcg_tff.algorithms import fedcg_tf
from fedcg_tff.algorithms import training_tf
from fedcg_tff.config import FedCGConfig
from fedcg_tff.execution import devices
from fedcg_tff.models import model_weights
from fedcg_tff.models import small_conv

REPEATS = 5


def main():
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  config = FedCGConfig(local_epochs=1, gan_epochs=1)
  dataset = synthetic.client_dataset(config.batch_size)
  epochs = {}
  flags = (fedcg_tf.PAIRED_D_PASSES, small_conv.ORIENTED_PRODUCTS,
           small_conv.BANDED_CONVS)
  _, oriented, banded = flags
  settings = lambda paired, swaps, bands: (
      f'{"paired" if paired else "two"} D passes, '
      f'{"swapped" if swaps else "direct"} products, '
      f'conv1 {"banded" if bands else "tf.nn"}')
  # Each flag is read when a loop is traced. Stage 2 runs E on the real
  # images, so the conv1 choice shows there too.
  for paired, swaps, bands in ((True, oriented, banded),
                               (False, oriented, banded),
                               (True, not oriented, banded),
                               (True, oriented, not banded)):
    (fedcg_tf.PAIRED_D_PASSES, small_conv.ORIENTED_PRODUCTS,
     small_conv.BANDED_CONVS) = paired, swaps, bands
    epoch = synthetic.gan_epoch(config, dataset)
    epoch()  # Trace.
    epochs['stage 2, ' + settings(paired, swaps, bands)] = epoch
  (fedcg_tf.PAIRED_D_PASSES, small_conv.ORIENTED_PRODUCTS,
   small_conv.BANDED_CONVS) = flags
  default_chunk = training_tf.FROZEN_CHUNK_EXAMPLES
  for chunk, bands in ((default_chunk, banded), (2048, banded),
                       (config.batch_size, banded),
                       (default_chunk, not banded)):
    # Read when the loop is traced.
    training_tf.FROZEN_CHUNK_EXAMPLES = chunk
    small_conv.BANDED_CONVS = bands
    nets = fedcg_tf.PartyNetworks(config)
    state = fedcg_tf.initial_client_state(config, 1)
    name = (f'stage 1, G on {chunk} examples a call, '
            f'conv1 {"banded" if bands else "tf.nn"}')
    epochs[name] = tf.function(
        lambda nets=nets, state=state: fedcg_tf.train_classification(
            nets, state.classification_optimizer, dataset, tf.constant(0.5),
            state.seed, 0))
    epochs[name]()
  small_conv.BANDED_CONVS = banded
  # FedGen's client (its frozen G feeds C): the update traces once per
  # networks object, so each chunk size gets its own.
  fedgen = baselines_tf.BASELINES['fedgen']
  fedgen_state = baselines_tf.initial_client_state(config, 4)
  for chunk in (default_chunk, config.batch_size):
    training_tf.FROZEN_CHUNK_EXAMPLES = chunk
    fedgen_nets = baselines_tf.PartyNetworks(config, fedgen.client_networks)
    message = baselines_tf.ServerMessage(
        shared={'classifier': fedgen_state.classifier},
        generator=model_weights.values(fedgen_nets.generator),
        round_num=tf.constant(2))
    name = f'FedGen client, G on {chunk} a call'
    epochs[name] = functools.partial(baselines_tf.client_update, fedgen_nets,
                                     fedgen, message, fedgen_state, dataset)
    epochs[name]()
  training_tf.FROZEN_CHUNK_EXAMPLES = default_chunk
  times = {name: [] for name in epochs}
  for _ in range(REPEATS):
    for name, epoch in epochs.items():
      start = time.process_time()
      epoch()
      times[name].append(time.process_time() - start)
  onednn = os.environ.get('TF_ENABLE_ONEDNN_OPTS', '(default)')
  print(f'{devices.host_cpu()}; TF_ENABLE_ONEDNN_OPTS={onednn}; this host '
        f'runs {settings(*flags)}; one epoch '
        f'of one client, 2000 images, batch 8, one thread; median of {REPEATS} '
        'interleaved runs, CPU seconds:')
  for name, values in times.items():
    print(f"  {name:72s} {np.median(values):6.2f} s  "
          f'(range {min(values):.2f}-{max(values):.2f})')


if __name__ == '__main__':
  main()
