#!/usr/bin/env bash
# Model-family conformance (see bench/models.py): installs the engines, prepares the test model and
# the generated family checkpoints, builds the release daemons, then runs every family row.
#
#   bench/models.sh [--rows smollm2,llama3,...] [--prompts 8]
#
# Results: bench/results/models.json and MODELS.md; logs in var/bench-models/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-engines.sh
.venv/bin/python scripts/prepare-model.py
for family in llama3 llama3-dense qwen3 gemma3 deepseek_v3 gpt_oss qwen3_next deepseek_v41 deepseek_v41_flash; do
  .venv/bin/python scripts/make-tiny-model.py --family "$family"
done
cargo build --workspace --bins --locked --release
exec .venv/bin/python bench/models.py "$@"
