"""Test-session plumbing: import path, quiet TF logs, and no leftover workers.

A TFF `worker_binary` left running after the session would hold the CI's
output pipe open and hang it, so the session ends by stopping them (and
`fedcg_tff.runtime` also does at interpreter exit).
"""

import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fedcg_tff.execution import runtime  # pylint: disable=g-import-not-at-top,wrong-import-position


def pytest_configure(config):
  del config
  # TFF's C++ runtime, with workers that die with this process.
  runtime.set_local_cpp_context()


def pytest_sessionfinish(session, exitstatus):
  del session, exitstatus
  runtime.shutdown_workers()
