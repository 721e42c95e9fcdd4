#!/usr/bin/env bash
# Prepares a model pair by name and prints its two folders and the prefill dtype:
#   <decoder folder (mlx-lm)> <prefill folder (HF, vLLM)> <vLLM dtype>
# `smollm2` is the test model (scripts/prepare-model.py); any other name is a family
# of scripts/make-tiny-model.py (generated deterministically). Used by the demo and
# the benchmarks' --model flag.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: scripts/model-folders.sh smollm2|<make-tiny-model family>}
if [ "$model" = smollm2 ]; then
  .venv/bin/python scripts/prepare-model.py >&2
  echo "models/smollm2-mlx models/smollm2-hf float32"
  exit 0
fi
.venv/bin/python scripts/make-tiny-model.py --family "$model" >&2
hf=models/tiny-$model-hf
# The dtype the prefill folder was written for (vLLM's MLA on CPU needs bf16).
dtype=$(.venv/bin/python -c 'import json, sys; print(json.load(open(sys.argv[1])).get("torch_dtype", "float32"))' "$hf/config.json")
echo "models/tiny-$model-mlx $hf $dtype"
