#!/usr/bin/env bash
# Decoders sharing their stores (see bench/peers.py): installs the engines, prepares the generated
# Llama 3, builds the release daemons, then replays the trace alone and with peers (~15 min on 2 cores).
#
#   bench/peers.sh [--users 4] [--turns 3] [--doc-tokens 1024] [--seed 7]
#
# Results: bench/results/peers.json; logs in var/bench-peers/<run>/<daemon>/.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
.venv/bin/python scripts/make-tiny-model.py --family llama3
exec .venv/bin/python bench/peers.py "$@"
