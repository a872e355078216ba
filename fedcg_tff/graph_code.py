"""Trace-time helpers: `plain`, which marks a function that AutoGraph need
not convert, and `TraceSwitch`, a per-thread switch read while tracing.

Our training loops (`for x in iter(dataset)`, `for i in tf.range(n)`) are
AutoGraph loops, and AutoGraph converts every function they call, and every
function those call, again for each traced call site: it parses the source,
rewrites it and compiles it, about 10 ms a function. A FedCG process build
(LeNet, 2026-12-02, AMD EPYC) spent 4.5 s of its 13.2 s in 384 such
conversions, most of them of layers, losses and optimizer steps whose
control flow is all Python (loops over lists of weights, `if` on Python
values): unconverted, they trace to the same graph.

`plain` (TF's own `do_not_convert`) marks such a function; nothing it calls
is converted either. Never mark a function that loops over a dataset or a
`tf.range`, or calls one that does: unconverted, such a loop fails or
unrolls without end while tracing.
"""

import contextlib
import threading

import tensorflow as tf

plain = tf.autograph.experimental.do_not_convert


class TraceSwitch:
  """A per-thread switch, set around code that traces graphs or builds
  layers and read by that code: Python state only, so what is traced holds
  whatever the switch chose (`models.layers.paired_passes`,
  `models.small_conv.bfloat16_products`). Off unless set."""

  def __init__(self):
    self._local = threading.local()

  @contextlib.contextmanager
  def set(self, value: bool = True):
    previous = self.value
    self._local.value = value
    try:
      yield
    finally:
      self._local.value = previous

  @property
  def value(self) -> bool:
    return getattr(self._local, 'value', False)
