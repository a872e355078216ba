"""What a round computes, in FLOPs: the benchmark's achieved figures,
against the machine's peak (`devices.peak_float32_flops`).

Plain arithmetic over the networks' layers, no timing: the counts are
checked by hand in tests/benchmark_test.py.
"""

import numpy as np


def layer_flops(model) -> float:
  """Forward FLOPs per example of `model`'s convolutions and dense layers
  (2 per multiply-add; activations, normalisation and the spectral norm's
  per-call power iteration are left out: they are a few percent here).
  A transposed convolution costs its input positions times its kernel, not
  its zero-padded output positions."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  total = 0.0
  for layer in model.layers:
    if isinstance(layer, tf.keras.layers.Conv2DTranspose):
      positions = np.prod(layer.input_shape[1:3])
    elif isinstance(layer, tf.keras.layers.Conv2D):
      positions = np.prod(layer.output_shape[1:3])
    elif isinstance(layer, tf.keras.layers.Dense):
      positions = np.prod(layer.output_shape[1:-1] or [1])
    else:
      continue
    kernel = layer.kernel.shape
    total += 2.0 * positions * np.prod(kernel)
  return float(total)


def forward_flops(config) -> dict[str, float]:
  """Forward FLOPs per example of each network (see `layer_flops`)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from fedcg_tff.models import families  # pylint: disable=g-import-not-at-top
  # Imported here: the benchmark checks its flags before TensorFlow loads.
  # The networks are built in a graph of their own, as inside TFF's
  # computations (built eagerly after TFF is imported, Keras' functional
  # API fails).
  with tf.Graph().as_default():
    return {
        'extractor': layer_flops(families.build_extractor(
            config.model, config.image_channels)),
        'classifier': layer_flops(families.build_classifier(
            config.model, config.num_classes)),
        'generator': layer_flops(families.build_generator(
            config.model, config.num_classes, config.noise_dim)),
        'discriminator': layer_flops(families.build_discriminator(
            config.model, config.num_classes)),
    }


def training_flops(config, flops: dict[str, float], examples: int):
  """Estimated FLOPs of stage 1 and stage 2 for `examples` images per epoch.

  Stage 1 trains E and C (3x forward) and runs G forward for L_dist. Stage 2
  runs E forward; D forward on real and on fake and backward through both
  (3x each); for G's loss, G trained (3x), D forward again and its input
  gradient (2x).
  """
  e, c, g, d = (flops[k] for k in ('extractor', 'classifier', 'generator',
                                   'discriminator'))
  stage1 = config.local_epochs * examples * (3 * (e + c) + g)
  stage2 = config.gan_epochs * examples * (e + 6 * d + 3 * g + 2 * d)
  return stage1, stage2
