"""The host description every timing carries."""

import contextlib
import re

from fedcg_tff.algorithms import baselines_process_tff
from fedcg_tff.algorithms import round_tff
from fedcg_tff.execution import devices
from tests import built

_AMD_AVX2 = ('processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 25\n'
             'cpu MHz\t\t: 2000.000\nflags\t\t: fpu sse2 fma avx2\n\n'
             'processor\t: 1\nmodel name\t: AMD EPYC\ncpu family\t: 25\n'
             'cpu MHz\t\t: 3000.000\nflags\t\t: fpu sse2 fma avx2\n')


def test_hosts_with_one_model_name_are_told_apart():
  """The model name alone ("AMD EPYC") names hosts a full round runs 6x
  apart on: the description adds the family and the vector unit."""
  avx512 = _AMD_AVX2.replace('25', '26').replace('avx2', 'avx2 avx512f')
  assert devices.host_cpu(_AMD_AVX2) == 'AMD EPYC (family 25, AVX2)'
  assert devices.host_cpu(avx512) == 'AMD EPYC (family 26, AVX-512)'
  assert devices.host_cpu('flags\t: fpu\n') == 'unknown CPU (no AVX2)'


def test_this_host_is_described():
  """This host's model name and widest vector unit, as read off
  /proc/cpuinfo here independently."""
  with open('/proc/cpuinfo') as f:
    text = f.read()
  model = re.search(r'^model name\s*:\s*(.*)$', text, re.M).group(1).strip()
  flags = re.search(r'^flags\s*:\s*(.*)$', text, re.M).group(1).split()
  unit = ('AVX-512' if 'avx512f' in flags else
          'AVX2' if 'avx2' in flags else 'no AVX2')
  described = devices.host_cpu()
  assert described.startswith(model + ' (') and described.endswith(
      unit + ')'), (described, model, unit)


def test_peak_counts_every_processor_at_its_vector_width():
  """Peak = processors x mean clock x FLOPs per cycle (32 for AVX2 with
  FMA, 64 for AVX-512): the benchmark's "% of peak" rests on it."""
  avx512 = _AMD_AVX2.replace('25', '26').replace('avx2', 'avx2 avx512f')
  assert devices.peak_float32_flops(_AMD_AVX2)[0] == 2 * 2.5e9 * 32
  peak, how = devices.peak_float32_flops(avx512)
  assert peak == 2 * 2.5e9 * 64
  assert how == '2 cores x 2.50 GHz x 64 FLOP/cycle'


def test_zen4_avx512_peaks_at_avx2_width():
  """AMD's family 25 with AVX-512 (Zen 4) splits each 512-bit FMA over its
  256-bit pipes: 32 FLOP/cycle, as AVX2. Intel's family 6 and AMD's family
  26 (Zen 5) run them whole."""
  def host(vendor, family):
    return _AMD_AVX2.replace('processor\t: ', f'vendor_id\t: {vendor}\n'
                             'processor\t: ').replace('25', family).replace(
                                 'avx2', 'avx2 avx512f')
  zen4 = host('AuthenticAMD', '25')
  assert devices.host_cpu(zen4) == 'AMD EPYC (family 25, AVX-512)'
  assert devices.peak_float32_flops(zen4)[0] == 2 * 2.5e9 * 32
  for other in (host('AuthenticAMD', '26'), host('GenuineIntel', '6')):
    assert devices.peak_float32_flops(other)[0] == 2 * 2.5e9 * 64


def test_zen1_runs_avx2_at_half_width():
  """AMD's family 23 below model 0x30 (Zen 1) runs AVX2's FMA on 128-bit
  pipes: 16 FLOP/cycle; from model 0x30 (Zen 2, 49 here) 32."""
  def host(model):
    return _AMD_AVX2.replace('processor\t: ', 'vendor_id\t: AuthenticAMD\n'
                             f'model\t\t: {model}\nprocessor\t: ').replace(
                                 'family\t: 25', 'family\t: 23')
  assert devices.peak_float32_flops(host(1))[0] == 2 * 2.5e9 * 16
  assert devices.peak_float32_flops(host(49))[0] == 2 * 2.5e9 * 32


def test_peak_without_a_clock_is_zero_and_counts_usable_cpus(monkeypatch):
  """No clock listed: a peak of 0 (the benchmark then prints no share of
  it). This host's count is its usable CPUs: a container limited to one
  of them is not credited with the others /proc/cpuinfo lists."""
  assert devices.peak_float32_flops('flags\t: fpu avx2 fma\n')[0] == 0.0
  monkeypatch.setattr(devices, 'usable_cpus', lambda: 1)
  assert devices.peak_float32_flops()[1].startswith('1 cores x ')


def test_product_timing_that_fails_in_its_child_says_so():
  """A child that cannot time the product raises RuntimeError with its
  error (the benchmark then keeps its rounds' figures without the rate)."""
  try:
    devices.product_flops_per_core(size=-1, calls=1, trials=1)
  except RuntimeError as e:
    assert 'timing the product in a child process failed' in str(e)
    assert 'Error' in str(e)  # The child's own error, not an empty one.
  else:
    raise AssertionError('a product of size -1 was timed')


def test_every_step_and_the_evaluation_trace_under_the_training_device(
    monkeypatch):
  """--device reaches every computation that trains or evaluates, of every
  algorithm (`round_tff` places them in one place): Local's client step
  and its server step (each traced once), then its evaluation. Before,
  FedDF's and FedGen's server training and every evaluation ran outside
  it."""
  entered = []

  @contextlib.contextmanager
  def scope():  # Counted when entered (`with`), not when merely called.
    entered.append(len(entered))
    yield

  monkeypatch.setattr(round_tff.devices, 'scope', scope)
  # Built anew (catalog.build_process would give the one this test process
  # may have built already, without tracing).
  process = baselines_process_tff.build_baseline_process(built.TINY, 'local')
  assert len(entered) == 2
  assert process.evaluate is not None
  assert len(entered) == 3
