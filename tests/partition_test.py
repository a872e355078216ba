"""Client partitions: IID protocol and Dirichlet label skew."""

import numpy as np
import pytest

from tasks import partition


def _labels(n, seed=0):
  return np.random.default_rng(seed).integers(0, 10, n).astype(np.int32)


def test_iid_sizes_disjoint_and_server_slice():
  clients, server = partition.iid(1000, 200, 4, 100,
                                  np.random.default_rng(0), server_size=300)
  train = np.concatenate([c.train for c in clients] + [server])
  assert len(train) == len(set(train.tolist())) == 700
  assert all(len(c.val) == len(c.test) == 25 for c in clients)
  with pytest.raises(ValueError, match='need 1100'):
    partition.iid(1000, 200, 4, 200, np.random.default_rng(0), 300)


def _skew(clients, labels):
  """Mean over clients of the share of their most frequent class."""
  return np.mean([np.bincount(labels[c.train], minlength=10).max() /
                  len(c.train) for c in clients])


def test_dirichlet_sums_up_is_seeded_and_skews_with_small_alpha():
  train, test = _labels(5000), _labels(1000, 1)
  split = lambda alpha, seed: partition.dirichlet(
      train, test, 4, 500, alpha, np.random.default_rng(seed))[0]
  clients = split(0.5, 0)
  all_train = np.concatenate([c.train for c in clients])
  assert len(all_train) == len(set(all_train.tolist())) == 2000  # Pool.
  sizes = [len(c.train) for c in clients]
  assert len(set(sizes)) > 1  # Sizes vary around 500.
  evaluation = np.concatenate([np.concatenate([c.val, c.test])
                               for c in clients])
  assert len(evaluation) == len(set(evaluation.tolist())) <= 1000
  # Seeded.
  again = split(0.5, 0)
  for a, b in zip(clients, again):
    np.testing.assert_array_equal(a.train, b.train)
  assert not np.array_equal(split(0.5, 1)[0].train, clients[0].train)
  # Smaller alpha, more skew; large alpha is close to IID (~0.1 + noise).
  skews = {a: np.mean([_skew(split(a, s), train) for s in range(5)])
           for a in (0.1, 1.0, 100.0)}
  assert skews[0.1] > skews[1.0] > skews[100.0]
  assert skews[100.0] < 0.2 and skews[0.1] > 0.3
  # Validation and test follow each client's label distribution: their
  # histograms lie within 0.1 in total variation of its training one
  # (0.02-0.045 here; a uniform split of either gives 0.2-0.5).
  histogram = lambda labels: np.bincount(labels, minlength=10) / len(labels)
  for c in clients:
    own = histogram(train[c.train])
    for held_out in (c.val, c.test):
      assert 0.5 * np.abs(histogram(test[held_out]) - own).sum() < 0.1


def test_dirichlet_rejects_bad_alpha_and_empty_clients():
  with pytest.raises(ValueError, match='dirichlet_alpha must be >= 0.001'):
    partition.dirichlet(_labels(100), _labels(20), 2, 10, 1e-9,
                        np.random.default_rng(0))
  with pytest.raises(ValueError, match='drew no training example'):
    partition.dirichlet(_labels(100), _labels(20), 20, 2, 0.01,
                        np.random.default_rng(0))
  # Training examples, but nothing to be evaluated on: its accuracy would
  # read 0 in the mean over clients.
  with pytest.raises(ValueError, match='client 0 drew 17 training examples '
                     'but no validation example'):
    partition.dirichlet(_labels(200), _labels(6), 4, 20, 1.0,
                        np.random.default_rng(0))
  # The same when only the test half is empty (its validation half not).
  with pytest.raises(ValueError, match='client 1 drew 15 training examples '
                     'but no test example'):
    partition.dirichlet(_labels(200), _labels(16), 4, 20, 1.0,
                        np.random.default_rng(20))


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
