"""Runs one of our absl binaries the way a user does: a fresh interpreter
from the repository root, output captured, a time limit."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_binary(module: str, args, timeout: float = 600,
               cwd: str = ROOT) -> subprocess.CompletedProcess:
  """`python -m binaries.<module> *args` (text output, TF logs quiet)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, '-m', f'binaries.{module}', *args],
                        cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=timeout)
