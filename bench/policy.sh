#!/usr/bin/env bash
# The cost policy against always-native and always-bridge (see bench/policy.py): installs the
# engines, prepares the generated Llama 3, builds the release daemons, then runs the rows idle,
# loaded and over a slow link (~20 min on 2 cores).
#
#   bench/policy.sh [--lengths 512,1024,2048,4096] [--repeats 3] [--load 2] [--slow-gbps 0.01]
#
# Results: bench/results/policy.json; logs in var/bench-policy/<row>/<daemon>/.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
.venv/bin/python scripts/make-tiny-model.py --family llama3
exec .venv/bin/python bench/policy.py "$@"
