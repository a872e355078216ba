"""The environment of a child interpreter that imports this repository.

The binaries start child runs (`run_experiments`' runs) and the benchmark a
child that times the matrix product; each child must import `fedcg_tff`
and `binaries` from this checkout whatever directory it starts in, so the
repository root goes first on its PYTHONPATH.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def environment(**overrides: str) -> dict:
  """This process's environment with `overrides` set and the repository
  root first on PYTHONPATH, ahead of this process's PYTHONPATH (a
  PYTHONPATH among `overrides` is ignored)."""
  env = dict(os.environ, **overrides)
  env['PYTHONPATH'] = os.pathsep.join(
      p for p in (ROOT, os.environ.get('PYTHONPATH')) if p)
  return env
