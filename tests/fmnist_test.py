"""The FMNIST task on IDX files and TFDS data that the tests make."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tasks import fmnist
from tasks import fmnist_shift
from tasks.options import TaskOptions
from tests import fake_data


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
  # A web page saved under the .gz name, and a download cut short.
  html = tmp_path / 'page.gz'
  html.write_bytes(b'<html>Not Found</html>')
  with pytest.raises(ValueError, match='page.gz: unreadable .BadGzipFile'):
    fmnist.read_idx(str(html))
  (tmp_path / 'idx').mkdir()
  fake_data.write_fake_fmnist(str(tmp_path / 'idx'), compress=True)
  whole = (tmp_path / 'idx' / 'train-labels-idx1-ubyte.gz').read_bytes()
  cut = tmp_path / 'cut.gz'
  cut.write_bytes(whole[:len(whole) // 2])
  with pytest.raises(ValueError, match='cut.gz: unreadable .EOFError'):
    fmnist.read_idx(str(cut))
  # A valid gzip header before a deflate block of the reserved type 11.
  flipped = tmp_path / 'flipped.gz'
  flipped.write_bytes(b'\x1f\x8b\x08\x00' + bytes(4) + b'\x00\xff' +
                      b'\xff' * 16)
  with pytest.raises(ValueError, match='flipped.gz: unreadable .zlib.error'):
    fmnist.read_idx(str(flipped))


def test_idx_with_wrong_shape_names_the_file(tmp_path):
  fake_data.write_fake_fmnist(str(tmp_path))
  labels = tmp_path / 'train-labels-idx1-ubyte.gz'
  import gzip  # pylint: disable=g-import-not-at-top
  with gzip.open(labels, 'wb') as f:  # A 2-D "labels" file.
    f.write(b'\x00\x00\x08\x02' + (120).to_bytes(4, 'big') +
            (2).to_bytes(4, 'big') + bytes(240))
  with pytest.raises(ValueError,
                     match=r'train-labels-idx1-ubyte.gz: expected 1 dim'):
    fmnist.load_idx(str(tmp_path))


def _options(tmp_path, **kwargs):
  return TaskOptions(data_dir=str(tmp_path), **kwargs)


def test_build_follows_protocol(tmp_path):
  raw = fake_data.write_fake_fmnist(str(tmp_path))
  task = fmnist.build(_options(tmp_path, num_clients=4, train_per_client=25,
                               seed=3))
  assert task.num_clients == 4 and task.num_classes == 10
  for c in task.clients:
    assert c.train[0].shape == (25, 28, 28, 1)  # Stored as loaded.
    assert c.train[0].dtype == np.uint8 and c.train[1].dtype == np.int32
    assert c.val[0].shape == (5, 28, 28, 1) and c.test[0].shape == (5, 28, 28, 1)
  # Fed to the network at 32x32, normalised with mean 0.5 / std 0.5.
  batch = next(iter(task.val_datasets(32)[0]))[0].numpy()
  assert batch.shape == (5, 32, 32, 1)
  scaled = task.clients[0].val[0].astype(np.float32) / 255.0
  expected = (tf.image.resize(scaled, (32, 32), 'bilinear').numpy() - 0.5) / 0.5
  np.testing.assert_allclose(batch, expected, atol=1e-5)
  # Train draws are disjoint; the 2n test parts are disjoint and cover 8*5.
  def keys(arrays):
    return {a.tobytes() for a in arrays[0]}
  train_sets = [keys(c.train) for c in task.clients]
  assert sum(map(len, train_sets)) == len(set().union(*train_sets)) == 100
  eval_sets = [keys(c.val) for c in task.clients] + [
      keys(c.test) for c in task.clients]
  assert len(set().union(*eval_sets)) == 40
  # Each image keeps its own label (the file's labels are index % 10).
  for split, parts in (('train', [c.train for c in task.clients]),
                       ('t10k', [c.val for c in task.clients] +
                        [c.test for c in task.clients])):
    index = {image.astype(np.uint8).tobytes(): i for i, image in
             enumerate(raw[f'{split}-images-idx3-ubyte'])}
    for images, labels in parts:
      assert [index[x[..., 0].tobytes()] % 10 for x in images] == list(labels)
  # Same seed, same partition; another seed, another.
  again = fmnist.build(_options(tmp_path, num_clients=4, train_per_client=25,
                                seed=3))
  other = fmnist.build(_options(tmp_path, num_clients=4, train_per_client=25,
                                seed=4))
  np.testing.assert_array_equal(again.clients[2].train[0],
                                task.clients[2].train[0])
  assert not np.array_equal(other.clients[2].train[0],
                            task.clients[2].train[0])
  assert 'client_0: train 25 / val 5 / test 5' in task.describe()


def test_server_images_are_a_disjoint_slice(tmp_path):
  fake_data.write_fake_fmnist(str(tmp_path))
  plain = fmnist.build(_options(tmp_path, train_per_client=20, seed=3))
  assert plain.server_images is None and plain.server_inputs() is None
  task = fmnist.build(_options(tmp_path, train_per_client=20, seed=3,
                               server_size=15))
  assert task.server_images.shape == (15, 28, 28, 1)
  inputs = task.server_inputs(32)
  assert inputs.shape == (15, 32, 32, 1) and inputs.dtype == np.float32
  server = {a.tobytes() for a in task.server_images}
  assert len(server) == 15
  for c in task.clients:
    assert not server & {a.tobytes() for a in c.train[0]}
  # Drawing server images leaves the clients' partition as it was.
  for a, b in zip(plain.clients, task.clients):
    np.testing.assert_array_equal(a.train[0], b.train[0])
    np.testing.assert_array_equal(a.test[1], b.test[1])


def test_build_rejects_impossible_split(tmp_path):
  fake_data.write_fake_fmnist(str(tmp_path))
  with pytest.raises(ValueError, match='need 500'):
    fmnist.build(_options(tmp_path, train_per_client=125))
  with pytest.raises(ValueError, match="'idx' or 'tfds'"):
    fmnist.build(_options(tmp_path, data_source='csv'))


def test_idx_files_this_user_may_not_reach_are_named(tmp_path, monkeypatch):
  """A data directory inside one this user may not enter is reported as
  such, not as missing files to install (simulated: root enters any)."""
  locked = tmp_path / 'locked'
  locked.mkdir()
  with pytest.raises(FileNotFoundError, match='dataset-fashion-mnist'):
    fmnist.load_idx(str(locked / 'idx'))
  access = os.access
  monkeypatch.setattr(os, 'access', lambda p, mode: (
      False if os.path.abspath(p) == str(locked) else access(p, mode)))
  with pytest.raises(ValueError, match=(
      f"IDX file '{locked}/idx/train-images-idx3-ubyte' cannot be read: "
      f"this user may not enter '{locked}'")):
    fmnist.load_idx(str(locked / 'idx'))


def test_tfds_source_with_mock_data():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with tfds.testing.mock_data(num_examples=60):
    task = fmnist.build(TaskOptions(num_clients=2, train_per_client=10,
                                    data_source='tfds'))
  assert task.clients[0].train[0].shape == (10, 28, 28, 1)
  assert task.clients[1].val[0].shape == (15, 28, 28, 1)


def test_feature_shift_gives_each_client_its_domain(tmp_path):
  fake_data.write_fake_fmnist(str(tmp_path))
  plain = fmnist.build(_options(tmp_path, num_clients=5, train_per_client=20))
  shifted = fmnist_shift.build(_options(tmp_path, num_clients=5,
                                        train_per_client=20))
  assert shifted.client_names == ('client_0_rotate', 'client_1_invert',
                                  'client_2_blur', 'client_3_noise',
                                  'client_4_contrast')
  p = [c.train[0].astype(np.float32) for c in plain.clients]
  s = [c.train[0].astype(np.float32) for c in shifted.clients]
  np.testing.assert_array_equal(s[0], np.rot90(p[0], 1, axes=(1, 2)))
  np.testing.assert_array_equal(s[1], 255 - p[1])
  assert s[2].std() < p[2].std()  # Blurred.
  assert 20 < np.abs(s[3] - p[3]).mean() < 45  # Noise of std 40, clipped.
  np.testing.assert_allclose(s[4].std(), 0.4 * p[4].std(), rtol=0.02)
  # Same labels, and the shift reaches validation and test too.
  for a, b in zip(plain.clients, shifted.clients):
    np.testing.assert_array_equal(a.train[1], b.train[1])
  np.testing.assert_array_equal(shifted.clients[1].test[0],
                                255 - plain.clients[1].test[0])
  with pytest.raises(ValueError, match='unknown shift'):
    fmnist_shift.shift('swirl', plain.clients[0].train[0], 0)


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
