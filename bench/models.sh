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
for model in gemma3-270m qwen2.5-coder-1.5b; do
  .venv/bin/python scripts/prepare-gguf-model.py --model "$model"
done
cargo build --workspace --bins --locked --release
# MLX's CPU backend on Linux runs dense matmuls on a reference BLAS (~70x slower than OpenBLAS for
# the real checkpoints' fp32 weights): the engines' own OpenBLAS (opencv's wheel), for both daemons and
# the bench's in-process engine alike, so every side runs the same kernels.
LD_PRELOAD=$(ls .venv/lib/python3*/site-packages/opencv_python_headless.libs/libopenblas*.so | head -1)
export LD_PRELOAD
exec .venv/bin/python bench/models.py "$@"
