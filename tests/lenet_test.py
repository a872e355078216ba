"""Shapes, parameter counts, spectral norm and seeded initialisation."""

import numpy as np
import pytest
import tensorflow as tf

from fedcg_tff.models import layers
from fedcg_tff.models import lenet
from fedcg_tff.models import model_weights


def _trainable(model):
  return sum(int(np.prod(v.shape)) for v in model.trainable_weights)


def test_extractor_shape_and_params():
  e = lenet.build_extractor(1)
  assert e(tf.zeros([2, 32, 32, 1])).shape == (2, 5, 5, 16)
  # conv 5x5x1x6 + 6 bias, conv 5x5x6x16 + 16 bias.
  assert _trainable(e) == 156 + 2416 == e.count_params()
  assert lenet.build_extractor(3).count_params() == 456 + 2416


def test_extractor_features_are_sigmoid_outputs():
  f = lenet.build_extractor(1)(tf.random.normal([4, 32, 32, 1]))
  assert float(tf.reduce_min(f)) > 0.0 and float(tf.reduce_max(f)) < 1.0


def test_classifier_shape_and_params():
  c = lenet.build_classifier(10)
  assert c(tf.zeros([2, 5, 5, 16])).shape == (2, 10)
  assert _trainable(c) == (400 * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10)


def test_generator_shape_params_and_no_bias():
  g = lenet.build_generator(10, 100)
  out = g([tf.random.normal([3, 100]), tf.constant([0, 4, 9])], training=True)
  assert out.shape == (3, 5, 5, 16)
  assert float(tf.reduce_min(out)) >= 0.0 and float(tf.reduce_max(out)) <= 1.0
  convs = (110 * 512 + 512 * 256 + 256 * 128 + 128 * 16) * 4
  batch_norm = 2 * (512 + 256 + 128)
  assert _trainable(g) == 10 * 10 + convs + batch_norm
  assert g.count_params() - _trainable(g) == batch_norm  # moving statistics
  deconvs = [l for l in g.layers
             if isinstance(l, tf.keras.layers.Conv2DTranspose)]
  assert len(deconvs) == 4 and not any(l.use_bias for l in deconvs)
  assert all(l.kernel_size == (2, 2) and l.strides == (1, 1) for l in deconvs)


def test_discriminator_shape_params_and_spectral_norm_layers():
  d = lenet.build_discriminator(10)
  out = d([tf.random.uniform([3, 5, 5, 16]), tf.constant([1, 2, 3])],
          training=True)
  assert out.shape == (3,)
  convs = (26 * 128 + 128 * 256 + 256 * 512 + 512 * 1) * 4
  batch_norm = 2 * (128 + 256 + 512)
  assert _trainable(d) == 10 * 10 + convs + batch_norm
  sn = [l for l in d.layers if isinstance(l, layers.SpectralNormConv2D)]
  assert [l.filters for l in sn] == [128, 256, 512, 1]
  assert not any(l.use_bias for l in sn)
  # Non-trainable: BN moving statistics and one power-iteration vector each.
  assert d.count_params() - _trainable(d) == batch_norm + 128 + 256 + 512 + 1


def test_discriminator_label_changes_output():
  d = lenet.build_discriminator(10)
  f = tf.random.uniform([1, 5, 5, 16])
  a = d([f, tf.constant([0])], training=False)
  b = d([f, tf.constant([7])], training=False)
  assert not np.allclose(a.numpy(), b.numpy())


def test_spectral_norm_largest_singular_value_is_one():
  layer = layers.SpectralNormConv2D(
      64, 2, use_bias=False,
      kernel_initializer=tf.keras.initializers.RandomNormal(0.0, 0.5, seed=3))
  layer.build((None, 4, 4, 32))
  raw = np.linalg.svd(layer.kernel.numpy().reshape(-1, 64), compute_uv=False)
  assert raw[0] > 2.0  # The raw kernel is far from norm 1.
  for _ in range(50):
    kernel = layer.normalized_kernel(training=True)
  sv = np.linalg.svd(kernel.numpy().reshape(-1, 64), compute_uv=False)
  assert sv[0] == pytest.approx(1.0, abs=1e-2)
  # Inference reuses the learnt u and gives the same normalisation.
  again = layer.normalized_kernel(training=False).numpy()
  np.testing.assert_allclose(again, kernel.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('power_iterations', [1, 2])
def test_spectral_norm_equals_the_three_product_formula(power_iterations):
  """sigma, the new u and dsigma/dW, bit for bit, against PyTorch's recipe
  written out: v = N(u W^T), u = N(v W) per iteration, then sigma = v W u^T
  with u and v constants (the layer reuses the last v W instead of
  recomputing it)."""
  layer = layers.SpectralNormConv2D(
      32, 2, use_bias=False, power_iterations=power_iterations,
      kernel_initializer=tf.keras.initializers.RandomNormal(0.0, 0.5, seed=4))
  layer.build((None, 3, 3, 16))
  u0 = tf.constant(layer.sn_u)
  with tf.GradientTape() as tape:
    sigma = layer.spectral_norm(training=True)
  got = [sigma, tf.constant(layer.sn_u), tape.gradient(sigma, layer.kernel)]
  with tf.GradientTape() as tape:
    w = tf.reshape(layer.kernel, [-1, 32])
    u = u0
    for _ in range(power_iterations):
      v = tf.stop_gradient(tf.math.l2_normalize(tf.matmul(u, w,
                                                          transpose_b=True)))
      u = tf.stop_gradient(tf.math.l2_normalize(tf.matmul(v, w)))
    sigma = tf.squeeze(tf.matmul(tf.matmul(v, w), u, transpose_b=True))
  want = [sigma, u, tape.gradient(sigma, layer.kernel)]
  for g, w_ in zip(got, want):
    np.testing.assert_array_equal(g.numpy(), w_.numpy())
  assert not np.array_equal(got[1].numpy(), u0.numpy())


def test_spectral_norm_u_only_moves_in_training():
  layer = layers.SpectralNormConv2D(8, 2)
  x = tf.random.normal([2, 3, 3, 4])
  layer(x, training=False)
  u0 = layer.sn_u.numpy().copy()
  layer(x, training=False)
  np.testing.assert_array_equal(layer.sn_u.numpy(), u0)
  layer(x, training=True)
  assert not np.allclose(layer.sn_u.numpy(), u0)


# fan_in of each LeNet layer of E and C (inputs of one output unit).
_FAN_IN = {'conv1': 5 * 5 * 1, 'conv2': 5 * 5 * 6, 'fc1': 400, 'fc2': 120,
           'logits': 84}


@pytest.mark.parametrize('draw', ['keras', 'stateless'])
def test_extractor_and_classifier_follow_pytorch_default_init(draw):
  """Kernel and bias of every conv and dense layer of E and C uniform in
  +-1/sqrt(fan_in), as PyTorch's Conv2d / Linear leave them (published
  code), both as Keras builds them and as `model_weights.sample_initial` (what
  every run uses) redraws them."""
  pooled = []  # Every value divided by its layer's bound.
  biases = []  # The same, the biases alone.
  for model in (lenet.build_extractor(1), lenet.build_classifier(10)):
    values = (model.weights if draw == 'keras' else
              model_weights.sample_initial(model, tf.constant(7, tf.int64)))
    for variable, value in zip(model.weights, values):
      layer, kind = variable.name.split('/')[:2]
      bound = 1.0 / np.sqrt(_FAN_IN[layer])
      value = np.asarray(value)
      # The bound as a float32 (what the initialiser gets): a draw can round
      # to it, above the float64 bound (fc1's kernel under TF seed 172).
      assert np.abs(value).max() <= np.float32(bound), variable.name
      if value.size >= 400:  # Large enough to test the spread itself.
        assert np.abs(value).max() > 0.95 * bound, variable.name
        assert value.std() == pytest.approx(bound / np.sqrt(3), rel=0.1), (
            variable.name)
      assert value.std() > 0, variable.name  # Biases too are random.
      pooled.append(value.ravel() / bound)
      if kind.startswith('bias'):
        biases.append(value.ravel() / bound)
  pooled = np.concatenate(pooled)  # Uniform in [-1, 1] as a whole.
  assert pooled.mean() == pytest.approx(0.0, abs=0.01)
  assert pooled.std() == pytest.approx(1 / np.sqrt(3), rel=0.02)
  # Biases alone (6 to 120 values a layer), as drawn: the same
  # distribution.
  biases = np.concatenate(biases)
  assert len(biases) == 6 + 16 + 120 + 84 + 10
  assert biases.std() == pytest.approx(1 / np.sqrt(3), rel=0.15)


def test_gan_init_distributions():
  g = lenet.build_generator()
  kernel = g.get_layer('deconv2').kernel.numpy()
  assert abs(kernel.mean()) < 0.002 and kernel.std() == pytest.approx(0.02, rel=0.05)
  gammas = [l.gamma.numpy() for l in g.layers
            if isinstance(l, tf.keras.layers.BatchNormalization)]
  assert np.concatenate(gammas).std() == pytest.approx(0.02, rel=0.15)
  assert np.concatenate(gammas).mean() == pytest.approx(1.0, abs=0.005)


@pytest.mark.parametrize('builder', [
    lenet.build_extractor, lenet.build_classifier,
    lenet.build_generator, lenet.build_discriminator])
def test_sample_initial_weights_seeded(builder):
  model = builder()
  a = model_weights.sample_initial(model, tf.constant(5, tf.int64))
  b = model_weights.sample_initial(model, tf.constant(5, tf.int64))
  c = model_weights.sample_initial(model, tf.constant(6, tf.int64))
  assert [t.shape for t in a] == [v.shape for v in model.weights]
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.numpy(), y.numpy())
  random = [i for i, t in enumerate(a) if float(tf.math.reduce_std(t)) > 0]
  assert random  # Kernels and embeddings are random ...
  for i in random:  # ... and depend on the seed.
    assert not np.allclose(a[i].numpy(), c[i].numpy())
  # Each weight is drawn from its own initialiser's distribution.
  for v, t in zip(model.weights, a):
    name = v.name
    if 'moving_variance' in name:
      np.testing.assert_array_equal(t.numpy(), 1.0)
    elif 'beta' in name or 'moving_mean' in name:
      np.testing.assert_array_equal(t.numpy(), 0.0)
  # Random ones with their initialiser's parameters (the GAN's N(0, 0.02)
  # kernels, N(1, 0.02) gammas; LeNet's uniform bounds), not a default.
  initializers = model_weights._initializer_by_variable(model)  # pylint: disable=protected-access
  checked = 0
  for v, t in zip(model.weights, a):
    config = initializers[id(v)].get_config() if id(v) in initializers else {}
    t = t.numpy().ravel()
    if t.size < 256:
      continue
    if 'stddev' in config:
      assert abs(t.mean() - config['mean']) < 5 * config['stddev'] / np.sqrt(
          t.size), (v.name, t.mean(), config)
      assert t.std() == pytest.approx(config['stddev'], rel=0.2), v.name
      checked += 1
    elif 'minval' in config:
      assert config['minval'] <= t.min() and t.max() <= config['maxval']
      assert t.max() - t.min() > 0.9 * (config['maxval'] - config['minval'])
      checked += 1
  assert checked, 'no weight drawn from a normal or uniform initialiser'


def test_weight_values_roundtrip():
  c = lenet.build_classifier()
  values = model_weights.sample_initial(c, tf.constant(1, tf.int64))
  model_weights.assign(c, values)
  for a, b in zip(model_weights.values(c), values):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  with pytest.raises(ValueError, match='classifier'):
    model_weights.assign(c, values[:2])


def _two_discriminators(build, seed=3):
  """Two copies of a discriminator with the same random weights (BN scales,
  offsets and moving statistics perturbed so each matters)."""
  rng = np.random.default_rng(seed)
  first, second = build(), build()
  first.set_weights([
      w.numpy() + (rng.uniform(0.1, 0.5, size=w.shape)
                   if 'moving_variance' in w.name else
                   0.1 * rng.normal(size=w.shape)).astype(np.float32)
      for w in first.weights])
  second.set_weights(first.get_weights())
  return first, second


def _paired_against_two_calls(build, feature_shape, batch, in_graph):
  """D's two passes stacked (`layers.paired_passes`) against two calls:
  outputs, loss gradients, BN moving statistics and spectral-norm vectors."""
  paired_d, separate_d = _two_discriminators(build)
  rng = np.random.default_rng(4)
  real = tf.constant(rng.uniform(size=(batch, *feature_shape)), tf.float32)
  fake = tf.constant(rng.uniform(size=(batch, *feature_shape)), tf.float32)
  y = tf.constant(rng.integers(0, 10, batch), tf.int32)

  def run(d, paired):
    with tf.GradientTape() as tape:
      if paired:
        with layers.paired_passes():
          both = d([tf.concat([real, fake], 0), tf.concat([y, y], 0)],
                   training=True)
        a, b = tf.split(both, 2)
      else:
        a = d([real, y], training=True)
        b = d([fake, y], training=True)
      loss = tf.reduce_sum(tf.nn.softplus(-a)) + tf.reduce_sum(
          tf.nn.softplus(b))
    return a, b, [tf.convert_to_tensor(g) for g in
                  tape.gradient(loss, d.trainable_variables)]

  if in_graph:
    run = tf.function(run)
  got = run(paired_d, True)
  want = run(separate_d, False)
  for x, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
    np.testing.assert_allclose(x.numpy(), w.numpy(), rtol=2e-4, atol=2e-5)
  for x, w in zip(paired_d.weights, separate_d.weights):
    if not x.trainable:  # Moving statistics and spectral-norm u.
      np.testing.assert_allclose(x.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('in_graph', [False, True])
def test_paired_discriminator_passes_equal_two_calls(in_graph):
  _paired_against_two_calls(lenet.build_discriminator, lenet.FEATURE_SHAPE,
                            8, in_graph)


def test_paired_passes_change_nothing_outside_training_or_the_context():
  d = lenet.build_discriminator()
  x = tf.random.uniform([4, *lenet.FEATURE_SHAPE])
  y = tf.constant([1, 2, 3, 4])
  before = [w.numpy() for w in d.weights]
  with layers.paired_passes():
    inference = d([x, y], training=False)
  np.testing.assert_allclose(inference.numpy(),
                             d([x, y], training=False).numpy(), rtol=1e-6)
  for w, b in zip(d.weights, before):  # Inference updates nothing.
    np.testing.assert_array_equal(w.numpy(), b)
  # A stacked training call without the context is one pass over 2B: other
  # statistics, other values than the paired call (the pairing matters).
  paired_d, plain_d = _two_discriminators(lenet.build_discriminator)
  both = [tf.concat([x, 1 - x], 0), tf.concat([y, y], 0)]
  with layers.paired_passes():
    paired = paired_d(both, training=True)
  assert not np.allclose(paired.numpy(), plain_d(both, training=True).numpy(),
                         atol=1e-4)


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))


def test_gan_batch_norm_moving_variance_is_the_unbiased_one():
  # PyTorch's running variance takes the unbiased batch variance (n - 1),
  # as Keras' fused batch-norm kernel does; Keras' non-fused batch norm
  # takes the biased one. G's and D's batch norms see 4-D maps and must
  # stay fused for the original's moving statistics.
  bn = layers.gan_batch_norm()
  x = tf.random.stateless_normal([8, 2, 2, 4], seed=[1, 2])
  bn.build(x.shape)
  tf.function(lambda: bn(x, training=True))()
  unbiased = np.var(x.numpy(), axis=(0, 1, 2), ddof=1)
  np.testing.assert_allclose(
      bn.moving_variance.numpy(),
      layers.BN_MOMENTUM + (1 - layers.BN_MOMENTUM) * unbiased, rtol=1e-6)
