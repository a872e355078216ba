"""Starting `binaries.run_fedcg` as a child process, the one way every
binary that trains through it (the sweep, the privacy report, the
comparison with the published code) does it."""

import os
import subprocess
import sys
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_fedcg(args: Sequence[str]) -> int:
  """Runs `python -m binaries.run_fedcg *args` in this interpreter, in this
  working directory (relative paths in `args` mean what they mean here),
  with the repository importable; returns its exit code."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (ROOT, os.environ.get('PYTHONPATH')) if p))
  return subprocess.call([sys.executable, '-m', 'binaries.run_fedcg',
                          *args], env=env)
