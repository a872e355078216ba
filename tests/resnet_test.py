"""The ResNet-18 split networks: shapes and seeded initialisation."""

import numpy as np
import pytest
import tensorflow as tf

from fedcg_tff.algorithms import catalog
from fedcg_tff.algorithms import training_tf
from fedcg_tff.config import FedCGConfig
from fedcg_tff.models import families
from fedcg_tff.models import model_weights
from tests import placement


def test_resnet18_split_shapes():
  config = FedCGConfig(model='resnet18', image_channels=3)
  assert config.image_size == families.image_size('resnet18') == 224
  assert families.feature_shape('resnet18') == (28, 28, 128)
  nets = training_tf.PartyNetworks(config)
  x = tf.random.normal([2, 224, 224, 3])
  features = nets.extractor(x)
  assert features.shape == (2, 28, 28, 128)  # 128x28x28 in NCHW terms.
  assert float(tf.reduce_min(features)) >= 0.0  # Ends in a sigmoid.
  assert float(tf.reduce_max(features)) <= 1.0
  assert nets.classifier(features).shape == (2, 10)
  y = tf.constant([1, 7])
  fake = nets.generator([tf.random.normal([2, 100]), y], training=True)
  assert fake.shape == (2, 28, 28, 128)
  assert nets.discriminator([fake, y], training=True).shape == (2,)
  # The classifier holds layer3 and layer4 (256 and 512 channels).
  kernels = [w.shape for w in nets.classifier.weights if len(w.shape) == 4]
  assert (3, 3, 128, 256) in kernels and (3, 3, 512, 512) in kernels
  assert (7, 7, 3, 64) in [w.shape for w in nets.extractor.weights]


def test_resnet18_strided_layers_pad_every_side_as_torchvision():
  """The stem's 7x7 conv, its max pool and a downsampling block's 3x3 conv
  compute torchvision's `padding=3|1|1` (the same on every side), so their
  windows line up with the pixels the block's 1x1 shortcut reads. Keras'
  'same' padding, on these even sizes one more after the map than before,
  gives other numbers."""
  extractor = families.build_extractor('resnet18', 3)
  unpadded = lambda pad: extractor.get_layer(pad).input
  checks = (('stem_pad', 'stem_conv', 3), ('stem_pool_pad', 'stem_pool', 1),
            ('layer2_0_pad', 'layer2_0_conv1', 1))
  probe = tf.keras.Model(extractor.input, [
      t for pad, layer, _ in checks
      for t in (unpadded(pad), extractor.get_layer(layer).output)])
  outputs = probe(tf.random.stateless_uniform([1, 224, 224, 3], [4, 2]))
  for (pad, layer, width), x, y in zip(checks, outputs[::2], outputs[1::2]):
    sides = [[0, 0], [width, width], [width, width], [0, 0]]
    if layer == 'stem_pool':  # torchvision's pool pads with -inf.
      want = tf.nn.max_pool2d(tf.pad(x, sides, constant_values=-np.inf), 3,
                              2, 'VALID')
    else:
      want = tf.nn.conv2d(tf.pad(x, sides),
                          extractor.get_layer(layer).kernel, 2, 'VALID')
    np.testing.assert_allclose(y.numpy(), want.numpy(), rtol=1e-5,
                               atol=1e-5, err_msg=layer)
    if layer != 'stem_pool':  # Keras' 'same' would not give these.
      same = tf.nn.conv2d(x, extractor.get_layer(layer).kernel, 2, 'SAME')
      assert not np.allclose(y.numpy(), same.numpy(), atol=1e-3), layer
  # The shortcut, a 1x1 stride-2 conv without padding, reads the even
  # pixels, on which the padded 3x3 conv's windows are centred.
  down = extractor.get_layer('layer2_0_down')
  assert down.strides == (2, 2) and down.kernel.shape[:2] == (1, 1)
  assert down.padding == 'valid'


def test_models_by_name():
  assert families.image_size('lenet') == FedCGConfig().image_size == 32
  assert families.feature_shape('lenet') == (5, 5, 16)
  with pytest.raises(ValueError, match='model must be one of'):
    families.build_extractor('vgg', 3)


def test_resnet18_initial_weights_are_seeded():
  extractor = families.build_extractor('resnet18', 3)
  a = model_weights.sample_initial(extractor, tf.constant(1, tf.int64))
  b = model_weights.sample_initial(extractor, tf.constant(1, tf.int64))
  c = model_weights.sample_initial(extractor, tf.constant(2, tf.int64))
  assert len(a) == len(extractor.weights)
  np.testing.assert_array_equal(a[0].numpy(), b[0].numpy())
  assert not np.allclose(a[0].numpy(), c[0].numpy())


@pytest.mark.parametrize('algorithm', catalog.ALGORITHMS)
def test_every_algorithm_builds_with_resnet18_and_keeps_its_extractor(
    algorithm):
  """Every algorithm's process builds with the ResNet-18 split, and only
  FedAvg, FedProx and FedDF send its extractor across a placement (the
  leak check with ResNet's kernels)."""
  config = FedCGConfig(model='resnet18', image_channels=3, batch_size=2,
                       local_epochs=1, gan_epochs=1, server_epochs=1,
                       server_steps_per_epoch=1)
  kwargs = ({'server_images': np.zeros((2, 224, 224, 3), np.float32)}
            if catalog.needs_server_images(algorithm) else {})
  process = catalog.build_process(algorithm, config, **kwargs)
  shares_extractor = algorithm in ('fedavg', 'fedprox', 'feddf')
  assert bool(placement.leaks(process.next, config)) == shares_extractor
  assert placement.carries_kernel(
      process.client_state_type,
      placement.extractor_kernels('resnet18', 3))


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
