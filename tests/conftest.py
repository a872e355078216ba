"""Test-session plumbing: import path, quiet TF logs, and no leftover workers.

A TFF `worker_binary` left running after the session would hold the CI's
output pipe open and hang it, so the session ends by stopping them (and
`fedcg_tff.runtime` also does at interpreter exit).
"""

import os
import sys

import pytest

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fedcg_tff.execution import runtime  # pylint: disable=g-import-not-at-top,wrong-import-position


# oneDNN's floating-point mode (`fedcg_tff.execution.precision`).
_FPMATH_VARIABLES = ('TF_SET_ONEDNN_FPMATH_MODE', 'ONEDNN_DEFAULT_FPMATH_MODE')


@pytest.fixture(autouse=True)
def _fpmath_left_as_found():
  """Puts oneDNN's fpmath variables back as they were and reports (an error
  at the test's teardown) a test that left them changed: every worker
  this process started later would inherit them and round its products
  to bfloat16 (and a float32 run would refuse to start)."""
  before = {name: os.environ.get(name) for name in _FPMATH_VARIABLES}
  yield
  after = {name: os.environ.get(name) for name in _FPMATH_VARIABLES}
  for name, value in before.items():
    if value is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = value
  assert after == before, f'the test changed {before} to {after}'


def pytest_configure(config):
  del config
  # TFF's C++ runtime, with workers that die with this process.
  runtime.set_local_cpp_context()


def pytest_sessionfinish(session, exitstatus):
  del session, exitstatus
  runtime.shutdown_workers()
