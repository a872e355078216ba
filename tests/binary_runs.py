"""Runs one of our absl binaries the way a user does: a fresh interpreter
from the repository root, output captured, a time limit; and which TFF
workers it started."""

import os
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BinaryRun:
  """A running binary whose output goes to temporary files (no pipe to
  fill up while `wait` polls it)."""

  def __init__(self, module: str, args, cwd: str = ROOT, env=None):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=ROOT,
               **(env or {}))
    self._out = tempfile.TemporaryFile('w+')
    self._err = tempfile.TemporaryFile('w+')
    self.proc = subprocess.Popen(
        [sys.executable, '-m', f'binaries.{module}', *args], cwd=cwd,
        env=env, stdout=self._out, stderr=self._err, text=True)

  def wait(self, timeout: float = 600):
    """(CompletedProcess, the pids of the TFF workers it started, seen by
    polling its descendants while it ran)."""
    workers = set()
    deadline = time.time() + timeout
    while self.proc.poll() is None:
      if time.time() > deadline:
        self.proc.kill()
        raise subprocess.TimeoutExpired(self.proc.args, timeout)
      try:
        workers |= {p.pid for p in psutil.Process(
            self.proc.pid).children(recursive=True)
                    if p.name() == 'worker_binary'}
      except psutil.Error:
        pass
      time.sleep(0.2)
    self._out.seek(0)
    self._err.seek(0)
    done = subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                       self._out.read(), self._err.read())
    self._out.close()
    self._err.close()
    return done, workers


def run_binary(module: str, args, timeout: float = 600,
               cwd: str = ROOT) -> subprocess.CompletedProcess:
  """`python -m binaries.<module> *args` (text output, TF logs quiet)."""
  return BinaryRun(module, args, cwd).wait(timeout)[0]
