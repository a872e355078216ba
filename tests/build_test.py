"""BUILD names a target for every source and test file, and each target's
deps cover what its file imports (tests/build_graph.py derives them)."""

import os
import re

import pytest

from tests import build_graph

ROOT = build_graph.ROOT
_RULE = re.compile(r'^(py_library|py_binary|py_test)\(\n(.*?)^\)', re.S | re.M)


def _list(body, attr):
  m = re.search(rf'^\s*{attr} = \[(.*?)\]', body, re.S | re.M)
  return re.findall(r'"([^"]+)"', m.group(1)) if m else []


def _targets(text=None):
  if text is None:
    with open(os.path.join(ROOT, 'BUILD')) as f:
      text = f.read()
  targets = {}
  for kind, body in _RULE.findall(text):
    name = re.search(r'name = "([^"]+)"', body).group(1)
    assert name not in targets, f'duplicate target {name}'
    deps = _list(body, 'deps')
    targets[name] = {
        'kind': kind,
        'srcs': _list(body, 'srcs'),
        'local_deps': [d[1:] for d in deps if d.startswith(':')],
        'requirements': re.findall(r'requirement\("([^"]+)"\)', body),
        'data': [d[1:] for d in _list(body, 'data') if d.startswith(':')],
    }
  return targets


def _pinned():
  names = set()
  with open(os.path.join(ROOT, 'requirements.txt')) as f:
    for line in f:
      line = line.split('#')[0].strip()
      if line:
        names.add(re.split(r'[=<>~!]', line)[0].strip().lower().replace(
            '_', '-'))
  return names


def _missing(targets, files):
  covered = {s for t in targets.values() for s in t['srcs']}
  return [f for f in files if f not in covered]


def _uncovered(targets):
  """'target: needs X' for each import (or started binary) its deps lack."""
  by_src = {t['srcs'][0]: name for name, t in targets.items() if t['srcs']}
  problems = []
  for path, implied in ((t['srcs'][0], t) for t in
                        build_graph.targets().values()):
    name = by_src.get(path)
    if name is None:
      continue
    have = targets[name]
    for dep in implied['local_deps']:
      if dep not in have['local_deps']:
        problems.append(f'{name}: needs :{dep}')
    for req in implied['requirements']:
      if req not in have['requirements']:
        problems.append(f'{name}: needs requirement("{req}")')
    for binary in implied['data']:
      if binary not in have['data']:
        problems.append(f'{name}: needs data :{binary}')
  return problems


def test_every_source_file_has_a_target():
  missing = _missing(_targets(), build_graph.source_files())
  assert not missing, f'BUILD has no target for {missing}'
  # Subpackages are walked too.
  assert 'fedcg_tff/models/lenet.py' in build_graph.source_files()


def test_every_test_file_is_a_py_test():
  kinds = {s: t['kind'] for t in _targets().values() for s in t['srcs']}
  for f in build_graph.source_files():
    if f.startswith('tests/') and f.endswith('_test.py'):
      assert kinds[f] == 'py_test', f


def test_srcs_exist_and_deps_resolve():
  targets = _targets()
  pinned = _pinned()
  assert len(targets) >= 10
  for name, t in targets.items():
    for src in t['srcs']:
      assert os.path.isfile(os.path.join(ROOT, src)), (name, src)
    for dep in t['local_deps'] + t['data']:
      assert dep in targets, f'{name} depends on missing target :{dep}'
    for req in t['requirements']:
      assert req.lower().replace('_', '-') in pinned, (
          f'{name} requires {req}, which requirements.txt does not pin')


def test_deps_cover_every_import():
  assert _uncovered(_targets()) == []


def test_checks_report_a_missing_target_and_a_missing_dep():
  # Guard against vacuous checks: drop a target, its file is reported; drop
  # a dep, the import that needs it is reported.
  targets = _targets()
  del targets['lenet']
  assert _missing(targets, build_graph.source_files()) == [
      'fedcg_tff/models/lenet.py']
  targets = _targets()
  targets['families']['local_deps'].remove('lenet')
  targets['run_fedcg_test']['data'].remove('run_fedcg')
  # workers_test starts run_worker by its command line (`-m binaries...`).
  targets['workers_test']['data'].remove('run_worker')
  assert _uncovered(targets) == ['families: needs :lenet',
                                 'run_fedcg_test: needs data :run_fedcg',
                                 'workers_test: needs data :run_worker']


def test_generated_build_file_passes_these_checks():
  targets = _targets(build_graph.build_file())
  assert not _missing(targets, build_graph.source_files())
  assert _uncovered(targets) == []


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
