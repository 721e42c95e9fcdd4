#!/usr/bin/env bash
# What tracing costs a bridged request (see bench/traces.py): installs the engines, prepares the
# generated Llama 3, builds the release daemons, then measures traced and untraced requests side by
# side on one rig per length (~5 min on 2 cores).
#
#   bench/traces.sh [--lengths 1024,2048,4096,7000] [--repeats 6]
#
# Results: bench/results/traces.json; logs in var/bench-traces/<length>/<daemon>/.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
.venv/bin/python scripts/make-tiny-model.py --family llama3
exec .venv/bin/python bench/traces.py "$@"
