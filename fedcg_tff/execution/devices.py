"""Where training runs: `--device=cpu` (default) or `--device=gpu`.

With `gpu`, `configure` turns on memory growth for every GPU TensorFlow sees
in this process (or splits each into `logical_per_gpu` logical devices of
`memory_mb` each, so several clients can share one card), and `scope()` then
places the training computations built afterwards on the first GPU
(`/device:GPU:0`, soft placement leaves ops without a GPU kernel on the CPU).

What a GPU user must provide: these computations are executed by TFF's C++
worker, and the `worker_binary` in the pip `tensorflow-federated` package is
built without CUDA, so a GPU placement only takes effect with a worker built
from TFF's sources with CUDA support (`bazel build --config=cuda
//tensorflow_federated/cc/simulation:worker_binary`) installed in its place,
on a machine whose driver and CUDA/cuDNN match TensorFlow 2.14. Nothing here
was run on a GPU: this machine and CI have none, and `configure('gpu')`
refuses to start when TensorFlow sees no GPU rather than silently training
on the CPU.
"""

import contextlib
import os

from fedcg_tff.execution import child_env

DEVICES = ('cpu', 'gpu')
_training_device = None  # None: no placement (TensorFlow's default).


def configure(device: str, logical_per_gpu: int = 1,
              memory_mb: int | None = None) -> str | None:
  """Prepares `device` for training; returns the device computations are
  placed on (None for the CPU default). Raises ValueError naming the
  problem when `device` is unknown or no GPU is visible."""
  global _training_device
  if device not in DEVICES:
    raise ValueError(f'device must be one of {DEVICES}, got {device!r}')
  if device == 'cpu':
    _training_device = None
    return None
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gpus = tf.config.list_physical_devices('GPU')
  if not gpus:
    raise ValueError(
        'TensorFlow sees no GPU in this process (a CUDA build of TensorFlow '
        'and a driver are needed), and the pip TFF worker is CPU-only: see '
        'fedcg_tff/execution/devices.py for what a GPU run needs')
  if logical_per_gpu < 1:
    raise ValueError(f'logical_per_gpu must be >= 1, got {logical_per_gpu}')
  for gpu in gpus:
    if logical_per_gpu == 1:
      tf.config.experimental.set_memory_growth(gpu, True)
    else:
      if not memory_mb:
        raise ValueError('several logical devices per GPU need memory_mb '
                         '(each one\'s memory limit)')
      tf.config.set_logical_device_configuration(gpu, [
          tf.config.LogicalDeviceConfiguration(memory_limit=memory_mb)
          for _ in range(logical_per_gpu)])
  tf.config.set_soft_device_placement(True)
  _training_device = '/device:GPU:0'
  return _training_device


def training_device() -> str | None:
  """Where `scope` places training ops (None: TensorFlow's default)."""
  return _training_device


def scope():
  """A `tf.device` scope for training ops (a no-op on the CPU default)."""
  if _training_device is None:
    return contextlib.nullcontext()
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.device(_training_device)


def cpu_processors(cpuinfo: str | None = None) -> list[dict[str, str]]:
  """/proc/cpuinfo as one {field: value} dict per processor (blocks are
  separated by blank lines). `cpuinfo`: the file's text (read if None).
  The one reader of that file, for `host_cpu` and `peak_float32_flops`."""
  if cpuinfo is None:
    with open('/proc/cpuinfo') as f:
      cpuinfo = f.read()
  processors = []
  for block in cpuinfo.split('\n\n'):
    fields = {}
    for line in block.splitlines():
      key, _, value = line.partition(':')
      fields.setdefault(key.strip(), value.strip())
    if fields:
      processors.append(fields)
  return processors or [{}]


# AMD's family 25 (Zen 3, Zen 4): Zen 4 runs AVX-512 on its two 256-bit FMA
# pipes, a 512-bit instruction in two passes, so its float32 peak per cycle
# is AVX2's. Family 26 (Zen 5 EPYC) has 512-bit pipes. Not told apart here,
# as no host of this pool has them: Zen 5 laptop parts, which split 512-bit
# operations too, and Intel parts with one 512-bit FMA port (some Xeon
# Bronze, Silver and Gold 5xxx), whose peak is also 32.
_HALF_WIDTH_AVX512_FAMILIES = {('AuthenticAMD', '25')}
# AMD's family 23 below model 0x30 (Zen 1, Zen+) runs AVX2 on 128-bit FMA
# pipes, a 256-bit operation in two passes: 16 FLOPs a cycle, not 32.
# Family 23 from model 0x30 on (Zen 2) has 256-bit pipes.
_ZEN2_FIRST_MODEL = 0x30


def _half_width_avx2(processor: dict[str, str]) -> bool:
  try:
    model = int(processor.get('model', ''))
  except ValueError:
    return False
  return (processor.get('vendor_id') == 'AuthenticAMD' and
          processor.get('cpu family') == '23' and model < _ZEN2_FIRST_MODEL)


def _vector_unit(processor: dict[str, str]) -> tuple[str, int]:
  """(name, float32 FLOPs per cycle per core) of the widest FMA unit
  /proc/cpuinfo's `processor` lists: two 16-lane FMAs for AVX-512 (two
  8-lane on Zen 4, which splits each 512-bit operation), two 8-lane for
  AVX2's FMA."""
  flags = processor.get('flags', '').split()
  if 'avx512f' in flags:
    half = (processor.get('vendor_id'), processor.get('cpu family')
            ) in _HALF_WIDTH_AVX512_FAMILIES
    return 'AVX-512', 32 if half else 64
  if 'avx2' in flags:
    return 'AVX2', 32 if 'fma' in flags and not _half_width_avx2(
        processor) else 16
  return 'no AVX2', 8


# What oneDNN needs of a CPU to run its AVX-512 kernels (its `avx512_core`
# ISA); it picks every kernel by the ISA the CPU reports, not by vendor.
_ONEDNN_AVX512_FLAGS = ('avx512f', 'avx512bw', 'avx512vl', 'avx512dq')


def runs_avx512_kernels(cpuinfo: str | None = None) -> bool:
  """Whether TensorFlow's oneDNN runs its AVX-512 kernels on this host (or
  on the one `cpuinfo`'s text describes): the key of the kernel choices
  tuned per host kind (`small_conv.host_tuned_choices`). Zen 4 counts,
  its 512-bit operations split in two notwithstanding: oneDNN dispatches
  on the flags. False where /proc/cpuinfo cannot be read, and where this
  process's environment caps oneDNN below AVX-512 (ONEDNN_MAX_CPU_ISA or
  DNNL_MAX_CPU_ISA, e.g. AVX2, which its child processes inherit)."""
  cap = (os.environ.get('ONEDNN_MAX_CPU_ISA') or
         os.environ.get('DNNL_MAX_CPU_ISA') or 'ALL').upper()
  if cap != 'ALL' and not cap.startswith(('AVX512', 'AVX10')):
    return False
  try:
    flags = cpu_processors(cpuinfo)[0].get('flags', '').split()
  except OSError:
    return False
  return all(flag in flags for flag in _ONEDNN_AVX512_FLAGS)


def usable_cpus() -> int:
  """The CPUs this process may run on (its affinity, which a container's
  cpuset limits; `os.cpu_count()` counts the host's)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # Not Linux.
    return os.cpu_count() or 1


def host_cpu(cpuinfo: str | None = None) -> str:
  """The CPU's model name (as lscpu prints it), its family and its widest
  vector unit, for every timing: speeds differ between the hosts of one
  machine kind, and the model name alone does not tell them apart (AMD
  EPYC hosts with AVX2 only and AMD EPYC hosts of family 26 with AVX-512
  both print "AMD EPYC"; a full FedCG round took 785 s on the first and
  132 s on the second). `cpuinfo`: /proc/cpuinfo's text (read if None)."""
  first = cpu_processors(cpuinfo)[0]
  vector, _ = _vector_unit(first)
  family = first.get('cpu family')
  return (f'{first.get("model name", "unknown CPU")}'
          f' ({f"family {family}, " if family else ""}{vector})')


def core_count(cpuinfo: str | None = None) -> int:
  """The processors /proc/cpuinfo (or `cpuinfo`'s text) lists (a virtual
  machine's vCPUs, each taken for a core); reading this host, no more
  than this process may run on."""
  processors = cpu_processors(cpuinfo)
  cores = len([p for p in processors if 'cpu MHz' in p]) or len(processors)
  return cores if cpuinfo is not None else min(cores, usable_cpus())


def peak_float32_flops(cpuinfo: str | None = None) -> tuple[float, str]:
  """(float32 FLOP/s, how it was derived) of the CPUs this process may run
  on: their count times the processors' mean clock (as /proc/cpuinfo lists
  it) times the first one's FLOPs per cycle; 0.0 if no clock is listed.
  The benchmark's "% of peak" divides by it. Reading this host, the count
  is the process's CPU affinity where that is smaller than the file's list
  (a container limited to some of the host's CPUs sees all of them there);
  for given `cpuinfo` text, the processors it lists."""
  processors = cpu_processors(cpuinfo)
  mhz = [float(p['cpu MHz']) for p in processors if 'cpu MHz' in p]
  _, per_cycle = _vector_unit(processors[0])
  cores = core_count(cpuinfo)
  clock = (sum(mhz) / len(mhz) if mhz else 0.0) * 1e6
  return (cores * clock * per_cycle,
          f'{cores} cores x {clock / 1e9:.2f} GHz x {per_cycle} FLOP/cycle')


# The product `product_flops_per_core` times: [n, n] @ [n, n] in float32.
PRODUCT_SIZE = 1024


def product_flops_per_core(size: int = PRODUCT_SIZE, calls: int = 5,
                           trials: int = 3) -> tuple[float, str]:
  """(float32 FLOP/s, what was timed) of one thread's large matrix product
  in TensorFlow (its oneDNN sgemm): the best of `trials` timings of
  `calls` [size, size] @ [size, size] products, in a child process.

  A measured reference beside `peak_float32_flops`, which trusts the clock
  /proc/cpuinfo lists. A virtual machine's guest can list a nominal clock
  the cores exceed: an AMD EPYC family 23 guest listed 2.00 GHz while a
  chain of dependent adds ran at 2.45 GHz a second, and one thread's
  products ran at 36 GFLOP/s against the 32 that clock allows a core.
  The child has one intra-op thread (a process's TensorFlow thread pools
  are fixed once it starts) and this process's environment. Times
  `core_count()` gives a reference rate for the whole machine, not a
  bound: a better kernel could beat it, and where two listed processors
  are SMT siblings of one core it counts that core twice. Raises
  RuntimeError when the child fails or prints no rate."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  # On the CPU even in a CUDA build of TensorFlow.
  env = child_env.environment(TF_CPP_MIN_LOG_LEVEL='2',
                              CUDA_VISIBLE_DEVICES='')
  done = subprocess.run(
      [sys.executable, '-c', 'from fedcg_tff.execution import devices; '
       f'print(devices.time_product_here({size}, {calls}, {trials}))'],
      env=env, capture_output=True, text=True, timeout=600, check=False)
  if done.returncode:
    raise RuntimeError('timing the product in a child process failed: '
                       + done.stderr[-2000:])
  try:
    rate = float(done.stdout.split()[-1])
  except (ValueError, IndexError):
    raise RuntimeError('timing the product in a child process printed no '
                       f'rate: {done.stdout[-2000:]!r}') from None
  return rate, (f'one thread, float32 [{size}, {size}] @ [{size}, {size}] '
                f'in TensorFlow, best of {trials} x {calls} calls')


def time_product_here(size: int, calls: int, trials: int) -> float:
  """FLOP/s of `product_flops_per_core`'s product, timed in this process
  on one intra-op thread: call it only in a process whose TensorFlow has
  not run anything yet (the child `product_flops_per_core` starts)."""
  import time  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  a = tf.random.stateless_normal([size, size], seed=[0, 1])
  b = tf.random.stateless_normal([size, size], seed=[0, 2])

  @tf.function
  def products(a, b):
    total = tf.zeros([size, size])
    for _ in tf.range(calls):
      # Each product depends on the last, so none can be skipped.
      total = tf.matmul(a + 0.0 * total[:1], b)
    return total

  products(a, b).numpy()  # Traced and warmed up.
  best = float('inf')
  for _ in range(trials):
    start = time.perf_counter()
    products(a, b).numpy()
    best = min(best, time.perf_counter() - start)
  return 2.0 * size ** 3 * calls / best
