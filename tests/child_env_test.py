"""The child interpreters' environment: this checkout importable first."""

import os
import subprocess
import sys

from fedcg_tff.execution import child_env


def test_root_goes_first_and_the_callers_path_stays(monkeypatch, tmp_path):
  monkeypatch.setenv('PYTHONPATH', str(tmp_path))
  env = child_env.environment(TF_CPP_MIN_LOG_LEVEL='2')
  assert env['PYTHONPATH'] == os.pathsep.join([child_env.ROOT, str(tmp_path)])
  assert env['TF_CPP_MIN_LOG_LEVEL'] == '2'
  assert os.environ['PYTHONPATH'] == str(tmp_path)  # Not changed here.
  monkeypatch.delenv('PYTHONPATH')
  assert child_env.environment()['PYTHONPATH'] == child_env.ROOT


def test_a_child_started_elsewhere_imports_this_checkout(tmp_path):
  done = subprocess.run(
      [sys.executable, '-c', 'import fedcg_tff; print(fedcg_tff.__file__)'],
      cwd=tmp_path, env=child_env.environment(), capture_output=True,
      text=True, timeout=60, check=True)
  assert done.stdout.strip() == os.path.join(child_env.ROOT, 'fedcg_tff',
                                             '__init__.py')
