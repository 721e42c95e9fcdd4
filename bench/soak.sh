#!/usr/bin/env bash
# A bounded soak (see bench/soak.py): installs the engines, prepares the test model, builds the
# release daemons, then runs the soak.
#
#   bench/soak.sh [--minutes 10] [--every 10]
#
# Results: bench/results/soak.json; logs in var/bench-soak/.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
exec .venv/bin/python bench/soak.py "$@"
