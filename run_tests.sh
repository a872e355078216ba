#!/usr/bin/env bash
# Runs the test suite in .venv (made by setup.sh), then fails if any TFF
# worker_binary outlived it: a leftover worker holds output pipes open.
set -uo pipefail
cd "$(dirname "$0")"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
.venv/bin/python -m pytest -p no:cacheprovider -q tests "$@"
status=$?
if pgrep -f 'data/worker_binary' >/dev/null; then
  echo "run_tests.sh: worker_binary processes outlived the tests:" >&2
  pgrep -af 'data/worker_binary' >&2
  status=1
fi
exit $status
