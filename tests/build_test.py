"""BUILD names a target for every source and test file, with existing deps."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIRS = ('fedcg_tff', 'tasks', 'binaries', 'benchmarks', 'tests')
_RULE = re.compile(r'^(py_library|py_binary|py_test)\(\n(.*?)^\)', re.S | re.M)


def _list(body, attr):
  m = re.search(rf'^\s*{attr} = \[(.*?)\]', body, re.S | re.M)
  return re.findall(r'"([^"]+)"', m.group(1)) if m else []


def _targets():
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


def _source_files():
  for d in SOURCE_DIRS:
    for name in sorted(os.listdir(os.path.join(ROOT, d))):
      if name.endswith('.py') and name != '__init__.py':
        yield f'{d}/{name}'


def _missing(targets, files):
  covered = {s for t in targets.values() for s in t['srcs']}
  return [f for f in files if f not in covered]


def test_every_source_file_has_a_target():
  missing = _missing(_targets(), _source_files())
  assert not missing, f'BUILD has no target for {missing}'


def test_every_test_file_is_a_py_test():
  targets = _targets()
  kinds = {s: t['kind'] for t in targets.values() for s in t['srcs']}
  for f in _source_files():
    if f.startswith('tests/') and f.endswith('_test.py'):
      assert kinds[f] == 'py_test', f


def test_srcs_exist_and_deps_resolve():
  targets = _targets()
  pinned = _pinned()
  assert len(targets) >= 10
  for name, t in targets.items():
    for src in t['srcs']:
      assert os.path.isfile(os.path.join(ROOT, src)), (name, src)
    for dep in t['local_deps']:
      assert dep in targets, f'{name} depends on missing target :{dep}'
    for req in t['requirements']:
      assert req.lower().replace('_', '-') in pinned, (
          f'{name} requires {req}, which requirements.txt does not pin')


def test_check_reports_a_file_without_target():
  # Guard against a vacuous check: drop one target, its file is reported.
  targets = _targets()
  files = list(_source_files())
  del targets['networks']
  assert _missing(targets, files) == ['fedcg_tff/networks.py']


if __name__ == '__main__':
  raise SystemExit(pytest.main([__file__]))
