"""Secure aggregation (`--aggregation=secure`): the uploads reach the server
only through TFF's secure-sum intrinsic, and the mean equals plain
aggregation's up to the quantisation step."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff
import tree

from fedcg_tff.algorithms import catalog
from fedcg_tff.config import FedCGConfig
from fedcg_tff.privacy import secure_aggregation
from tests import built
from tests.placement import crossings
from tests.placement import leaks

SECURE = 'federated_secure_sum_bitwidth'
# Intrinsics that would hand the server an upload, or a sum of them, in
# the clear.
PLAIN_SUMS = {'federated_sum', 'federated_mean', 'federated_weighted_mean',
              'federated_aggregate'}
VALUE_TYPE = tff.types.to_type(((np.float32, [50]), (np.float32, [3])))
WEIGHT_TYPE = tff.TensorType(np.float32)


def _uris(comp):
  return {uri for uri, _ in crossings(comp)}


def _secure_mean(bound, values, weights):
  process = secure_aggregation.mean_factory(bound).create(VALUE_TYPE,
                                                          WEIGHT_TYPE)
  return process, process.next(process.initialize(), values, weights)


def test_mean_goes_through_the_secure_sum_and_matches_the_plain_mean():
  rng = np.random.default_rng(0)
  values = [(rng.normal(size=50).astype(np.float32),
             rng.normal(size=3).astype(np.float32)) for _ in range(3)]
  weights = [2000.0, 1500.0, 500.0]
  bound = secure_aggregation.DEFAULT_BOUND
  process, out = _secure_mean(bound, values, weights)
  uris = _uris(process.next)
  assert SECURE in uris and not uris & PLAIN_SUMS, uris
  for part in range(2):
    plain = np.average([v[part] for v in values], axis=0, weights=weights)
    # Each client's n_i * value is quantised with a step of
    # 2 * bound / 2**32 (rounding: half a step each), the sum is mapped back
    # in float32 (a few ulps of the sum), then divided by sum(n_i).
    float_rounding = 4 * np.finfo(np.float32).eps * np.max(
        np.abs(plain)) * sum(weights)
    tolerance = (len(values) * bound / 2**32 + float_rounding) / sum(weights)
    np.testing.assert_allclose(out.result[part], plain, rtol=0,
                               atol=tolerance)
  assert out.measurements['mean_value']['secure_upper_clipped_count'] == 0
  # With a coarse bound (a step of 1/8 in n_i * value) the quantisation is
  # well above float32 rounding (~6e-8 here), and within its bound: the
  # values went through the integer sum.
  coarse = 2.0**28
  _, out = _secure_mean(coarse, values, weights)
  error = np.abs(out.result[0] - np.average(
      [v[0] for v in values], axis=0, weights=weights))
  assert 1e-6 < error.max() <= len(values) * coarse / 2**32 / sum(weights)


def test_values_beyond_the_bound_are_clipped_and_counted():
  values = [(np.full(50, 3.0, np.float32), np.zeros(3, np.float32)),
            (np.full(50, -1.0, np.float32), np.zeros(3, np.float32))]
  # n_i * value: 6 and -2 against a bound of 4: the first is clipped to 4.
  _, out = _secure_mean(4.0, values, [2.0, 2.0])
  np.testing.assert_allclose(out.result[0], (4.0 - 2.0) / 4.0, atol=1e-6)
  measured = out.measurements['mean_value']
  assert measured['secure_upper_clipped_count'] == 1
  assert measured['secure_lower_clipped_count'] == 0
  with pytest.raises(ValueError, match='secure_bound'):
    secure_aggregation.mean_factory(0.0)


def _client_data(seed):
  rng = np.random.default_rng(seed)
  return tf.data.Dataset.from_tensor_slices(
      (rng.normal(size=(16, 32, 32, 1)).astype(np.float32),
       rng.integers(0, 10, 16).astype(np.int32))).batch(8)


def test_secure_fedavg_sums_uploads_securely_and_matches_plain_fedavg():
  config = FedCGConfig(batch_size=8, local_epochs=1)
  data = [_client_data(s) for s in (1, 2)]
  secure = catalog.build('fedavg', config, 2,
                         aggregation_factory=secure_aggregation.mean_factory())
  plain = catalog.build('fedavg', config, 2)
  # The round's type: every upload reaches the server through the secure
  # sum (the plain process's weighted mean is what the check would see).
  uris = _uris(secure.process.next)
  assert SECURE in uris and not uris & PLAIN_SUMS, uris
  assert _uris(plain.process.next) & PLAIN_SUMS
  for d in (secure, plain):
    d.run_round(0, data)
  # 2 clients of 16 examples: the quantisation bound of the first test.
  tolerance = 2 * secure_aggregation.DEFAULT_BOUND / 2**32 / 32
  for a, b in zip(tree.flatten(secure.server_state.shared),
                  tree.flatten(plain.server_state.shared)):
    np.testing.assert_allclose(a, b, rtol=0, atol=tolerance)


def test_secure_fedcg_sums_every_upload_securely():
  """FedCG's round sends every upload (G_i, C_i, the teacher logits) to the
  server through the secure sum only; on real uploads of a round (tiny
  data) the secure mean clips nothing at the default bound (the logits
  are weighted by n_i too) and equals the plain weighted mean up to the
  quantisation step. (The server's state after the round is not compared:
  its distillation's Adam steps amplify the quantisation.)"""
  plain = built.process('fedcg', built.TINY)
  secure = catalog.build_process(
      'fedcg', built.TINY,
      aggregation_factory=secure_aggregation.mean_factory())
  uris = _uris(secure.next)
  assert SECURE in uris and not uris & PLAIN_SUMS, uris
  # The secure sum's own crossings (its bounds, its quantised uploads)
  # carry nothing shaped as an extractor kernel either.
  assert leaks(secure.next) == []
  outputs = plain.parts.clients_step(
      plain.initialize(), plain.initialize_clients([1, 2]),
      [_client_data(s) for s in (1, 2)])
  uploads, weights = [o.upload for o in outputs], [o.weight for o in outputs]
  upload_type = secure.parts.server_step.type_signature.parameter[1].member
  mean = secure_aggregation.mean_factory().create(upload_type, WEIGHT_TYPE)
  out = mean.next(mean.initialize(), uploads, weights)
  counts = [v for path, v in tree.flatten_with_path(out.measurements)
            if 'clipped_count' in str(path[-1])]
  assert counts and not any(counts), out.measurements
  total = float(sum(weights))
  for name in ('generator', 'classifier', 'teacher_logits'):
    for got, *each in zip(tree.flatten(getattr(out.result, name)),
                          *(tree.flatten(getattr(u, name)) for u in uploads)):
      want = np.average(each, axis=0, weights=weights)
      float_rounding = 4 * np.finfo(np.float32).eps * np.max(
          np.abs(each)) * total
      tolerance = (len(uploads) * secure_aggregation.DEFAULT_BOUND / 2**32 +
                   float_rounding) / total
      np.testing.assert_allclose(got, want, rtol=0, atol=tolerance)
