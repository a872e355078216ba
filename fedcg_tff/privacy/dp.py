"""Gaussian noise on what a client shares (the paper's "FedAvg DP sigma"),
through TensorFlow Privacy's Gaussian mechanism, and its (epsilon, delta).

The paper's Table 2 adds Gaussian noise of standard deviation sigma to what
FedAvg shares. Both sides of this project use one mechanism for it: TF
Privacy's `GaussianSumQuery` applied to a single client's record, which
clips the record to L2 norm `clip` (over all its tensors together) and adds
independent N(0, sigma^2) noise to every coordinate.

* Attack side (`dlg_tf`): the record is the gradient of the shared
  networks for one batch; the attacker observes `gaussian_mechanism(g)`.
* DP-FedCG (`run_fedcg --algorithm=fedcg --dp_sigma`): the record is a
  client's upload, its update of G and of C and its teacher logits, each
  part clipped on its own and noised (`fedcg_mean_factory`; the teacher
  ensemble is then a uniform mean, as DP means are).
* Training side (`run_fedcg --dp_sigma`): the record is a client's model
  update of the round (its E and C after local training minus the
  broadcast E and C; FedAvg, FedProx and FedSplit then upload updates, not
  weights, see `baselines_tf.Baseline.upload_update`). `mean_factory` is a
  `tff.aggregators.DifferentiallyPrivateFactory` whose DP query applies the
  mechanism in `preprocess_record`, which TFF runs on each client, so every
  upload carries its own noise of std sigma before it is summed: the server
  never sees an un-noised update. The server's mean over n clients then
  carries noise of std sigma / sqrt(n) per coordinate. This is "local"
  noise (what the DLG threat model assumes: the curious server sees each
  noised upload), not TFF's usual central DP, which noises only the sum.

`epsilon` gives the (epsilon, delta) of `rounds` compositions of the
Gaussian mechanism with noise multiplier sigma / clip (the `GaussianDpEvent`
TF Privacy's query itself reports), from dp-accounting's RDP accountant.
The unit of privacy is one client's whole record (client-level, add/remove
adjacency, as TFF's DP aggregators account it), with no amplification by
sampling: every client is charged for every round, as if it took part in
each. With `--clients_per_round` a client takes part in fewer rounds than
it is charged for, so the epsilon reported is then an upper bound. As
the mean divides by the fixed n, removing a client is strictly its record replaced by zeros
(zero-out adjacency: sensitivity clip). Replacing one client's record by
another's (what a server that sees each noised upload may be asked to
hide) has sensitivity 2 x clip, half the noise multiplier: `adjacency=
'replace'` accounts for that, and `describe` gives both. With the paper's
sigmas
(0.001, 0.1) and any clip that leaves the records intact, the noise
multiplier is far below 1 and epsilon is enormous: the noise blunts the
attack but gives no meaningful formal guarantee.
"""

import math
from typing import Any

import dp_accounting
import tensorflow_federated as tff
import tensorflow_privacy as tfp
# Not exported at the top level; NormalizedQuery needs a sum query.
from tensorflow_privacy.privacy.dp_query import nested_query

DEFAULT_DELTA = 1e-5
# RDP orders for the accountant: dp-accounting's usual grid, extended to the
# large orders that tiny noise multipliers need, and down to 1.1. With a
# tiny noise multiplier (the paper's sigmas) the best order is the lowest,
# 1.1, so those epsilons are about 8% above what orders nearer 1 give
# (one release at multiplier 1e-4: 5.5e7 against 5.1e7 with orders down to
# 1.02): conservative, and meaningless either way. A multiplier of 1 peaks
# at order 2.5, inside the grid (10 releases: epsilon 19.05 with both).
RDP_ORDERS = ([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) +
              [2.0**k for k in range(6, 21)])


def check_parameters(sigma: float, clip: float) -> None:
  """Raises ValueError naming `dp_sigma` / `dp_clip` if they are invalid."""
  if not (math.isfinite(sigma) and sigma >= 0):
    raise ValueError(f'dp_sigma must be finite and >= 0, got {sigma}')
  if not (math.isfinite(clip) and clip > 0):
    raise ValueError(f'dp_clip must be finite and > 0, got {clip}')


def gaussian_mechanism(record: Any, sigma: float, clip: float) -> Any:
  """`record` (a structure of float tensors) clipped to global L2 norm
  `clip` and noised with N(0, sigma^2) per coordinate, by TF Privacy's
  `GaussianSumQuery` applied to this one record. Works eagerly and in
  graphs; the noise comes from TF's global random state (set a global seed
  with `tf.random.set_seed` for a reproducible draw)."""
  query = tfp.GaussianSumQuery(l2_norm_clip=clip, stddev=sigma)
  state = query.initial_global_state()
  clipped = query.preprocess_record(query.derive_sample_params(state), record)
  noised, _, _ = query.get_noised_result(clipped, state)
  return noised


class LocalGaussianSumQuery(tfp.SumAggregationDPQuery):
  """A sum whose every record is clipped and noised on its own.

  `preprocess_record` (run on each client by TFF's
  `DifferentiallyPrivateFactory`) applies `GaussianSumQuery`'s clipping and
  noise to the single record; the records are then summed as they are.
  `get_noised_result` adds nothing more and reports the per-record event
  `GaussianDpEvent(sigma / clip)`.
  """

  def __init__(self, l2_norm_clip: float, stddev: float):
    self._query = tfp.GaussianSumQuery(l2_norm_clip=l2_norm_clip,
                                       stddev=stddev)

  def initial_global_state(self):
    return self._query.initial_global_state()

  def derive_sample_params(self, global_state):
    return global_state  # The clients need both the clip and the stddev.

  def preprocess_record(self, params, record):
    clipped = self._query.preprocess_record(params.l2_norm_clip, record)
    noised, _, _ = self._query.get_noised_result(clipped, params)
    return noised

  def get_noised_result(self, sample_state, global_state):
    event = dp_accounting.GaussianDpEvent(
        global_state.stddev / global_state.l2_norm_clip)
    return sample_state, global_state, event


def mean_factory(sigma: float, clip: float, num_clients: int
                 ) -> tff.aggregators.WeightedAggregationFactory:
  """The uniform mean over `num_clients` clients of their records, each
  clipped to `clip` and noised with std `sigma` on the client.

  A `DifferentiallyPrivateFactory` (unweighted, as DP means are: a client's
  weight would scale its sensitivity), wrapped so that it fits the
  algorithms' weighted-aggregator slot: the n_i are ignored.
  """
  check_parameters(sigma, clip)
  return _uniform_mean(LocalGaussianSumQuery(clip, sigma), num_clients)


def _uniform_mean(sum_query, num_clients: int
                  ) -> tff.aggregators.WeightedAggregationFactory:
  """`sum_query`'s sum over `num_clients` divided by their number, as a
  `DifferentiallyPrivateFactory` in the weighted-aggregator slot."""
  if num_clients < 1:
    raise ValueError(f'num_clients must be >= 1, got {num_clients}')
  query = tfp.NormalizedQuery(sum_query, denominator=float(num_clients))
  return tff.aggregators.as_weighted_aggregator(
      tff.aggregators.DifferentiallyPrivateFactory(query))


def fedcg_mean_factory(sigma: float, clip: float, teacher_clip: float,
                       num_clients: int
                       ) -> tff.aggregators.WeightedAggregationFactory:
  """DP-FedCG's aggregation: the uniform mean over `num_clients` clients of
  their uploads, each of its three parts (the update of G, the update of C,
  the teacher logits) clipped on its own (to `clip`, `clip` and
  `teacher_clip`) and noised with std `sigma` per coordinate on the client,
  as `mean_factory` does for one record. Each round releases three
  Gaussian mechanisms of a client, composed in `fedcg_epsilon`."""
  check_parameters(sigma, clip)
  check_parameters(sigma, teacher_clip)
  from fedcg_tff.algorithms import fedcg_tf  # pylint: disable=g-import-not-at-top
  parts = fedcg_tf.ClientUpload(
      generator=LocalGaussianSumQuery(clip, sigma),
      classifier=LocalGaussianSumQuery(clip, sigma),
      teacher_logits=LocalGaussianSumQuery(teacher_clip, sigma))
  return _uniform_mean(nested_query.NestedSumQuery(parts), num_clients)


def aggregation(algorithm: str, sigma: float, clip: float,
                teacher_clip: float, num_clients: int) -> dict:
  """The `catalog.build_process` arguments of `algorithm` trained with DP:
  its DP mean (DP-FedCG's three parts, else one record) and uploads of
  updates, which that mean clips and noises (whole weights would be
  clipped otherwise). `teacher_clip` is DP-FedCG's alone."""
  from fedcg_tff.names import DP_ALGORITHMS  # pylint: disable=g-import-not-at-top
  if algorithm not in DP_ALGORITHMS:
    raise ValueError(f'DP training applies to {DP_ALGORITHMS}, not '
                     f'{algorithm!r}')
  factory = (fedcg_mean_factory(sigma, clip, teacher_clip, num_clients)
             if algorithm == 'fedcg' else
             mean_factory(sigma, clip, num_clients))
  return {'aggregation_factory': factory, 'upload_updates': True}


# A client's record changes by at most this many clips between neighbouring
# datasets: zero-out (its record replaced by zeros: what removing a client
# is when the mean divides by a fixed n) or replace (by any other record).
SENSITIVITY_CLIPS = {'zero_out': 1, 'replace': 2}


def fedcg_epsilon(sigma: float, clip: float, teacher_clip: float, rounds: int,
                  delta: float = DEFAULT_DELTA,
                  adjacency: str = 'zero_out') -> float:
  """Epsilon at `delta` of `rounds` rounds of DP-FedCG: per round, the
  Gaussian mechanisms of G's update and C's update (noise multiplier
  sigma / clip each) and of the teacher logits (sigma / teacher_clip),
  composed by the RDP accountant; under `adjacency='replace'` each
  multiplier is halved."""
  check_parameters(sigma, clip)
  check_parameters(sigma, teacher_clip)
  _check_releases(rounds, delta)
  if sigma == 0:
    return math.inf
  events = [dp_accounting.GaussianDpEvent(
      noise_multiplier(sigma, c * _sensitivity_clips(adjacency)))
            for c in (clip, clip, teacher_clip)]
  return _epsilon(dp_accounting.ComposedDpEvent(events), rounds, delta)


def _sensitivity_clips(adjacency: str) -> int:
  try:
    return SENSITIVITY_CLIPS[adjacency]
  except KeyError:
    raise ValueError(f'adjacency must be one of {tuple(SENSITIVITY_CLIPS)}, '
                     f'got {adjacency!r}') from None


def _check_releases(rounds: int, delta: float) -> None:
  if rounds < 1:
    raise ValueError(f'rounds must be >= 1, got {rounds}')
  if not 0 < delta < 1:
    raise ValueError(f'dp_delta must be in (0, 1), got {delta}')


def _epsilon(event, rounds: int, delta: float) -> float:
  accountant = dp_accounting.rdp.RdpAccountant(RDP_ORDERS)
  accountant.compose(event, rounds)
  return float(accountant.get_epsilon(delta))


def noise_multiplier(sigma: float, clip: float) -> float:
  return sigma / clip


def epsilon(sigma: float, clip: float, rounds: int,
            delta: float = DEFAULT_DELTA, adjacency: str = 'zero_out') -> float:
  """Epsilon at `delta` after `rounds` releases of one client's record
  through the Gaussian mechanism with std `sigma` and clip `clip`
  (RDP accountant; `inf` without noise), for neighbours that differ by
  `adjacency` (`SENSITIVITY_CLIPS`)."""
  check_parameters(sigma, clip)
  _check_releases(rounds, delta)
  if sigma == 0:
    return math.inf
  return _epsilon(dp_accounting.GaussianDpEvent(
      noise_multiplier(sigma, clip * _sensitivity_clips(adjacency))),
                  rounds, delta)


def describe(sigma: float, clip: float, rounds: int,
             delta: float = DEFAULT_DELTA,
             teacher_clip: float | None = None, extra: int = 0) -> dict:
  """The DP figures a report prints, as a JSON-able dict, after `rounds`
  rounds run and `extra` further releases (rounds an interruption made the
  run start again: `run_record.RoundsStarted`); with `teacher_clip`,
  DP-FedCG's (three mechanisms a round). `epsilon` is zero-out adjacency's,
  `epsilon_replace` replacement's."""
  rounds += extra
  out = {'dp_sigma': sigma, 'dp_clip': clip,
         'noise_multiplier': noise_multiplier(sigma, clip),
         'releases': rounds, 'extra_releases': extra, 'dp_delta': delta}
  if teacher_clip is None:
    account = lambda adjacency: epsilon(sigma, clip, rounds, delta, adjacency)
  else:
    out.update(dp_teacher_clip=teacher_clip,
               teacher_noise_multiplier=noise_multiplier(sigma, teacher_clip),
               mechanisms_per_round=3)
    account = lambda adjacency: fedcg_epsilon(sigma, clip, teacher_clip,
                                              rounds, delta, adjacency)
  return {**out, 'epsilon': account('zero_out'),
          'epsilon_replace': account('replace')}
