#!/usr/bin/env bash
# Long prompts end to end (see bench/long_prompts.py): installs the engines, builds the
# release daemons and the generated long-context checkpoint, then runs the bench.
#
#   bench/long_prompts.sh [--lengths 16384,32768,65536,131072] [--native-max 32768]
#
# Results: bench/results/long_prompts.json; logs in var/bench-long/.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
.venv/bin/python scripts/make-tiny-model.py --family llama-long
exec .venv/bin/python bench/long_prompts.py "$@"
