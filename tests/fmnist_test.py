"""The FMNIST task on IDX files and TFDS data that the tests make."""

import numpy as np
import pytest

from tasks import fmnist
from tests import fake_data
from tasks import image_task


@pytest.mark.parametrize('compress', [True, False])
def test_read_idx_roundtrip(tmp_path, compress):
  arrays = fake_data.write_fake_fmnist(str(tmp_path), compress=compress)
  (xtr, ytr), (xte, yte) = fmnist.load_idx(str(tmp_path))
  np.testing.assert_array_equal(xtr, arrays['train-images-idx3-ubyte'])
  np.testing.assert_array_equal(yte, arrays['t10k-labels-idx1-ubyte'])
  assert xtr.dtype == np.uint8 and xte.shape == (40, 28, 28)
  assert ytr.shape == (120,)


def test_read_idx_rejects_bad_files(tmp_path):
  bad = tmp_path / 'bad'
  bad.write_bytes(b'\x00\x00\x08\x01\x00\x00\x00\x05abc')
  with pytest.raises(ValueError, match='bad'):
    fmnist.read_idx(str(bad))
  notidx = tmp_path / 'notidx'
  notidx.write_bytes(b'hello world')
  with pytest.raises(ValueError, match='not an IDX'):
    fmnist.read_idx(str(notidx))
  with pytest.raises(FileNotFoundError, match='dataset-fashion-mnist'):
    fmnist.load_idx(str(tmp_path))


def test_build_task_follows_protocol(tmp_path):
  fake_data.write_fake_fmnist(str(tmp_path))
  task = fmnist.build_task(num_clients=4, train_per_client=25, seed=3,
                           data_dir=str(tmp_path))
  assert task.num_clients == 4 and task.num_classes == 10
  for c in task.clients:
    assert c.train[0].shape == (25, 32, 32, 1)
    assert c.train[0].dtype == np.float32 and c.train[1].dtype == np.int32
    assert c.val[0].shape == (5, 32, 32, 1) and c.test[0].shape == (5, 32, 32, 1)
    # Normalised with mean 0.5 / std 0.5: values in [-1, 1].
    assert c.train[0].min() >= -1.0 and c.train[0].max() <= 1.0
  # A black pixel maps to -1 (unnormalised it would stay 0).
  (raw_train, _), _ = fmnist.load_idx(str(tmp_path))
  assert raw_train.min() == 0
  assert min(c.train[0].min() for c in task.clients) == pytest.approx(-1.0)
  # Train draws are disjoint; the 2n test parts are disjoint and cover 8*5.
  def keys(arrays):
    return {a.tobytes() for a in arrays[0]}
  train_sets = [keys(c.train) for c in task.clients]
  assert sum(map(len, train_sets)) == len(set().union(*train_sets)) == 100
  eval_sets = [keys(c.val) for c in task.clients] + [
      keys(c.test) for c in task.clients]
  assert len(set().union(*eval_sets)) == 40
  # Same seed, same partition; another seed, another.
  again = fmnist.build_task(4, 25, seed=3, data_dir=str(tmp_path))
  other = fmnist.build_task(4, 25, seed=4, data_dir=str(tmp_path))
  np.testing.assert_array_equal(again.clients[2].train[0],
                                task.clients[2].train[0])
  assert not np.array_equal(other.clients[2].train[0],
                            task.clients[2].train[0])


def test_server_images_are_a_disjoint_slice(tmp_path):
  fake_data.write_fake_fmnist(str(tmp_path))
  plain = fmnist.build_task(4, 20, seed=3, data_dir=str(tmp_path))
  assert plain.server_images is None
  task = fmnist.build_task(4, 20, seed=3, data_dir=str(tmp_path),
                           server_size=15)
  assert task.server_images.shape == (15, 32, 32, 1)
  assert task.server_images.dtype == np.float32
  server = {a.tobytes() for a in task.server_images}
  assert len(server) == 15
  for c in task.clients:
    assert not server & {a.tobytes() for a in c.train[0]}
  # Drawing server images leaves the clients' partition as it was.
  for a, b in zip(plain.clients, task.clients):
    np.testing.assert_array_equal(a.train[0], b.train[0])
    np.testing.assert_array_equal(a.test[1], b.test[1])


def test_build_task_rejects_impossible_split(tmp_path):
  fake_data.write_fake_fmnist(str(tmp_path))
  with pytest.raises(ValueError, match='need 500'):
    fmnist.build_task(4, 125, data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="'idx' or 'tfds'"):
    fmnist.build_task(source='csv', data_dir=str(tmp_path))


def test_tfds_source_with_mock_data():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with tfds.testing.mock_data(num_examples=60):
    task = fmnist.build_task(num_clients=2, train_per_client=10, seed=1,
                             source='tfds')
  assert task.clients[0].train[0].shape == (10, 32, 32, 1)
  assert task.clients[1].val[0].shape == (15, 32, 32, 1)


def test_preprocess_resizes_and_normalises():
  images = np.full((2, 28, 28), 255, np.uint8)
  images[1] = 51  # 0.2 after scaling
  out = image_task.preprocess(images, (0.5,), (0.5,))
  assert out.shape == (2, 32, 32, 1)
  np.testing.assert_allclose(out[0], 1.0, atol=1e-5)
  np.testing.assert_allclose(out[1], -0.6, atol=1e-5)
  rgb = np.zeros((1, 32, 32, 3), np.uint8)
  out = image_task.preprocess(rgb, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
  np.testing.assert_allclose(out[0, 0, 0], [-0.485 / 0.229, -0.456 / 0.224,
                                            -0.406 / 0.225], rtol=1e-5)


def _epoch(ds):
  return [b for b in ds.as_numpy_iterator()]


def test_train_pipeline_shuffles_flips_and_is_seeded():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 32, 32, 1)).astype(np.float32)
  y = np.arange(40, dtype=np.int32)
  split = image_task.ClientSplit((x, y), (x[:4], y[:4]), (x[:4], y[:4]))
  task = image_task.FederatedImageTask('t', (split,), 10, 1, seed=5)
  ds = task.train_datasets(round_num=0, batch_size=8)[0]
  first, second = _epoch(ds), _epoch(ds)
  assert [b[0].shape[0] for b in first] == [8] * 5
  labels1 = np.concatenate([b[1] for b in first])
  labels2 = np.concatenate([b[1] for b in second])
  assert sorted(labels1) == list(range(40))
  assert not np.array_equal(labels1, labels2)  # Reshuffled each epoch.
  images = np.concatenate([b[0] for b in first])
  flipped = [np.array_equal(images[i], x[l][:, ::-1]) for i, l in
             enumerate(labels1)]
  kept = [np.array_equal(images[i], x[l]) for i, l in enumerate(labels1)]
  assert all(f or k for f, k in zip(flipped, kept))
  assert 5 <= sum(flipped) <= 35  # About half of them are mirrored.
  # Reproducible: the same round gives the same batches, another round not.
  same = _epoch(task.train_datasets(0, 8)[0])
  np.testing.assert_array_equal(np.concatenate([b[0] for b in same]), images)
  other = _epoch(task.train_datasets(1, 8)[0])
  assert not np.array_equal(np.concatenate([b[1] for b in other]), labels1)


def test_flips_are_independent_of_order_and_index():
  # Each image is mirrored with probability 1/2 whatever its index: measured
  # separately on even and odd source indices over three epochs.
  rng = np.random.default_rng(1)
  n = 400
  x = rng.normal(size=(n, 32, 32, 1)).astype(np.float32)
  y = np.arange(n, dtype=np.int32)
  split = image_task.ClientSplit((x, y), (x[:4], y[:4]), (x[:4], y[:4]))
  task = image_task.FederatedImageTask('t', (split,), 10, 1, seed=2)
  ds = task.train_datasets(round_num=3, batch_size=50)[0]
  flipped = {0: [], 1: []}
  for _ in range(3):
    for images, labels in ds.as_numpy_iterator():
      for image, label in zip(images, labels):
        flipped[label % 2].append(not np.array_equal(image, x[label]))
  for parity, draws in flipped.items():
    assert 0.42 < np.mean(draws) < 0.58, (parity, np.mean(draws))


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
