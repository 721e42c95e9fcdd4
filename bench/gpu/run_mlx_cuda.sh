#!/usr/bin/env bash
# Runs bench/gpu/mlx_cuda.py on a lent GPU machine that cannot fetch packages: MLX's CUDA backend
# and the test model travel with the working tree, in parts, since one call carries at most 64 MiB.
#
#   bench/gpu/run_mlx_cuda.sh prepare        here: .gpu-carry/part-*, each under 60 MB (git-ignored)
#   then, on the GPU machine, one call per part, back to back (the machine stays warm between them),
#   each carrying .gpu-carry holding only that part:
#       mkdir -p /tmp/stage && cp .gpu-carry/part-* /tmp/stage/
#   and with the last part, then in a next call (each at most 10 minutes):
#       bench/gpu/run_mlx_cuda.sh remote throughput    unpacks, measures, writes $OUT/throughput.json
#       bench/gpu/run_mlx_cuda.sh remote fidelity      writes $OUT/fidelity.json
#
# What travels: the mlx (cp312) and mlx-lm wheels, the cache codec's (pdbridge-cache, built from
# this checkout's common/engine), mlx-cuda-13's files with libmlx.so stripped (xz), and SmolLM2-135M
# 4-bit (the test model's weights; its scales and biases in fp16, as a Mac's 4-bit models keep
# them). The machine's own torch and NVIDIA libraries serve the rest.
set -euo pipefail
cd "$(dirname "$0")/../.."
MLX=0.32.4
MLX_LM=0.32.2

case "${1:-}" in
prepare)
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  py=.venv/bin/python
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 -d "$work/wheels" "mlx==$MLX" "mlx-cuda-13==$MLX" "mlx-lm==$MLX_LM"
  cp -r common/engine "$work/codec"  # built from a copy: setuptools leaves build files beside the source
  "$py" -m pip wheel --quiet --no-deps --no-build-isolation -w "$work/wheels" "$work/codec"
  mkdir "$work/cuda" "$work/bundle"
  (cd "$work/cuda" && unzip -q "$work"/wheels/mlx_cuda_13-*.whl && strip --strip-unneeded mlx/lib/libmlx.so)
  rm "$work"/wheels/mlx_cuda_13-*.whl
  "$py" - "$work/bundle/smollm2" <<'PY'
import json, shutil, sys
from pathlib import Path
import mlx.core as mx
src, dst = Path("models/smollm2-mlx"), Path(sys.argv[1])
dst.mkdir(parents=True)
weights = {k: v.astype(mx.float16) if v.dtype == mx.float32 and k.endswith((".scales", ".biases")) else v
           for k, v in mx.load(str(src / "model.safetensors")).items()}
mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    shutil.copy(src / name, dst / name)
PY
  mv "$work/wheels" "$work/bundle/"
  tar -C "$work" -cf - cuda bundle | xz -9e -T0 > "$work/carry.tar.xz"
  rm -rf .gpu-carry && mkdir .gpu-carry
  split -b 60000000 -d "$work/carry.tar.xz" .gpu-carry/part-
  ls -la .gpu-carry
  ;;
remote)
  what=${2:?remote throughput|fidelity}
  stage=/tmp/stage site=/tmp/site
  mkdir -p "$stage"
  cp .gpu-carry/part-* "$stage/" 2>/dev/null || true
  if [ ! -d "$site/mlx_lm" ]; then  # the first measurement of this machine unpacks
    cat "$stage"/part-* | xz -d | tar -C "$stage" -xf -
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$stage"/bundle/wheels/*.whl
    cp -r "$stage"/cuda/. "$site"/
  fi
  libs=$(python3 -c 'import nvidia, os; print(":".join(os.path.join(p, d, "lib") for p in nvidia.__path__ for d in os.listdir(p) if os.path.isdir(os.path.join(p, d, "lib"))))')
  export PYTHONPATH="$site" LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}" PYTHONUNBUFFERED=1
  python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
  model=()
  [ "$what" != fidelity ] || model=(--model "$stage/bundle/smollm2")
  python3 bench/gpu/mlx_cuda.py "$what" "${model[@]}" --out "$OUT" "${@:3}" 2>&1 | tee "$OUT/$what.log"
  ;;
*)
  echo "usage: bench/gpu/run_mlx_cuda.sh prepare|remote" >&2
  exit 2
  ;;
esac
