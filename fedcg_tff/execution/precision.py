"""The process settings behind `FedCGConfig.matmul_precision`.

'bfloat16' needs two things: the GAN's products built for oneDNN's matmul
primitive (`small_conv.matmul`, chosen at trace time from the config), and
oneDNN allowed to round their inputs to bfloat16, which TensorFlow reads
once per process from TF_SET_ONEDNN_FPMATH_MODE. The computations run in
TFF's worker processes, which inherit the environment of the process that
starts them: `configure` sets it before any worker starts (the binaries
call it for `--matmul_precision`; `binaries/run_worker` for a remote
worker's). It also refuses what would make the run other than its record
says: bfloat16 asked for on a host without bfloat16 units (what oneDNN
would compute there was not measured; it could not be faster), or a
float32 run in an environment that already lets oneDNN round (the
variable set by hand, or oneDNN's own ONEDNN_DEFAULT_FPMATH_MODE).
"""

import os
from typing import Mapping

from fedcg_tff.execution import devices

# TensorFlow's switch (read by its oneDNN kernels; BF16 is the value it acts
# on) and oneDNN's default for primitives TF does not set it for.
TF_FPMATH = 'TF_SET_ONEDNN_FPMATH_MODE'
ONEDNN_FPMATH = 'ONEDNN_DEFAULT_FPMATH_MODE'
# /proc/cpuinfo flags of bfloat16 arithmetic oneDNN uses.
BFLOAT16_FLAGS = ('avx512_bf16', 'amx_bf16')


def has_bfloat16_arithmetic(cpuinfo: str | None = None) -> bool:
  """Whether this host (or the one `cpuinfo`'s text describes) has
  bfloat16 dot products oneDNN runs (AVX512-BF16 or AMX); False where
  /proc/cpuinfo cannot be read."""
  try:
    flags = devices.cpu_processors(cpuinfo)[0].get('flags', '').split()
  except OSError:
    return False
  return any(flag in flags for flag in BFLOAT16_FLAGS)


def problem(precision: str, environ: Mapping[str, str] | None = None,
            cpuinfo: str | None = None) -> str | None:
  """Why `precision` cannot run in `environ` (default: this process's) on
  this host (or `cpuinfo`'s), or None. Names the variable or the CPU."""
  environ = os.environ if environ is None else environ
  tf_mode = environ.get(TF_FPMATH, '').strip().upper()
  onednn_mode = environ.get(ONEDNN_FPMATH, '').strip().upper()
  if precision == 'float32':
    for name, mode in ((TF_FPMATH, tf_mode), (ONEDNN_FPMATH, onednn_mode)):
      if mode not in ('', 'STRICT'):
        return (f'{name}={environ[name]} lets oneDNN round float32 products '
                'to lower precision: unset it for a float32 run, or ask for '
                '--matmul_precision=bfloat16')
    return None
  if precision != 'bfloat16':
    raise ValueError(f'Unknown matmul_precision {precision!r}')
  if not has_bfloat16_arithmetic(cpuinfo):
    try:
      host = f'this one ({devices.host_cpu(cpuinfo)}) has neither'
    except OSError as e:
      host = f'/proc/cpuinfo could not be read ({e})'
    return ('--matmul_precision=bfloat16 needs a CPU with bfloat16 '
            f'arithmetic ({" or ".join(BFLOAT16_FLAGS)} in /proc/cpuinfo); '
            f'{host}: the setting is for those units, and without them the '
            'products would be no faster than in float32')
  if tf_mode not in ('', 'BF16'):
    return (f'{TF_FPMATH}={environ[TF_FPMATH]} conflicts with '
            f'--matmul_precision=bfloat16 (which sets it to BF16): unset it')
  if onednn_mode not in ('', 'STRICT', 'BF16'):
    return (f'{ONEDNN_FPMATH}={environ[ONEDNN_FPMATH]} allows more than '
            'bfloat16 rounding: unset it')
  return None


def worker_flag() -> str:
  """' --matmul_precision=bfloat16' if this process is set up for it, else
  '': what a user restarting a remote worker of this run must pass to
  `binaries/run_worker` (a worker started without it would compute the
  run's bfloat16 products in float32; `workers.check_precision` refuses
  such a worker when the driver connects)."""
  if os.environ.get(TF_FPMATH, '').strip().upper() == 'BF16':
    return ' --matmul_precision=bfloat16'
  return ''


def configure_for_runs(runs: Mapping[str, str]) -> None:
  """`configure` for the one precision of several recorded runs that
  will share this process's workers (`runs`: how to name each run ->
  its matmul_precision); ValueError naming them if they differ."""
  if len(set(runs.values())) > 1:
    raise ValueError(' and '.join(
        f'{label} ran with --matmul_precision={value}'
        for label, value in runs.items()) + ': replay them separately')
  label, value = next(iter(runs.items()))
  try:
    configure(value)
  except ValueError as e:
    raise ValueError(f'{label} ran with --matmul_precision={value}: '
                     f'{e}') from None


def configure(precision: str) -> None:
  """Checks `precision` here (`problem`: ValueError with its reason) and,
  for 'bfloat16', sets TF_SET_ONEDNN_FPMATH_MODE=BF16 in this process's
  environment, for the workers started after it."""
  reason = problem(precision)
  if reason:
    raise ValueError(reason)
  if precision == 'bfloat16':
    os.environ[TF_FPMATH] = 'BF16'
