"""The Bazel targets the sources imply: one per file, its local deps from its
imports, its third-party deps mapped to requirements.txt names.

`tests/build_test.py` checks BUILD against this (every file has a target,
every import is a dep); `python -m tests.build_graph > BUILD` writes a
BUILD that passes it (the header and rules below are the whole file).
"""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIRS = ('fedcg_tff', 'tasks', 'binaries', 'benchmarks', 'tests')
# Import name -> requirements.txt name, for third-party packages.
REQUIREMENTS = {
    'absl': 'absl-py', 'attrs': 'attrs', 'dp_accounting': 'dp-accounting',
    'grpc': 'grpcio', 'matplotlib': 'matplotlib', 'numpy': 'numpy',
    'PIL': 'pillow', 'psutil': 'psutil', 'pytest': 'pytest', 'scipy': 'scipy',
    'tensorflow': 'tensorflow', 'tensorflow_datasets': 'tensorflow-datasets',
    'tensorflow_federated': 'tensorflow-federated',
    'tensorflow_privacy': 'tensorflow-privacy', 'tree': 'dm-tree',
}
_LOCAL = SOURCE_DIRS
_NAMES = {'tasks/options.py': 'task_options'}


def source_files() -> list[str]:
  """Every .py file but __init__.py, repository-relative, sorted."""
  found = []
  for top in SOURCE_DIRS:
    for d, _, files in os.walk(os.path.join(ROOT, top)):
      for name in files:
        if name.endswith('.py') and name != '__init__.py':
          found.append(os.path.relpath(os.path.join(d, name), ROOT))
  return sorted(found)


def target_name(path: str) -> str:
  return _NAMES.get(path, os.path.basename(path)[:-3])


def kind(path: str) -> str:
  base = os.path.basename(path)
  if path.startswith('tests/') and base.endswith('_test.py'):
    return 'py_test'
  if path.startswith('benchmarks/') or (
      path.startswith('binaries/') and base != 'common.py'):
    return 'py_binary'
  return 'py_library'


def _module_file(module: str) -> str | None:
  """The source file of a dotted local module (None: a package or not
  ours)."""
  path = module.replace('.', '/') + '.py'
  return path if os.path.isfile(os.path.join(ROOT, path)) else None


def imports(path: str) -> tuple[set[str], set[str]]:
  """(local source files, third-party requirement names) `path` imports."""
  with open(os.path.join(ROOT, path)) as f:
    tree = ast.parse(f.read())
  local, third = set(), set()
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names = [node.module] + [f'{node.module}.{a.name}' for a in node.names]
    for name in names:
      top = name.split('.')[0]
      if top in _LOCAL:
        found = _module_file(name)
        if found and found != path:
          local.add(found)
      elif top in REQUIREMENTS:
        third.add(REQUIREMENTS[top])
  return local, third


def binaries_run(path: str) -> set[str]:
  """Binaries `path` starts as processes (tests: `run_binary('name')`,
  `BinaryRun('name')`, `main_calls('name', ...)`, or a command line with
  `-m binaries.name`; binaries/common.py starts run_fedcg)."""
  with open(os.path.join(ROOT, path)) as f:
    tree = ast.parse(f.read())
  found = set()
  for node in ast.walk(tree):
    if (isinstance(node, ast.Call) and node.args and
        isinstance(node.args[0], ast.Constant) and
        getattr(node.func, 'attr', getattr(node.func, 'id', '')) in
        ('run_binary', 'BinaryRun', 'main_calls')):
      found.add(node.args[0].value)
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and
          re.fullmatch(r'binaries\.\w+', node.value) and
          os.path.isfile(os.path.join(ROOT, *node.value.split('.')) + '.py')):
      found.add(node.value.split('.')[1])
  if path == 'binaries/common.py':
    found.add('run_fedcg')
  return found


def targets() -> dict[str, dict]:
  out = {}
  for path in source_files():
    local, third = imports(path)
    if kind(path) == 'py_test':
      local.add('tests/conftest.py')  # pytest loads it for every test.
    out[target_name(path)] = {
        'kind': kind(path), 'srcs': [path],
        'local_deps': sorted(target_name(p) for p in local),
        'requirements': sorted(third),
        'data': sorted(binaries_run(path)),
    }
  return out


_HEADER = '''\
# Bazel targets for every library, binary and test, one per source file.
# Third-party Python packages come from requirements.txt through
# rules_python's pip hub (`pip_deps`, declared in MODULE.bazel).
# tests/build_test.py checks that every source file has a target and that
# each target's deps cover what its file imports; `python -m
# tests.build_graph > BUILD` regenerates this file from the sources.

load("@pip_deps//:requirements.bzl", "requirement")
load("@rules_python//python:defs.bzl", "py_binary", "py_library", "py_test")

package(default_visibility = ["//visibility:public"])
'''


def _rule(name: str, t: dict) -> str:
  lines = [f'{t["kind"]}(', f'    name = "{name}",']
  path = t['srcs'][0]
  if t['kind'] == 'py_test':
    lines.append('    size = "large",' if t['data'] else '    size = "medium",')
  elif path.startswith('tests/'):
    lines.append('    testonly = True,')
  lines.append(f'    srcs = ["{path}"],')
  data = [f'":{b}"' for b in t['data']]
  if name == 'build_test':
    data = ['"BUILD"', 'glob([' + ', '.join(
        f'"{d}/**/*.py"' for d in SOURCE_DIRS) + '])']
  if name == 'build_test':
    lines.append(f'    data = [{data[0]}] + {data[1]},')
  elif data:
    lines.append('    data = [' + ', '.join(data) + '],')
  deps = ([f'":{d}"' for d in t['local_deps']] +
          [f'requirement("{r}")' for r in t['requirements']])
  if deps:
    lines.append('    deps = [\n' + ''.join(f'        {d},\n' for d in deps)
                 + '    ],')
  lines.append(')')
  return '\n'.join(lines)


def build_file() -> str:
  sections = [('fedcg_tff: the library', 'fedcg_tff/'),
              ('tasks: data sets and client splits', 'tasks/'),
              ('binaries', 'binaries/'), ('benchmarks', 'benchmarks/'),
              ('tests', 'tests/')]
  all_targets = targets()
  parts = [_HEADER]
  for title, prefix in sections:
    parts.append(f'# --- {title} ' + '-' * max(3, 72 - len(title)))
    for name, t in all_targets.items():
      if t['srcs'][0].startswith(prefix):
        parts.append(_rule(name, t))
  return '\n\n'.join(parts) + '\n'


if __name__ == '__main__':
  print(build_file(), end='')
