#!/usr/bin/env bash
# Runs the test suite in .venv (set up first by setup.sh if anything is
# missing), then fails if any TFF worker_binary outlived it: a leftover
# worker holds output pipes open.
set -uo pipefail
cd "$(dirname "$0")"
./setup.sh --if-needed || exit 1
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
# Workers already running (another job's) are not the suite's.
before=" $(pgrep -f 'data/worker_binary' | tr '\n' ' ') "
# Two test processes, one per core of this machine kind (pytest-xdist).
# worksteal: a worker that runs out of tests takes pending ones from the
# other, so the long binary tests do not leave one core idle at the end.
.venv/bin/python -m pytest -p no:cacheprovider -q -n "${FEDCG_TEST_PROCESSES:-2}" \
    --dist worksteal tests "$@"
status=$?
left=""
for pid in $(pgrep -f 'data/worker_binary'); do
  case "$before" in *" $pid "*) ;; *) left="$left $pid";; esac
done
if [ -n "$left" ]; then
  echo "run_tests.sh: worker_binary processes outlived the tests:" >&2
  ps -o pid,args -p "$(echo $left | tr " " ",")" >&2
  status=1
fi
exit $status
