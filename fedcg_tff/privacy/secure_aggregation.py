"""Secure aggregation: the server learns only the sum of the clients'
uploads, never one client's (`run_fedcg --aggregation=secure`).

`mean_factory` is `tff.aggregators.MeanFactory` with both of its sums (the
n_i-weighted values and the weights) done by `tff.aggregators.
SecureSumFactory`, i.e. through TFF's `federated_secure_sum_bitwidth`
intrinsic: each client clips its value to [-bound, bound], quantises it
uniformly to 32-bit integers, and only the integer sum crosses to the
server, which maps it back. The weighted mean is then that of plain
aggregation up to the quantisation step (2 * bound / 2**32 per client, in
units of n_i * value) and any clipping, which the round's measurements
count (`aggregator/.../secure_upper_clipped_count`).

What it protects: an honest-but-curious server sees no single upload, so
no single client's G_i, C_i or teacher logits (FedCG) or update (FedAvg).
What it does not: the sum itself (with few clients, or all but one
colluding, the sum reveals much), the broadcast models, anything the
clients learn from them; and it only applies where the server needs a sum:
FedDF and FedGen gather every client's model to form their ensembles, and
Local sends nothing. TFF's local runtime simulates the intrinsic (it sums
in the clear inside the simulator); a deployment needs a platform that
implements it with a cryptographic protocol.
"""

import tensorflow_federated as tff

# Algorithms whose server needs only a (weighted) sum of the uploads.
ALGORITHMS = ('fedavg', 'fedprox', 'fedsplit', 'fedcg')
# |n_i * value| of every uploaded number must stay below this for the sum
# to be exact up to quantisation: FMNIST's 2000 examples a client times
# weights (|w| < 3) or FedCG's teacher logits (|logit| < 30) stay well
# inside. The quantisation step is 2 * bound / 2**32 ~ 6e-5 in n_i * value
# units, ~1e-8 in the mean.
DEFAULT_BOUND = 2.0**17


def mean_factory(bound: float = DEFAULT_BOUND,
                 weight_bound: float = 2.0**24
                 ) -> tff.aggregators.WeightedAggregationFactory:
  """A weighted mean whose two sums are secure sums: values clipped to
  [-bound, bound] (after weighting), weights to [0, weight_bound]."""
  if not bound > 0:
    raise ValueError(f'secure_bound must be > 0, got {bound}')
  return tff.aggregators.MeanFactory(
      value_sum_factory=tff.aggregators.SecureSumFactory(float(bound)),
      weight_sum_factory=tff.aggregators.SecureSumFactory(
          float(weight_bound), 0.0))
