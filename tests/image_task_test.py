"""Client pipelines: conversion, resizing, normalisation, flips, noise."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import dataset_options_pb2
from tensorflow_federated.python.core.impl.executors import value_serialization

from tasks import image_task


def _task(x, y, seed=5, noise_stds=(), mean=(0.0,), std=(1.0,), clients=1):
  split = image_task.ClientSplit((x, y), (x[:4], y[:4]), (x[:4], y[:4]))
  return image_task.FederatedImageTask(
      't', (split,) * clients, 10, x.shape[-1], seed=seed, mean=mean, std=std,
      noise_stds=noise_stds)


def _epoch(ds):
  return list(ds.as_numpy_iterator())


def test_prepare_resizes_and_normalises():
  images = np.full((2, 28, 28, 1), 255, np.uint8)
  images[1] = 51  # 0.2 after scaling
  task = _task(images, np.zeros(2, np.int32), mean=(0.5,), std=(0.5,))
  out = _epoch(task.test_datasets(32)[0])[0][0]
  assert out.shape == (2, 32, 32, 1)
  np.testing.assert_allclose(out[0], 1.0, atol=1e-5)
  np.testing.assert_allclose(out[1], -0.6, atol=1e-5)
  # The resize is bilinear (a constant image reads the same under any):
  # a ramp across the columns comes out as TF's bilinear resize of it.
  ramp = np.tile(np.linspace(0, 255, 28).astype(np.uint8)[None, None, :, None],
                 (1, 28, 1, 1))
  task = _task(ramp, np.zeros(1, np.int32), mean=(0.0,), std=(1.0,))
  out = _epoch(task.test_datasets(32)[0])[0][0]
  resized = lambda method: tf.image.resize(
      ramp.astype(np.float32) / 255.0, (32, 32), method).numpy()
  np.testing.assert_allclose(out, resized('bilinear'), atol=1e-5)
  assert np.abs(resized('bilinear') - resized('nearest')).max() > 0.01
  rgb = np.zeros((1, 32, 32, 3), np.uint8)
  task = _task(rgb, np.zeros(1, np.int32), mean=(0.485, 0.456, 0.406),
               std=(0.229, 0.224, 0.225))
  out = _epoch(task.test_datasets(224)[0])[0][0]
  assert out.shape == (1, 224, 224, 3)  # ResNet's input size.
  np.testing.assert_allclose(out[0, 0, 0], [-0.485 / 0.229, -0.456 / 0.224,
                                            -0.406 / 0.225], rtol=1e-5)


def test_train_pipeline_shuffles_flips_and_is_seeded():
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, (40, 32, 32, 1)).astype(np.uint8)
  y = np.arange(40, dtype=np.int32)
  task = _task(x, y)
  ds = task.train_datasets(round_num=0, batch_size=8)[0]
  first, second = _epoch(ds), _epoch(ds)
  assert [b[0].shape[0] for b in first] == [8] * 5
  labels1 = np.concatenate([b[1] for b in first])
  labels2 = np.concatenate([b[1] for b in second])
  assert sorted(labels1) == list(range(40))
  assert not np.array_equal(labels1, labels2)  # Reshuffled each epoch.
  images = np.concatenate([b[0] for b in first])
  scaled = x.astype(np.float32) / 255.0
  flipped = [np.allclose(images[i], scaled[l][:, ::-1]) for i, l in
             enumerate(labels1)]
  kept = [np.allclose(images[i], scaled[l]) for i, l in enumerate(labels1)]
  assert all(f or k for f, k in zip(flipped, kept))
  assert 5 <= sum(flipped) <= 35  # About half of them are mirrored.
  # Reproducible: the same round gives the same batches, another round not.
  same = _epoch(task.train_datasets(0, 8)[0])
  np.testing.assert_array_equal(np.concatenate([b[0] for b in same]), images)
  other = _epoch(task.train_datasets(1, 8)[0])
  assert not np.array_equal(np.concatenate([b[1] for b in other]), labels1)
  # Under replay (FedCGConfig.replay_draws) every round and client draws
  # round 0's order and flips of client 0.
  two = _task(x, y, clients=2)
  for round_num, client in ((3, 0), (3, 1)):
    replayed = _epoch(two.train_datasets(round_num, 8, replay=True)[client])
    np.testing.assert_array_equal(
        np.concatenate([b[0] for b in replayed]), images)
  # Input noise too (at each client's std; equal stds here).
  noisy = _task(x, y, clients=2, noise_stds=(0.5, 0.5))
  batches = lambda replay: [
      np.concatenate([b[0] for b in _epoch(
          noisy.train_datasets(3, 8, replay=replay)[c])]) for c in (0, 1)]
  np.testing.assert_array_equal(*batches(True))
  assert not np.array_equal(*batches(False))


def test_data_keys_are_distinct_at_any_client_count_and_keep_old_runs():
  # Clients below 1009 keep the keys every committed run used (values of
  # the integer key (seed * 1 000 003 + round) * 1009 + client).
  assert image_task.data_seed(1, 0, 0).generate_state(2).tolist() == [
      2928837349, 948112177]
  assert image_task.data_seed(4, 7, 1008).generate_state(2).tolist() == [
      1622586764, 2354447073]
  states = {tuple(image_task.data_seed(seed, r, c).generate_state(2))
            for seed in (1, 2) for r in range(3) for c in range(2100)}
  assert len(states) == 2 * 3 * 2100
  # Through the pipeline: with one integer key, client 1009 in round 0
  # drew as client 0 in round 1 (every client holds the same data here).
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, (40, 32, 32, 1)).astype(np.uint8)
  task = _task(x, np.arange(40, dtype=np.int32), clients=1010)
  order = lambda r, c: np.concatenate(
      [b[1] for b in _epoch(task.train_datasets(r, 8)[c])])
  assert not np.array_equal(order(0, 1009), order(1, 0))


def test_flips_are_independent_of_order_and_index():
  # Each image is mirrored with probability 1/2 whatever its index: measured
  # separately on even and odd source indices over three epochs.
  rng = np.random.default_rng(1)
  n = 400
  x = rng.integers(0, 256, (n, 32, 32, 1)).astype(np.uint8)
  y = np.arange(n, dtype=np.int32)
  task = _task(x, y, seed=2)
  ds = task.train_datasets(round_num=3, batch_size=50)[0]
  flipped = {0: [], 1: []}
  for _ in range(3):
    for images, labels in ds.as_numpy_iterator():
      for image, label in zip(images, labels):
        flipped[label % 2].append(
            not np.allclose(image, x[label].astype(np.float32) / 255.0))
  for parity, draws in flipped.items():
    assert 0.42 < np.mean(draws) < 0.58, (parity, np.mean(draws))


def test_noise_std_grows_with_client_index():
  assert image_task.noise_stds(5, 0.4) == pytest.approx(
      (0.0, 0.1, 0.2, 0.3, 0.4))
  assert image_task.noise_stds(1, 0.4) == (0.0,)
  with pytest.raises(ValueError, match='noise_std'):
    image_task.noise_stds(3, -1.0)
  x = np.full((200, 32, 32, 1), 128, np.uint8)
  y = np.zeros(200, np.int32)
  stds = image_task.noise_stds(3, 0.5)
  # Normalised by (x - 0.5) / 0.5: noise added to the normalised input
  # measures its std, noise added before the normalisation twice that.
  task = _task(x, y, noise_stds=stds, clients=3, mean=(0.5,), std=(0.5,))
  clean = (128 / 255.0 - 0.5) / 0.5
  for i, ds in enumerate(task.test_datasets()):
    batch = _epoch(ds)[0][0]
    measured = float(np.std(batch - clean))
    assert measured == pytest.approx(stds[i], abs=0.01), (i, measured)
  # Evaluation noise is fixed (the same every time), training noise fresh.
  a = _epoch(task.test_datasets()[2])[0][0]
  b = _epoch(task.test_datasets()[2])[0][0]
  np.testing.assert_array_equal(a, b)
  ds = task.train_datasets(0, 200)[2]
  e1, e2 = _epoch(ds)[0][0], _epoch(ds)[0][0]
  assert not np.allclose(np.sort(e1.ravel()), np.sort(e2.ravel()))
  assert 'input noise std 0.25' in task.describe()


def test_client_pipelines_run_without_autotuning_and_same_elements(
    monkeypatch):
  # tf.data's autotuning cost a two-client round about a quarter of its wall
  # time on the Intel host (image_task.without_autotune); turning it off
  # must not change what a client sees. The reference is the pipeline built
  # without the wrapper; each dataset is built afresh (a second pass over a
  # training dataset reshuffles and redraws its flips and noise).
  rng = np.random.default_rng(1)
  x = rng.integers(0, 256, (24, 28, 28, 1)).astype(np.uint8)
  task = _task(x, np.arange(24, dtype=np.int32), noise_stds=(0.1,))
  builds = (lambda: task.train_datasets(round_num=2, batch_size=8)[0],
            lambda: task.test_datasets(32)[0])
  ours = [build() for build in builds]
  with monkeypatch.context() as patch:
    patch.setattr(image_task, 'without_autotune', lambda ds: ds)
    references = [build() for build in builds]
  for ds, reference in zip(ours, references):
    assert ds.options().autotune.enabled is False
    assert reference.options().autotune.enabled is not False
    for batch, expected in zip(_epoch(ds), _epoch(reference), strict=True):
      for a, b in zip(batch, expected, strict=True):
        np.testing.assert_array_equal(a, b)
  three = image_task.without_autotune(tf.data.Dataset.range(3))
  assert list(three.as_numpy_iterator()) == [0, 1, 2]


def test_inputs_too_large_to_cache_are_prepared_each_pass_the_same_way(
    monkeypatch):
  """Past MAX_CACHE_BYTES (224x224 ResNet inputs) conversion, resizing and
  normalisation run inside every pass instead of once: the batches must be
  those of the cached pipeline (noise after normalisation, then flips)."""
  rng = np.random.default_rng(2)
  x = rng.integers(0, 256, (20, 28, 28, 1)).astype(np.uint8)
  task = _task(x, np.arange(20, dtype=np.int32), mean=(0.5,), std=(0.5,),
               noise_stds=(0.3,))
  cached = _epoch(task.train_datasets(2, 8)[0])
  monkeypatch.setattr(image_task, 'MAX_CACHE_BYTES', 0)
  uncached = _epoch(task.train_datasets(2, 8)[0])
  for (a, la), (b, lb) in zip(cached, uncached, strict=True):
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_autotuning_stays_off_in_what_tff_sends_to_a_worker():
  # A worker rebuilds each client's dataset from the GraphDef TFF serialises
  # (value_serialization's private helper is what TFF 0.87 calls); the
  # option must travel in it, or the workers run with autotuning on.
  x = np.zeros((16, 28, 28, 1), np.uint8)
  ds = _task(x, np.zeros(16, np.int32)).train_datasets(0, 8)[0]
  graph = tf.compat.v1.GraphDef.FromString(
      value_serialization._serialize_dataset(ds))  # pylint: disable=protected-access
  options = [dataset_options_pb2.Options.FromString(
      node.attr['serialized_options'].s)
             for node in graph.node if node.op == 'OptionsDataset']
  assert options and all(o.autotune_options.HasField('enabled') and
                         not o.autotune_options.enabled for o in options)


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
