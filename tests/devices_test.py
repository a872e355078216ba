"""The host description every timing carries."""

from fedcg_tff.execution import devices

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
  assert devices.host_cpu().endswith(('AVX-512)', 'AVX2)', 'no AVX2)'))


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
