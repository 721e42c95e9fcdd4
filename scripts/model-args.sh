# Sourced by scripts/demo.sh and bench/run.sh (from the repo root, after setup-engines):
# takes `--model NAME` out of the arguments ("$@" -> the array `args`), prepares that model
# pair and sets `decoder_model` (mlx-lm folder), `prefill_model` (HF folder) and
# `prefill_dtype` (what vLLM computes in). `smollm2` (the default) is the test model
# (scripts/prepare-model.py); any other name is a family of scripts/make-tiny-model.py.
model=smollm2
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --model) model=$2; shift 2 ;;
    --model=*) model=${1#*=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ "$model" = smollm2 ]; then
  .venv/bin/python scripts/prepare-model.py
  decoder_model=models/smollm2-mlx prefill_model=models/smollm2-hf
else
  .venv/bin/python scripts/make-tiny-model.py --family "$model"
  decoder_model=models/tiny-$model-mlx prefill_model=models/tiny-$model-hf
fi
# The dtype the prefill folder was written for (vLLM's MLA on CPU needs bf16).
prefill_dtype=$(.venv/bin/python -c 'import json, sys; print(json.load(open(sys.argv[1])).get("torch_dtype", "float32"))' \
  "$prefill_model/config.json")
