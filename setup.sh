#!/usr/bin/env bash
# Installs everything fedcg-tff needs on a Debian machine with Python 3.11:
# the Debian Fashion-MNIST package (when apt is there and we may use it), a
# virtual environment in .venv, and the pinned stack of requirements.txt.
set -euo pipefail
cd "$(dirname "$0")"

# --if-needed: do nothing when .venv already holds this requirements.txt
# (run_tests.sh and train_fmnist.sh call it so; a plain run reinstalls).
MARKER=.venv/.installed-requirements
if [ "${1:-}" = "--if-needed" ] && [ -f "$MARKER" ] && \
   cmp -s "$MARKER" requirements.txt; then
  exit 0
fi

PYTHON=${PYTHON:-python3.11}
if ! command -v "$PYTHON" >/dev/null; then
  echo "setup.sh: $PYTHON not found; TFF 0.87 needs Python 3.9-3.11 (set PYTHON=...)" >&2
  exit 1
fi

if [ -d /usr/share/datasets/fashion-mnist ]; then
  echo "setup.sh: Fashion-MNIST already in /usr/share/datasets/fashion-mnist"
elif command -v apt-get >/dev/null; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  if $SUDO apt-get update -qq && \
     $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist; then
    echo "setup.sh: installed dataset-fashion-mnist"
  else
    echo "setup.sh: could not install dataset-fashion-mnist; use --data_dir or --data_source=tfds" >&2
  fi
else
  echo "setup.sh: no apt-get; real FMNIST runs need --data_dir or --data_source=tfds" >&2
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade 'pip==24.0'
# Every package is pinned in requirements.txt, so no resolver runs (see its
# header for why TFF cannot be installed with its own declared requirements).
.venv/bin/python -m pip install -q --no-deps -r requirements.txt
.venv/bin/python -c "from fedcg_tff.execution import runtime; import tensorflow_federated as tff; import matplotlib; import xdist; print('setup.sh: TFF', tff.__version__, 'ready in .venv')"
cp requirements.txt "$MARKER"
