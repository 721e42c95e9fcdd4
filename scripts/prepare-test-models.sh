#!/usr/bin/env bash
# The checkpoints the tests bridge, all idempotent: the test model (SmolLM2 for each engine), the
# real Gemma 3 270M (~3 minutes the first time) and the generated families (seconds each). One core
# of Python each: `--no-gemma` leaves Gemma out, for a caller that converts it beside the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
"$py" scripts/prepare-model.py
[ "${1:-}" = --no-gemma ] || "$py" scripts/prepare-gguf-model.py --model gemma3-270m
"$py" scripts/make-tiny-model.py --family llama3 qwen3 gemma3 deepseek_v3 gpt_oss qwen3_next deepseek_v41 \
  deepseek_v41_flash
