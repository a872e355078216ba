#!/usr/bin/env bash
# The main job in one command: FedCG on real Fashion-MNIST (4 clients x 2000
# images) with a budget that finishes in minutes, after setting up what is
# missing (setup.sh: the venv, the pinned stack, Debian's dataset).
# Rerunning continues an interrupted run or reports the finished one.
# Extra flags go to binaries.run_fedcg; flags that change the run need a new
# directory, e.g. FEDCG_OUTPUT_DIR=runs/fmnist_10_rounds ./train_fmnist.sh --rounds=10
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh --if-needed
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
exec .venv/bin/python -m binaries.run_fedcg \
    --output_dir="${FEDCG_OUTPUT_DIR:-runs/fmnist_quickstart}" \
    --rounds=5 --local_epochs=1 --gan_epochs=1 --server_epochs=1 "$@"
