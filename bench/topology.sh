#!/usr/bin/env bash
# Real topologies (see bench/topology.py): installs the engines, prepares the test model and the
# generated Llama 3, builds the release daemons, then runs the rows (~40 min on 2 cores).
#
#   bench/topology.sh [--prompt-tokens 1024] [--prompts 4] [--rows tp1,tp2,pp1,pp2,two_prefillers,two_decoders]
#
# Results: bench/results/topology.json; logs in var/bench-topology/<row>/<daemon>/.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
.venv/bin/python scripts/make-tiny-model.py --family llama3
exec .venv/bin/python bench/topology.py "$@"
