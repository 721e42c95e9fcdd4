# Sourced by scripts/demo.sh and bench/run.sh (from the repo root, after setup-engines):
# takes `--model NAME` out of the arguments ("$@" -> the array `args`), prepares that model
# pair and sets `decoder_model` (mlx-lm folder), `prefill_model` (HF folder) and
# `prefill_dtype` (what vLLM computes in), `block_tokens` (the store's block: 256, or the
# smallest multiple of 256 that holds the model's sliding window, which a bridged block must) and
# `chat` (whether the model has a chat template). `smollm2` (the default) is the test model
# (scripts/prepare-model.py), `gemma3-270m` and `qwen2.5-coder-1.5b` the real Gemma 3 270M and
# Qwen2.5-Coder-1.5B-Instruct (scripts/prepare-gguf-model.py);
# any other name is a family of scripts/make-tiny-model.py.
model=smollm2
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --model) model=$2; shift 2 ;;
    --model=*) model=${1#*=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
case $model in
  smollm2)
    .venv/bin/python scripts/prepare-model.py
    decoder_model=models/smollm2-mlx prefill_model=models/smollm2-hf ;;
  gemma3-270m | qwen2.5-coder-1.5b)  # a real checkpoint from its GGUF (scripts/prepare-gguf-model.py)
    .venv/bin/python scripts/prepare-gguf-model.py --model "$model"
    decoder_model=models/$model-mlx prefill_model=models/$model-hf ;;
  *)
    .venv/bin/python scripts/make-tiny-model.py --family "$model"
    decoder_model=models/tiny-$model-mlx prefill_model=models/tiny-$model-hf
    if [ -d "models/tiny-$model" ]; then  # in its publisher's format: one folder both engines load
      decoder_model=models/tiny-$model prefill_model=models/tiny-$model
    fi ;;
esac
# The dtype the prefill folder was written for (vLLM's MLA on CPU needs bf16).
prefill_dtype=$(.venv/bin/python -c 'import json, sys; print(json.load(open(sys.argv[1])).get("torch_dtype", "float32"))' \
  "$prefill_model/config.json")
block_tokens=$(.venv/bin/python -c 'import json, sys; c = json.load(open(sys.argv[1])); c |= c.get("text_config", {})
w = c.get("sliding_window") or 0; print(max(256, -(-w // 256) * 256))' "$prefill_model/config.json")
chat=$(.venv/bin/python -c 'import json, sys; print(int(bool(json.load(open(sys.argv[1])).get("chat_template"))))' \
  "$decoder_model/tokenizer_config.json")
