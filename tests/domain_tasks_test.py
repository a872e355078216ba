"""Digit5, Office-Caltech10, DomainNet and CIFAR-10 on data the tests make:
image folders in the documented layouts and tfds.testing.mock_data."""

import glob
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tasks import cifar10
from tasks import digit5
from tasks import domainnet
from tasks import image_folder
from tasks import image_task
from tasks import office_caltech10
from tasks import pooled
from tasks import registry
from tasks import tfds_loader
from tasks.options import TaskOptions


def _write_images(directory, count, size, channels, seed, ext='.png'):
  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(seed)
  for i in range(count):
    image = tf.constant(rng.integers(0, 256, (size, size, channels)),
                        tf.uint8)
    data = (tf.io.encode_png(image) if ext == '.png' else
            tf.io.encode_jpeg(image))
    tf.io.write_file(os.path.join(directory, f'{i}{ext}'), data)


def _digit5_root(root, domains=digit5.DOMAINS + (digit5.SERVER_DOMAIN,)):
  for d, domain in enumerate(domains):
    grey = domain in ('usps', 'mnist')
    for c in digit5.CLASSES:
      for part, count in (('train_images', 3), ('test_images', 2)):
        _write_images(os.path.join(root, domain, part, c), count,
                      16 if domain == 'usps' else 28 if grey else 32,
                      1 if grey else 3,
                      seed=1000 * d + 10 * int(c) + (part == 'test_images'))
  return str(root)


def _domain_root(root, domains, classes, per_class=4, ext='.jpg'):
  for d, domain in enumerate(domains):
    for k, c in enumerate(classes):
      _write_images(os.path.join(root, domain, c), per_class, 40, 3,
                    seed=100 * d + k, ext=ext)
  return str(root)


def _labelled(folder, classes, size):
  """Sorted (label, image bytes) of `<folder>/<class>/*`, each image
  labelled here by its class's index: what a loader must give."""
  return sorted((k, image_folder.read_image(path, size, 3).tobytes())
                for k, name in enumerate(classes)
                for path in glob.glob(os.path.join(folder, name, '*')))


def _examples(images, labels):
  return sorted((int(label), image.tobytes())
                for image, label in zip(images, labels))


def test_digit5_from_folders(tmp_path):
  root = _digit5_root(tmp_path / 'digit5')
  options = TaskOptions(data_dir=root, train_per_client=12, seed=4,
                        server_size=5)
  task = digit5.build(options)
  assert task.client_names == ('mnistm', 'svhn', 'syn', 'usps')
  for c in task.clients:
    assert c.train[0].shape == (12, 32, 32, 3) and c.train[0].dtype == np.uint8
    assert len(c.val[1]) == len(c.test[1]) == 10  # 20 test images halved.
  # A client's val and test halves are its domain's test images, with
  # their folders' labels.
  for domain, c in zip(task.client_names, task.clients):
    assert _examples(np.concatenate([c.val[0], c.test[0]]),
                     np.concatenate([c.val[1], c.test[1]])) == _labelled(
                         os.path.join(root, domain, 'test_images'),
                         [str(d) for d in range(10)], 32)  # Folder d: d.
  assert task.server_images.shape == (5, 32, 32, 3)  # From mnist, held out.
  again = digit5.build(options)
  for a, b in zip(task.clients, again.clients):
    np.testing.assert_array_equal(a.train[0], b.train[0])
  other = digit5.build(TaskOptions(data_dir=root, train_per_client=12, seed=5))
  assert not np.array_equal(other.clients[0].train[1],
                            task.clients[0].train[1])


def test_digit5_takes_svhn_from_tfds_without_its_folder(tmp_path):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  root = _digit5_root(tmp_path / 'digit5', domains=('mnistm', 'syn', 'usps'))
  with tfds.testing.mock_data(num_examples=30):
    task = digit5.build(TaskOptions(data_dir=root, train_per_client=12))
  svhn = task.clients[1]
  assert svhn.train[0].shape == (12, 32, 32, 3)
  assert len(svhn.val[1]) == 15


def test_digit5_errors_name_what_is_missing(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match='digit5 needs --data_dir'):
    digit5.build(TaskOptions())
  root = _digit5_root(tmp_path / 'd5', domains=('svhn', 'syn', 'usps'))
  with pytest.raises(FileNotFoundError, match="domain 'mnistm'.*mnistm"):
    digit5.build(TaskOptions(data_dir=root, train_per_client=12))
  # A TFDS domain's folder under another name (SVHN for svhn), TFDS not
  # prepared: the error names the folder expected, not only TFDS.
  root = _digit5_root(tmp_path / 'd5c')
  os.rename(os.path.join(root, 'svhn'), os.path.join(root, 'SVHN'))

  def not_prepared(name, *args, **kwargs):
    raise FileNotFoundError(f'TFDS dataset {name!r} is not prepared')

  monkeypatch.setattr(tfds_loader, 'load', not_prepared)
  with pytest.raises(FileNotFoundError, match="domain 'svhn': folder "
                     "'.*/d5c/svhn' not found .*; nor is it in TFDS: TFDS "
                     "dataset 'svhn_cropped' is not prepared"):
    digit5.build(TaskOptions(data_dir=root, train_per_client=3))
  monkeypatch.undo()
  # The server domain (FedDF's) needs only its training images.
  root = _digit5_root(tmp_path / 'd5b')
  shutil.rmtree(os.path.join(root, 'mnist', 'test_images'))
  task = digit5.build(TaskOptions(data_dir=root, train_per_client=3,
                                  server_size=5))
  assert task.server_images.shape == (5, 32, 32, 3)
  with pytest.raises(ValueError, match='fewer than the 100 requested'):
    digit5.build(TaskOptions(data_dir=root, train_per_client=100))
  with pytest.raises(ValueError, match='num_clients must be 4'):
    digit5.build(TaskOptions(data_dir=root, num_clients=3))


@pytest.mark.parametrize('module', [office_caltech10, domainnet])
def test_domain_folders_split_50_25_25(tmp_path, module):
  root = _domain_root(tmp_path / 'data', module.DOMAINS, module.CLASSES)
  options = TaskOptions(data_dir=root, seed=2)
  task = module.build(options)
  assert task.client_names == module.DOMAINS
  assert task.num_classes == 10 and task.channels == 3
  for c in task.clients:
    assert (len(c.train[1]), len(c.val[1]), len(c.test[1])) == (20, 10, 10)
    assert c.train[0].shape[1:] == (32, 32, 3)
    together = np.concatenate([c.train[1], c.val[1], c.test[1]])
    assert sorted(np.bincount(together)) == [4] * 10  # Every image once.
  # Client i holds domain i's images, with their labels (each folder's
  # images are drawn from a seed of its own: no two domains share one).
  for domain, c in zip(module.DOMAINS, task.clients):
    assert _labelled(os.path.join(root, domain), module.CLASSES,
                     32) == _examples(
                         *(np.concatenate(part)
                           for part in zip(c.train, c.val, c.test)))
  again = module.build(options)
  np.testing.assert_array_equal(again.clients[1].val[0], task.clients[1].val[0])
  bigger = module.build(TaskOptions(data_dir=root, image_size=64))
  assert bigger.clients[0].train[0].shape[1:] == (64, 64, 3)


def _stripes(size):
  """Grey [size, size, 1] float images: columns 1 and 2 of every 4 white,
  the rest black (mean 127.5)."""
  white = (np.arange(size) % 4 == 1) | (np.arange(size) % 4 == 2)
  return np.broadcast_to(255.0 * white, (size, size))[..., None].astype(
      np.float32)


def test_shrunk_images_average_what_each_pixel_covers(tmp_path):
  """Shrunk 4x as torchvision's Resize on PIL images does, every output
  pixel covers two white and two black columns: grey. Plain bilinear
  sampling reads only the two white ones and turns the image white. Read
  from a file (the folder loader) and where the size is known only when
  the graph runs (TFDS images)."""
  path = os.path.join(tmp_path, 'stripes.png')
  tf.io.write_file(path, tf.io.encode_png(tf.constant(_stripes(128),
                                                      tf.uint8)))
  read = image_folder.read_image(path, 32, 1)
  assert read.shape == (32, 32, 1) and read.dtype == np.uint8
  unknown_size = tf.function(lambda x: image_task.resize(x, 32),
                             input_signature=[tf.TensorSpec(
                                 [None, None, 1], tf.float32)])
  for shrunk in (read.astype(np.float32),
                 unknown_size(_stripes(128)).numpy()):
    assert abs(float(shrunk.mean()) - 127.5) < 5, shrunk.mean()
    assert float(shrunk.std()) < 10, shrunk.std()
  # Enlarging (FMNIST's 28 -> 32) is plain bilinear, bit for bit, known
  # size or not: the inputs of the runs made before stay the same.
  small = np.random.default_rng(0).uniform(0, 255, (28, 28, 1)).astype(
      np.float32)
  plain = tf.image.resize(small, (32, 32), method='bilinear').numpy()
  np.testing.assert_array_equal(image_task.resize(small, 32).numpy(), plain)
  np.testing.assert_array_equal(unknown_size(small).numpy(), plain)


def test_folder_errors_name_the_path(tmp_path):
  classes = office_caltech10.CLASSES
  with pytest.raises(FileNotFoundError, match='nowhere'):
    office_caltech10.build(TaskOptions(data_dir=str(tmp_path / 'nowhere')))
  root = _domain_root(tmp_path / 'office', ('amazon', 'dslr', 'webcam'),
                      classes, per_class=1)
  with pytest.raises(FileNotFoundError, match="domain 'caltech'"):
    office_caltech10.build(TaskOptions(data_dir=root))
  _domain_root(tmp_path / 'office', ('caltech',), classes[:-1], per_class=1)
  with pytest.raises(FileNotFoundError, match='caltech/projector'):
    office_caltech10.build(TaskOptions(data_dir=root))
  os.makedirs(os.path.join(root, 'caltech', 'projector'))
  with pytest.raises(ValueError, match='caltech/projector.*holds no image'):
    office_caltech10.build(TaskOptions(data_dir=root))
  # A folder the run may not read (unpacked by another user). Simulated: a
  # test run as root could list a folder of mode 000.
  listdir = os.listdir

  def refusing(path='.'):
    if str(path).endswith(os.path.join('caltech', 'projector')):
      raise PermissionError(13, 'Permission denied', str(path))
    return listdir(path)

  with pytest.MonkeyPatch.context() as patch:
    # A domain folder this user may not enter: its class folders look
    # missing, and the domain is named.
    access = os.access
    caltech = os.path.join(root, 'caltech')
    patch.setattr(os, 'access', lambda p, mode: (
        False if os.path.abspath(p) == caltech else access(p, mode)))
    patch.setattr(os.path, 'isdir', lambda p, isdir=os.path.isdir: (
        False if str(p).startswith(caltech + os.sep) else isdir(p)))
    patch.setattr(os.path, 'exists', lambda p, exists=os.path.exists: (
        False if str(p).startswith(caltech + os.sep) else exists(p)))
    with pytest.raises(ValueError, match=(
        f"class folder '{caltech}/back_pack' cannot be read: this user may "
        f"not enter '{caltech}'")):
      office_caltech10.build(TaskOptions(data_dir=root))
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(os, 'listdir', refusing)
    with pytest.raises(ValueError, match="caltech/projector' cannot be "
                       'listed \\(Permission denied\\)$'):
      office_caltech10.build(TaskOptions(data_dir=root))
  bad = os.path.join(root, 'caltech', 'projector', 'broken.jpg')
  with open(bad, 'wb') as f:
    f.write(b'not a jpeg at all')
  with pytest.raises(ValueError,
                     match="broken.jpg': unreadable image \\(Unknown image "
                     "file format. One of JPEG, PNG, GIF, BMP required.\\)$"):
    office_caltech10.build(TaskOptions(data_dir=root))
  os.remove(bad)
  # A folder named like an image.
  os.makedirs(os.path.join(root, 'caltech', 'projector', 'album.jpg'))
  with pytest.raises(ValueError, match="album.jpg': cannot read"):
    office_caltech10.build(TaskOptions(data_dir=root))
  os.rmdir(os.path.join(root, 'caltech', 'projector', 'album.jpg'))
  # A file name that is not UTF-8 (an archive made elsewhere) is read.
  good = os.path.join(root, 'caltech', 'bike', os.listdir(
      os.path.join(root, 'caltech', 'bike'))[0])
  with open(good, 'rb') as f:
    pixels = f.read()
  with open(os.path.join(os.fsencode(root), b'caltech', b'projector',
                         b'caf\xe9.jpg'), 'wb') as f:
    f.write(pixels)
  task = office_caltech10.build(TaskOptions(data_dir=root))
  assert task.num_clients == 4


def test_missing_tfds_dataset_is_named(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match="'cifar10'.*tfds build cifar10"):
    tfds_loader.load('cifar10', ['train'], data_dir=str(tmp_path))
  # Without a data_dir, the folder TFDS looked in: $TFDS_DATA_DIR's.
  monkeypatch.setenv('TFDS_DATA_DIR', str(tmp_path / 'env'))
  with pytest.raises(FileNotFoundError, match=f'not prepared in {tmp_path}/env '
                     f'.*--data_dir={tmp_path}/env`'):
    tfds_loader.load('cifar10', ['train'])


def test_damaged_tfds_dataset_is_named(tmp_path, monkeypatch):
  """A prepared dataset whose shard was cut short (an interrupted copy) or
  deleted: a named error, not TF's."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  class TinyImages(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self, features=tfds.features.FeaturesDict({
              'image': tfds.features.Image(shape=(4, 4, 1)),
              'label': tfds.features.ClassLabel(num_classes=2)}))

    def _split_generators(self, dl_manager):
      return {'test': self._generate_examples()}

    def _generate_examples(self):
      for i in range(20):
        yield i, {'image': np.full((4, 4, 1), i, np.uint8), 'label': i % 2}

  TinyImages(data_dir=str(tmp_path)).download_and_prepare()
  (images, labels), = tfds_loader.load('tiny_images', ['test'],
                                       data_dir=str(tmp_path))
  assert images.shape == (20, 4, 4, 1) and labels.sum() == 10
  shard, = glob.glob(f'{tmp_path}/tiny_images/1.0.0/*test.tfrecord*')
  with open(shard, 'r+b') as f:
    f.truncate(os.path.getsize(shard) // 2)
  with pytest.raises(ValueError, match="TFDS dataset 'tiny_images' in .* is "
                     "damaged: split 'test' cannot be read .*tfds build "
                     'tiny_images'):
    tfds_loader.load('tiny_images', ['test'], data_dir=str(tmp_path))
  os.remove(shard)
  # Found through $TFDS_DATA_DIR: the message names that folder.
  monkeypatch.setenv('TFDS_DATA_DIR', str(tmp_path))
  with pytest.raises(ValueError, match=f"'tiny_images' in {tmp_path} is "
                     "damaged: split 'test' cannot be read "
                     r'\(NotFoundError'):
    tfds_loader.load('tiny_images', ['test'])


def test_cifar10_from_tfds_with_four_or_eight_clients():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with tfds.testing.mock_data(num_examples=400):
    four = cifar10.build(TaskOptions(train_per_client=40))
    eight = cifar10.build(TaskOptions(num_clients=8, train_per_client=20,
                                      partition='dirichlet',
                                      dirichlet_alpha=0.3))
  assert four.num_clients == 4 and four.channels == 3
  assert four.clients[0].train[0].shape == (40, 32, 32, 3)
  assert four.mean == cifar10.IMAGENET_MEAN
  assert eight.num_clients == 8
  assert sum(len(c.train[1]) for c in eight.clients) == 160
  # Dirichlet's clients differ in size and lean to a few classes; IID's
  # are equal and mixed.
  assert len({len(c.train[1]) for c in eight.clients}) > 1
  assert len({len(c.train[1]) for c in four.clients}) == 1
  top = lambda task: np.mean([np.bincount(c.train[1], minlength=10).max() /
                              len(c.train[1]) for c in task.clients])
  assert top(eight) > top(four) + 0.1, (top(eight), top(four))


def test_tfds_loader_keeps_only_the_labels_asked_for():
  """Filtered as read: DomainNet's ten classes of 345 (all of them decoded,
  resized and stacked first could not fit in memory at 224 x 224)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with tfds.testing.mock_data(num_examples=60):
    (_, every), = tfds_loader.load('mnist', ['test'], image_size=8)
    (images, kept), = tfds_loader.load('mnist', ['test'], image_size=8,
                                       keep_labels=[3, 7])
  assert set(kept) <= {3, 7} and 0 < len(kept) < len(every)
  assert len(kept) == np.isin(every, [3, 7]).sum()
  assert images.shape == (len(kept), 8, 8, 1)


def test_domainnet_from_tfds_keeps_the_ten_classes():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with tfds.testing.mock_data(num_examples=800):
    task = domainnet.build(TaskOptions(data_source='tfds', image_size=32))
  for c in task.clients:
    labels = np.concatenate([c.train[1], c.val[1], c.test[1]])
    assert labels.max() < 10 and len(labels) > 0
    assert c.train[0].shape[1:] == (32, 32, 3)


def test_domainnet_keeps_its_ten_named_classes_not_the_first_ten(
    monkeypatch):
  """Every kept image is of the named class its new label says: the loader
  is fed one image per DomainNet class, its original class index written
  into its pixels, and each kept image's index must name CLASSES[label]."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  asked = []

  def load(name, splits, data_dir=None, image_size=None, channels=3,
           keep_labels=None):
    # Every class, whatever `keep_labels` asks: the remapping must drop
    # the others too.
    asked.append(list(keep_labels))
    count = len(tfds.builder(name).info.features['label'].names)
    labels = np.arange(count, dtype=np.int64)
    images = np.zeros((count, image_size, image_size, channels), np.uint8)
    images[:, 0, 0, 0], images[:, 0, 0, 1] = labels // 256, labels % 256
    return [(images, labels) for _ in splits]

  monkeypatch.setattr(tfds_loader, 'load', load)
  names = tfds.builder('domainnet/real').info.features['label'].names
  assert names[:10] != domainnet.CLASSES  # Else this test proves nothing.
  task = domainnet.build(TaskOptions(data_source='tfds', image_size=8))
  for client in task.clients:
    for images, labels in (client.train, client.val, client.test):
      original = images[:, 0, 0, 0].astype(int) * 256 + images[:, 0, 0, 1]
      assert [names[i] for i in original] == [domainnet.CLASSES[l]
                                              for l in labels]
    kept = np.concatenate([client.train[1], client.val[1], client.test[1]])
    assert sorted(kept) == sorted(list(range(10)) * 2)  # Both splits, all.
  # The loader is asked for the ten classes alone, by their TFDS indices.
  assert asked == [[names.index(c) for c in domainnet.CLASSES]] * len(
      domainnet.DOMAINS), asked


def test_labels_outside_the_class_range_are_rejected():
  images = np.zeros((20, 28, 28), np.uint8)
  labels = np.arange(20) % 12  # 10 and 11 are not classes.
  with pytest.raises(ValueError, match='label 10 outside'):
    pooled.build('t', (images, labels), (images, labels % 10),
                 TaskOptions(num_clients=2, train_per_client=5), 10, (0.5,),
                 (0.5,))


def test_registry_knows_every_task():
  assert set(registry.TASKS) == {'fmnist', 'fmnist_shift', 'cifar10',
                                 'digit5', 'office_caltech10', 'domainnet'}
  assert set(registry.DEFAULT_SERVER_SIZE) == set(registry.TASKS)
  with pytest.raises(ValueError, match='task must be one of'):
    registry.build('imagenet', TaskOptions())


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
