#!/usr/bin/env bash
# Many users at once (see bench/concurrency.py): installs the engines, prepares the test model,
# builds the release daemons, then runs the rounds (~15-20 min on 2 cores).
#
#   bench/concurrency.sh [--prompt-tokens 512] [--max-tokens 64] [--users 1,4,8]
#
# Results: bench/results/concurrency.json; logs in var/bench-concurrency{,-serial}/.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
exec .venv/bin/python bench/concurrency.py "$@"
