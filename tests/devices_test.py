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
  avx512 = _AMD_AVX2.replace('avx2', 'avx2 avx512f')
  assert devices.peak_float32_flops(_AMD_AVX2)[0] == 2 * 2.5e9 * 32
  peak, how = devices.peak_float32_flops(avx512)
  assert peak == 2 * 2.5e9 * 64
  assert how == '2 cores x 2.50 GHz x 64 FLOP/cycle'
