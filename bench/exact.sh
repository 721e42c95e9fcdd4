#!/usr/bin/env bash
# Where the cache is computed, prefiller or decoder (see bench/exact.py): installs the engines,
# prepares the test model and the generated family checkpoints, builds the release daemons, then
# runs every row.
#
#   bench/exact.sh [--rows smollm2/float32,llama3/bfloat16,...] [--prompts 2]
#
# Results: bench/results/exact.json; logs in var/bench-exact/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-engines.sh
.venv/bin/python scripts/prepare-model.py
for family in llama3 qwen3 gemma3 deepseek_v3 gpt_oss; do
  .venv/bin/python scripts/make-tiny-model.py --family "$family"
done
cargo build --workspace --bins --locked --release
exec .venv/bin/python bench/exact.py "$@"
