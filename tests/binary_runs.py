"""Runs one of our absl binaries the way a user does: a fresh interpreter
from the repository root, output captured, a time limit; and which TFF
workers it started. Or `run_fedcg` in the test's own process
(`run_fedcg_in_process`), where what is checked is not about processes:
that saves the interpreter's start (TensorFlow's and TFF's import).

Only `run_fedcg` runs in-process: the binaries' absl flags share one
namespace, and the attack binaries define some of the same names.
"""

import os
import subprocess
import sys
import tempfile
import time

import psutil

from fedcg_tff.execution import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kill_tree(proc: subprocess.Popen) -> None:
  """Kills `proc` and every process under it: a binary stopped at a test's
  time limit must not leave its training subprocesses or TFF workers
  running into the rest of the suite. The tree is stopped (SIGSTOP) from
  the top down until a listing finds no new process, then killed: a
  process still running while the others are killed could start a worker
  nobody listed, and one whose parent died first would no longer be in the
  tree."""
  stopped, tried = [], set()
  try:
    frontier = [psutil.Process(proc.pid)]
    while frontier:
      for p in frontier:
        tried.add(p.pid)
        try:
          p.suspend()
          stopped.append(p)
        except psutil.Error:
          pass
      frontier = list({c.pid: c for p in stopped for c in _children(p)
                       if c.pid not in tried}.values())
  except psutil.Error:
    pass
  finally:
    proc.kill()
    for p in stopped:
      try:
        p.kill()
      except psutil.Error:
        pass
    proc.wait()


def _children(p: psutil.Process):
  try:
    return p.children(recursive=True)
  except psutil.Error:
    return []


class BinaryRun:
  """A running binary whose output goes to temporary files (no pipe to
  fill up while `wait` polls it)."""

  def __init__(self, module: str, args, cwd: str = ROOT, env=None):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=ROOT,
               **(env or {}))
    self.worker_fpmath = {}  # Filled by `wait`.
    self._out = tempfile.TemporaryFile('w+')
    self._err = tempfile.TemporaryFile('w+')
    self.proc = subprocess.Popen(
        [sys.executable, '-m', f'binaries.{module}', *args], cwd=cwd,
        env=env, stdout=self._out, stderr=self._err, text=True)

  def wait(self, timeout: float = 600):
    """(CompletedProcess, the pids of the TFF workers it started, seen by
    polling its descendants while it ran). `worker_fpmath` then maps each
    worker seen to the TF_SET_ONEDNN_FPMATH_MODE it was started with
    (None: unset; `execution.precision`)."""
    workers = set()
    self.worker_fpmath = {}
    deadline = time.time() + timeout
    while self.proc.poll() is None:
      if time.time() > deadline:
        kill_tree(self.proc)
        raise subprocess.TimeoutExpired(self.proc.args, timeout)
      for p in runtime.worker_processes(self.proc.pid):
        workers.add(p.pid)
        if p.pid not in self.worker_fpmath:
          try:
            self.worker_fpmath[p.pid] = p.environ().get(
                'TF_SET_ONEDNN_FPMATH_MODE')
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


def alive(pid: int) -> bool:
  """Whether process `pid` runs (a zombie has ended: it waits only to be
  reaped)."""
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def run_binary(module: str, args, timeout: float = 600,
               cwd: str = ROOT) -> subprocess.CompletedProcess:
  """`python -m binaries.<module> *args` (text output, TF logs quiet)."""
  return BinaryRun(module, args, cwd).wait(timeout)[0]


def run_fedcg_in_process(args):
  """`binaries.run_fedcg.main` in this process with these flags; returns the
  usage error or exit message it stops with (None if it ran through).

  TF's global seed is cleared first, as in a fresh `run_fedcg` process:
  tf.data's seeded shuffles depend on it, and earlier tests in this
  process may have set it (tasks/image_task.py).
  """
  # Imported here: the flags are defined only where a test runs the binary.
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from binaries import run_fedcg  # pylint: disable=g-import-not-at-top
  tf.random.set_seed(None)
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    try:
      argv = flags.FLAGS(['run_fedcg', *args])
      run_fedcg.main(argv)
    except (app.UsageError, flags.Error) as e:
      return str(e)
    except SystemExit as e:
      return str(e.code)
  return None


_MAIN_CALLS = """
import json, sys
from absl import app, flags
from absl.testing import flagsaver
import importlib
binary = importlib.import_module('binaries.' + sys.argv[1])
for args in json.loads(sys.argv[2]):
  # Each call starts as a fresh process would: no global TF seed left by
  # the call before (tf.data's seeded shuffles depend on it).
  if 'tensorflow' in sys.modules:
    sys.modules['tensorflow'].random.set_seed(None)
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    try:
      binary.main(flags.FLAGS([sys.argv[1], *args]))
      stopped = None
    except (app.UsageError, flags.Error) as e:
      stopped = str(e)
    except SystemExit as e:
      stopped = str(e.code)
  print('MAIN_CALL', json.dumps(stopped), flush=True)
"""


def main_calls(module: str, arg_lists, timeout: float = 600,
               cwd: str = ROOT):
  """`binaries.<module>.main` called once per flag list, in turn, in one
  fresh interpreter (one import of TensorFlow and TFF for them all), run
  from `cwd`.

  Returns (the usage error or exit message each call stopped with, or None
  if it ran through; the CompletedProcess, whose stdout has a line
  `MAIN_CALL <stop>` after each call's output). Each call starts with TF's
  global seed cleared, as `run_fedcg_in_process` does. For binaries that
  cannot run in the test's own process (see the module docstring).
  """
  import json  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=ROOT)
  args = [sys.executable, '-c', _MAIN_CALLS, module, json.dumps(arg_lists)]
  proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    kill_tree(proc)
    raise
  done = subprocess.CompletedProcess(args, proc.returncode, out, err)
  stops = [json.loads(line.split(' ', 1)[1])
           for line in done.stdout.splitlines()
           if line.startswith('MAIN_CALL ')]
  return stops, done
