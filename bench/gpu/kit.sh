#!/usr/bin/env bash
# The GPU kit: both daemons on a lent CUDA machine that reaches no package registry, started as a
# user starts them (certificates from `pdbridge certs`, mutual TLS, deploy/examples/ configs).
#
#   bench/gpu/kit.sh prepare          here (x86-64 Linux): .gpu-carry/ parts of <= 60 MB (git-ignored);
#                                     V41=1 DEEPGEMM_SRC=<DeepGEMM 2.6.1 source .tgz> adds 2 v41-* parts:
#                                     DeepSeek-V4.1's sm90 needs over the image's torch 2.11 (8 parts in all)
#   bench/gpu/kit.sh dry-run          here, after a V41=1 prepare: the V4.1 session rehearsed without a GPU
#                                     (bench/gpu/v41_dry_run.py: imports, vLLM's config and weight loading)
#   then on the GPU machine, one call per part, back to back (it stays warm ~30 s between calls),
#   each carrying that one part:  bench/gpu/kit.sh remote stage
#   and then, in later calls:     bench/gpu/kit.sh remote unpack     (once per machine)
#                                 bench/gpu/kit.sh remote start      (daemons, left running)
#                                 bench/gpu/kit.sh remote e2e [bridge.py args]
#                                 bench/gpu/kit.sh remote stop
#                                 bench/gpu/kit.sh remote mlx-cuda throughput|fidelity [args]
#                                   (bench/gpu/mlx_cuda.py, MLX's CUDA backend alone: the pdb-* parts suffice)
#                                 bench/gpu/kit.sh remote prefill-box bridged [4bit|dense] [host|device|auto] [args]
#                                 bench/gpu/kit.sh remote prefill-box native [args]
#                                   (bench/gpu/prefill_box.py on bench/gpu/llama8b.py's model; results
#                                   kept in var/gpu-8b/results across calls, copied to $OUT)
#                                 bench/gpu/kit.sh remote v41 native|start|bridged   (with the V4.1 parts: DeepSeek-V4.1
#                                   at full width, 4 layers; results in var/gpu-v41/results, copied to $OUT;
#                                   vLLM with --moe-backend marlin --language-model-only --enforce-eager
#                                   --kernel-config '{"enable_jit_warmup": false}', VLLM_USE_V2_MODEL_RUNNER=0,
#                                   VLLM_USE_FLASHINFER_SAMPLER=0)
# `start` passes PDB_* variables on to both daemons; DECODED_CONFIG and PREFILLD_CONFIG name other
# configs, STORE_DIR another store (e.g. on /dev/shm); prefill-box's KV_BITS quantizes the
# decoder's KV cache (engine.kv_bits: 8 or 4, the bytes a block carries halved or quartered); LINK_GBPS holds
# prefilld's Push to that rate (stream.link_gbps: a 10 GbE link to the Mac); STREAM_CONNECTIONS prefilld's
# Push connections (default 4, the CUDA example's: 2026-12-04 on the H200, 2 -> 4 took 128K from
# 22.1 to 19.2 s and 8 did little more; PDB_STREAM__* would reach decoded too, which has no [stream]
# and refuses it).
# Measured on the lent H200 (2026-12-03): the machine's start takes 3-6 of its 30 held minutes and
# it goes back after 30 s idle, so have every call ready before the first. A call per part ~6-15 s;
# unpack + start + e2e over 8 prompts 167-241 s; prefill-box bridged at 8K/32K/128K 193 s
# (llama8b.py 27 s the first time); native --eager 130 s, native in vLLM's default mode 163 s.
#
# What travels:
#   v32-*  vLLM 0.32.0's CUDA wheel without what an sm90 Llama-class run never loads (FlashAttention 2,
#          vllm-rs, DeepGEMM, the sm100 kernels) and the runtime dependencies the image lacks
#          (bench/gpu/vllm-deps.txt); vLLM's native ops use only torch's stable C ABI, so it runs
#          over the image's torch 2.11 with --no-deps.
#   v41-*  (V41=1) TileLang 0.1.12 and what it imports that the image lacks (bench/gpu/deepseek-v41-deps.txt),
#          DeepGEMM 2.6.1's source (DEEPGEMM_SRC) and the cute/cutlass headers of vLLM's wheel: `unpack`
#          builds DeepGEMM there over the image's torch 2.11 (vLLM's vendored 2.8 links torch 2.13's C++
#          ABI) into the site as `deep_gemm`, which vLLM imports before its own. FlashInfer, CuTe DSL,
#          quack and cuda-python stay behind: vLLM gates each off sm90, with a fallback.
#   pdb-*  mlx + mlx-lm, mlx-cuda-13's files (libmlx.so stripped), protobuf (the generated modules'
#          runtime), this checkout's Python packages as wheels, the release binaries built here,
#          and the test model's decoder folder (scales and biases fp16, as GGUF's Q4_1 holds them:
#          fp16 -> fp32 is exact, so `unpack` restores the rig's folder bit for bit: bench/gpu/carry.py,
#          tested by bench/gpu/test_carry.py in the fast tier). vLLM's folder
#          is rebuilt there from it with prepare-model's own dequantization (modelkit.build_hf).
# On the machine, .venv/bin/python becomes the image's python3 with the kit's packages first on
# its path (the engines' environment a CUDA box gets from `setup-engines.sh --profile cuda`).
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM=0.32.0
MLX=0.32.4
MLX_LM=0.32.2
PROTOBUF=7.36.2
PART_BYTES=60M  # MiB: a part and the working tree stay under the 64 MiB a call carries
kit=/tmp/pdb-kit

platforms() {
  local p
  printf -- '--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64'
  for p in 17 18 24 27 28 31 34 35; do printf -- ' --platform manylinux_2_%s_x86_64' "$p"; done
}

# V41=1 needs DeepGEMM 2.6.1's source (upstream commit 54e2261, MIT; cutlass and cute left out: they
# come from vLLM's wheel) as a .tgz whose top folder holds csrc/python_api.cpp and deep_gemm/.
deepgemm_source_ok() {
  [ -n "${DEEPGEMM_SRC:-}" ] || { echo "kit: V41=1 needs DEEPGEMM_SRC=<DeepGEMM 2.6.1 source .tgz>" >&2; exit 1; }
  [ -f "$DEEPGEMM_SRC" ] || { echo "kit: DEEPGEMM_SRC=$DEEPGEMM_SRC: no such file" >&2; exit 1; }
  # grep reads the whole listing (-q would end tar with SIGPIPE, a failure under pipefail).
  tar tzf "$DEEPGEMM_SRC" 2>/dev/null | grep '^[^/]*/csrc/python_api\.cpp$' >/dev/null ||
    { echo "kit: DEEPGEMM_SRC=$DEEPGEMM_SRC has no <top>/csrc/python_api.cpp: not DeepGEMM's source" >&2; exit 1; }
}

prepare() {
  local py=.venv/bin/python
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  [ -x "$py" ] || { echo "kit: run scripts/setup-engines.sh first" >&2; exit 1; }
  [ -z "${V41:-}" ] || deepgemm_source_ok
  scripts/setup-engines.sh >/dev/null
  "$py" scripts/prepare-model.py >/dev/null
  cargo build --release --locked --bins
  rm -rf .gpu-carry && mkdir -p .gpu-carry "$work/v/wheels" "$work/p/wheels" "$work/p/bin" "$work/p/cuda"
  # shellcheck disable=SC2046
  "$py" -m pip download -q --no-deps $(platforms) -d "$work/v/wheels" "vllm==$VLLM" -r bench/gpu/vllm-deps.txt
  if [ -n "${V41:-}" ]; then
    # DeepSeek-V4.1 on sm90 over the image's torch 2.11: TileLang and what it imports that the image
    # lacks (bench/gpu/deepseek-v41-deps.txt), DeepGEMM's source (built on the machine by `unpack`)
    # and the cute/cutlass headers its build and JIT include, taken from vLLM's wheel before the
    # v32 parts drop its vendored DeepGEMM.
    mkdir -p "$work/d/wheels" "$work/d/deepgemm"
    # shellcheck disable=SC2046
    "$py" -m pip download -q --no-deps $(platforms) -d "$work/d/wheels" -r bench/gpu/deepseek-v41-deps.txt
    cp "$DEEPGEMM_SRC" "$work/d/deepgemm/src.tgz"
    unzip -q "$work"/v/wheels/vllm-$VLLM-*.whl 'vllm/third_party/deep_gemm/include/cute/*' \
      'vllm/third_party/deep_gemm/include/cutlass/*' -d "$work/d/headers"
    mv "$work/d/headers/vllm/third_party/deep_gemm/include" "$work/d/deepgemm/include" && rm -r "$work/d/headers"
    (cd "$work/d" && tar cf - wheels deepgemm) | split -b "$PART_BYTES" -d - .gpu-carry/v41-
  fi
  zip -q -d "$work"/v/wheels/vllm-$VLLM-*.whl 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' \
    'vllm/third_party/deep_gemm/*' 'vllm/third_party/fmha_sm100/*'
  (cd "$work/v" && tar cf - wheels) | split -b "$PART_BYTES" -d - .gpu-carry/v32-
  # shellcheck disable=SC2046
  "$py" -m pip download -q --no-deps $(platforms) --platform manylinux_2_35_x86_64 -d "$work/p/wheels" \
    "mlx==$MLX" "mlx-cuda-13==$MLX" "mlx-lm==$MLX_LM" "protobuf==$PROTOBUF"
  (cd "$work/p/cuda" && unzip -q "$work"/p/wheels/mlx_cuda_13-*.whl && strip --strip-unneeded mlx/lib/libmlx.so)
  rm "$work"/p/wheels/mlx_cuda_13-*.whl
  for package in common/engine prefilld/engine decoded/engine; do
    cp -r "$package" "$work/src"  # built from a copy: setuptools leaves build files beside the source
    "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$work/p/wheels" "$work/src"
    rm -rf "$work/src"
  done
  cp target/release/{decoded,prefilld,pdbridge} "$work/p/bin/" && strip "$work"/p/bin/*
  "$py" bench/gpu/carry.py pack models/smollm2-mlx "$work/p/smollm2-mlx"
  tar -C "$work/p" -cf - . | xz -6 -T0 | split -b "$PART_BYTES" -d - .gpu-carry/pdb-
  ls -la .gpu-carry
}

# The calls that carry the parts: each copies its part where `unpack` finds them all.
stage() {
  mkdir -p "$kit/parts"
  cp .gpu-carry/* "$kit/parts/"
  ls -la "$kit/parts"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sys, torch, google.protobuf as p; print(sys.version.split()[0], torch.__version__, "protobuf", p.__version__)'
}

unpack() {
  local py libs
  if [ ! -e "$kit/site/mlx" ]; then
    rm -rf "$kit/site" "$kit/tree" && mkdir -p "$kit/tree"
    if compgen -G "$kit/parts/v32-*" >/dev/null; then cat "$kit"/parts/v32-* | tar x -C "$kit/tree"; fi
    cat "$kit"/parts/pdb-* | xz -d | tar x -C "$kit/tree"
    if compgen -G "$kit/parts/v41-*" >/dev/null; then cat "$kit"/parts/v41-* | tar x -C "$kit/tree"; fi
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$kit/site" "$kit"/tree/wheels/*.whl
    cp -r "$kit"/tree/cuda/. "$kit/site/"
  fi
  [ ! -d "$kit/tree/deepgemm" ] || deepgemm
  mkdir -p target/release models .venv/bin .venv/lib/python3.12
  cp "$kit"/tree/bin/* target/release/
  py=$(command -v python3)
  # The NVIDIA libraries of the wheels on the path ahead of the system's.
  libs=$(PYTHONPATH="$kit/site" "$py" -c 'import nvidia, os; print(":".join(os.path.join(p, d, "lib") for p in nvidia.__path__ for d in sorted(os.listdir(p)) if os.path.isdir(os.path.join(p, d, "lib"))))')
  cat >.venv/bin/python <<EOF
#!/bin/sh
export PYTHONPATH="$kit/site\${PYTHONPATH:+:\$PYTHONPATH}" LD_LIBRARY_PATH="$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$py" "\$@"
EOF
  chmod +x .venv/bin/python
  ln -sfn "$kit/site" .venv/lib/python3.12/site-packages  # where bench/bridge.py finds license texts
  if [ ! -e models/smollm2-hf/config.json ]; then
    # modelkit (scripts/) is the rig's own dequantization.
    .venv/bin/python bench/gpu/carry.py unpack "$kit/tree/smollm2-mlx" models/smollm2-mlx
    mkdir -p models/smollm2-hf
    PYTHONPATH=scripts .venv/bin/python -c 'import sys; from pathlib import Path; from modelkit import build_hf
build_hf(Path(sys.argv[1]), Path(sys.argv[2]))' models/smollm2-hf models/smollm2-mlx
  fi
  .venv/bin/python -c 'import mlx.core as mx, mlx_lm, pdbridge_mlx; print("mlx", mx.__version__, mx.default_device())'
  [ ! -e "$kit/site/vllm" ] || .venv/bin/python -c 'import vllm, pdbridge_vllm; print("vllm", vllm.__version__)'
  # With the V4.1 parts: the modules its CUDA path loads, each named if it fails.
  [ ! -e "$kit/site/tilelang" ] || .venv/bin/python -c 'import importlib
for m in ("tilelang", "deep_gemm", "vllm._flashmla_C", "vllm.models.deepseek_v41.nvidia.model",
          "pdbridge_vllm.deepseek_v41_cuda"):
    try: importlib.import_module(m); print("v41 import ok:", m)
    except Exception as e: print("v41 import FAILED:", m, repr(e)[:300])'
}

# DeepGEMM 2.6.1 built on the machine over its torch (2.11) and CUDA (13.0): the two g++ lines that
# built it there on 2026-12-06 (35 s), installed in the kit's site as `deep_gemm`, which vLLM
# imports before its vendored copy (dropped from the v32 parts: it links torch 2.13's C++ ABI).
# Its kernels JIT at first use with nvcc (CUDA_HOME) and include deep_gemm/include, where the
# cute/cutlass headers of vLLM's wheel go. Once per machine: a built one is kept.
deepgemm() {
  local build=$kit/deepgemm src torch pyinc so cuda
  so=$(python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
  if [ -e "$kit/site/deep_gemm/$so" ]; then echo "kit: deep_gemm built before" >&2; return 0; fi
  cuda=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
  torch=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
  pyinc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  rm -rf "$build" && mkdir -p "$build"
  tar xzf "$kit/tree/deepgemm/src.tgz" -C "$build"
  src=$(dirname "$(dirname "$(ls "$build"/*/csrc/python_api.cpp)")")
  cp -r "$kit"/tree/deepgemm/include/. "$src/deep_gemm/include/"
  local started=$SECONDS
  if ! (cd "$src" &&
    g++ -std=c++17 -O3 -fPIC -Wno-psabi -Wno-deprecated-declarations -D_GLIBCXX_USE_CXX11_ABI=1 \
      -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -I"$cuda/include" -I"$cuda/include/cccl" \
      -Ideep_gemm/include -Ithird-party/fmt/include -I"$torch/include" -I"$torch/include/torch/csrc/api/include" \
      -I"$pyinc" -c csrc/python_api.cpp -o "$build/api.o" &&
    g++ -shared "$build/api.o" -o "deep_gemm/$so" -L"$torch/lib" -lc10 -ltorch -ltorch_cpu -ltorch_python \
      -lc10_cuda -ltorch_cuda -L"$cuda/lib64" -lcudart -lnvrtc -Wl,-rpath,"$cuda/lib64"); then
    echo "kit: DeepGEMM's build FAILED (g++ over torch $torch, CUDA $cuda, Python.h in $pyinc): V4.1 cannot run" >&2
    return 1
  fi
  rm -rf "$kit/site/deep_gemm" && cp -r "$src/deep_gemm" "$kit/site/deep_gemm"
  echo "kit: deep_gemm built in $(( SECONDS - started )) s" >&2
}

run=var/gpu
start() {
  local name
  stop
  rm -rf "$run" && mkdir -p "$run"
  ./target/release/pdbridge certs --out var/certs prefill-1 mac-1 >/dev/null
  # The decoder: MLX's CUDA backend (its default device once mlx-cuda is installed). Its CPU backend
  # on these cores computes a prompt's native prefill at a few hundred tokens/s (fp32 emulated on
  # x86), which would make the native answers the run's cost; the adapter's code is the same.
  PDB_STORE__DIR="${STORE_DIR:-$run/store}" PDB_ENGINE__SOCKET="$run/engine.sock" \
    setsid ./target/release/decoded --config "${DECODED_CONFIG:-deploy/examples/decoded.toml}" >"$run/decoded.log" 2>&1 &
  PDB_ENGINE__PLUGIN_SOCKET="$run/plugin.sock" PDB_ENGINE__BUNDLE_DIR="$run/bundles" \
    setsid ./target/release/prefilld --config "${PREFILLD_CONFIG:-deploy/examples/prefilld-cuda.toml}" >"$run/prefilld.log" 2>&1 &
  for name in decoded:9470 prefilld:9471; do
    until curl -sf -o /dev/null "http://127.0.0.1:${name#*:}/readyz"; do
      if ! pgrep -f "target/release/${name%%:*} " >/dev/null || (( SECONDS > 480 )); then
        echo "kit: ${name%%:*} did not become ready" >&2; tail -60 "$run/${name%%:*}.log" >&2; return 1
      fi
      sleep 2
    done
    echo "kit: ${name%%:*} ready after $SECONDS s" >&2
  done
}

stop() {
  local pid
  for pid in $(pgrep -f 'target/release/(decoded|prefilld) ' || true); do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for _ in $(seq 60); do pgrep -f 'target/release/(decoded|prefilld) ' >/dev/null || return 0; sleep 1; done
  pkill -KILL -f 'target/release/(decoded|prefilld) ' || true
}

e2e() {
  local out=${OUT:-var/gpu/out}
  mkdir -p "$out"
  set +e
  PYTHONUNBUFFERED=1 .venv/bin/python bench/bridge.py --decoded-log "$run/decoded.log" --no-midblock --out "$out" "$@"
  local status=$?
  set -e
  xz -c "$run/prefilld.log" >"$out/prefilld.log.xz"
  xz -c "$run/decoded.log" >"$out/decoded.log.xz"
  return $status
}

# bench/gpu/mlx_cuda.py; its fidelity mode reads the test model as it travels (scales fp16, as a
# Mac's 4-bit models keep them).
mlx_cuda() {
  local what=${1:?remote mlx-cuda throughput|fidelity} model=()
  [ "$what" != fidelity ] || model=(--model "$kit/tree/smollm2-mlx")
  PYTHONUNBUFFERED=1 .venv/bin/python bench/gpu/mlx_cuda.py "$what" "${model[@]}" --out "${OUT:-var/gpu/out}" "${@:2}"
}

# Both daemons' configs for a prefill box on one GPU, derived from deploy/examples/: the decoder's
# folder, vLLM's, the plugin's handoff, vLLM's share of the GPU; bf16 and 128K prompts.
box_configs() {
  local box=$1 decoder=$2 prefill=$3 handoff=$4 share=$5 kv=() link=() async=()
  [ -z "${KV_BITS:-}" ] || kv=(-e "s|^# kv_bits = .*|kv_bits = $KV_BITS|")
  # ASYNC_SCHEDULING=1: vLLM's default async scheduling, which the example config turns off.
  [ -z "${ASYNC_SCHEDULING:-}" ] || async=(-e 's|, "--no-async-scheduling"||')
  # LINK_GBPS: prefilld's Push held to that rate (stream.link_gbps), the link to a Mac emulated.
  [ -z "${LINK_GBPS:-}" ] || link=(-e "s|^\[stream\]|[stream]\nlink_gbps = $LINK_GBPS|")
  sed -e "s|^model = .*|model = \"$decoder\"|" -e 's|^dtype = .*|dtype = "bfloat16"|' "${kv[@]}" \
    -e 's|^budget_bytes = .*|budget_bytes = 48000000000|' deploy/examples/decoded.toml >"$box/decoded.toml"
  sed -e "s|^model = .*|model = \"$prefill\"|" -e 's|^dtype = .*|dtype = "bfloat16"|' \
    -e 's|^max_model_len = .*|max_model_len = 135168|' -e "s|\"--gpu-memory-utilization\", \"0.5\"|\"--gpu-memory-utilization\", \"$share\"|" \
    -e "s|^handoff = .*|handoff = \"$handoff\"|" \
    -e "s|^connections = .*|connections = ${STREAM_CONNECTIONS:-4}|" "${link[@]}" "${async[@]}" deploy/examples/prefilld-cuda.toml >"$box/prefilld.toml"
}

# prefill_box.py's native phase under `limit` seconds, its tables and log in `results`: vLLM alone
# (VLLM_PLUGINS empty: without the plugin's model classes).
vllm_alone() {
  local limit=$1 results=$2
  shift 2
  VLLM_PLUGINS= VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=bench PYTHONUNBUFFERED=1 timeout "$limit" \
    .venv/bin/python bench/gpu/prefill_box.py native --out "$results" "$@" 2>&1 | tee -a "$results/native.log"
  return "${PIPESTATUS[0]}"
}

# The prefill box at real shape. `bridged` restarts both daemons on the 8B-shaped model (the
# decoder 4-bit, or dense: the bf16 prefill folder, which mlx-lm loads as it is; the plugin's
# handoff host, device or auto) with configs derived from deploy/examples/; `native` stops them, so
# vLLM alone has the GPU, and times it on the token ids of the first bridged run's prompts.
prefill_box() {
  local phase=${1:?remote prefill-box bridged [4bit|dense] [host|device|auto]|native} setting=4bit
  local decoder=models/llama8b-mlx handoff=auto box=var/gpu-8b status=0 prompts
  # Inside the device's 600 s a call: what was measured is copied out even when time runs out.
  local limit=${PREFILL_BOX_LIMIT:-480}
  shift
  mkdir -p "$box/results"
  .venv/bin/python bench/gpu/llama8b.py
  set +e
  if [ "$phase" = native ]; then
    stop
    prompts=$(ls "$box"/results/*/prompts.json | head -1)
    vllm_alone "$limit" "$box/results" --prompts "$prompts" "$@"
    status=$?
  else
    case "${1:-}" in 4bit | dense) setting=$1; shift ;; esac
    case "${1:-}" in host | device | auto) handoff=$1; shift ;; esac
    [ "$setting" = 4bit ] || decoder=models/llama8b-hf
    box_configs "$box" "$decoder" models/llama8b-hf "$handoff" 0.7
    setting=$setting${KV_BITS:+-kv$KV_BITS}${LINK_GBPS:+-link$LINK_GBPS}${ASYNC_SCHEDULING:+-async}-$handoff
    DECODED_CONFIG="$box/decoded.toml" PREFILLD_CONFIG="$box/prefilld.toml" start &&
      PYTHONPATH=bench PYTHONUNBUFFERED=1 timeout "$limit" \
        .venv/bin/python bench/gpu/prefill_box.py bridged --out "$box/results/$setting" "$@" 2>&1 |
      tee "$box/results/bridged-$setting.log"
    status=${PIPESTATUS[0]}
    cp "$run/prefilld.log" "$run/decoded.log" "$box/results/$setting/" 2>/dev/null
  fi
  set -e
  cp -r "$box/results/." "${OUT:-var/gpu/out}/"
  return $status
}

# DeepSeek-V4.1 at full width and 4 layers (bench/gpu/deepseek_v41_wide.py, one folder both engines
# load), at LENGTHS (default 16K, 64K, 128K): `native` times vLLM's own CUDA class alone (eager, as
# the capture route runs; no plugin); `bridged` runs the bridged box (vLLM's class with the capture,
# the plugin's MLX reconstruction, decoded on MLX's CUDA backend) on prefill_box.py, then
# bench/bridge.py's bridged vs native answers at ANSWER_LENGTHS (default 16K); `start` only starts
# the bridged box's daemons (left running for a later `bridged` call: a call has 600 s).
# vLLM's V4.1 class on sm90 (BENCHMARKS.md): Marlin's MXFP4 kernels for the fp4 experts, the text
# model only (no vision tower), eager (the capture route's mode: prefilld passes it too), no
# JIT warm-up at start; V1's runner (the plugin's hooks) and vLLM's own sampler (no FlashInfer).
V41_KERNEL_CONFIG='{"enable_jit_warmup": false}'
V41_ARGS=(--moe-backend marlin --language-model-only --enforce-eager --kernel-config "$V41_KERNEL_CONFIG")
V41_ENGINE_ARGS='{"moe_backend": "marlin", "language_model_only": true, "kernel_config": '"$V41_KERNEL_CONFIG"'}'
# CUDA_HOME: where DeepGEMM's kernels JIT at first use (its nvcc).
export_v41_env() {
  export VLLM_USE_V2_MODEL_RUNNER=0 VLLM_USE_FLASHINFER_SAMPLER=0
  CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
  export CUDA_HOME
}

v41_start() {
  local box=$1 model=$2 arg args=""
  box_configs "$box" "$model" "$model" auto 0.5
  # The test model's tokenizer is SmolLM2's, not DeepSeek's: vLLM's V4.1 prompt encoder left out
  # (prefilld sends token ids). The arguments as TOML literal strings (the kernel config's quotes).
  for arg in --tokenizer-mode hf "${V41_ARGS[@]}"; do args+="'$arg', "; done
  sed -i "s|^extra_args = \[|extra_args = [$args|" "$box/prefilld.toml"
  grep '^extra_args' "$box/prefilld.toml" >&2
  DECODED_CONFIG="$box/decoded.toml" PREFILLD_CONFIG="$box/prefilld.toml" start
}

v41() {
  local phase=${1:?remote v41 native|start|bridged} model=models/deepseek-v41-wide box=var/gpu-v41 status=0
  local lengths=${LENGTHS:-16384,65536,131072} limit=${V41_LIMIT:-480}
  shift
  mkdir -p "$box/results"
  .venv/bin/python bench/gpu/deepseek_v41_wide.py
  export_v41_env  # prefilld's CUDA example sets both for its engine too ([engine.env])
  set +e
  if [ "$phase" = native ]; then
    stop
    vllm_alone "$limit" "$box/results" --model "$model" --lengths "$lengths" --eager --tokenizer-mode hf \
      --engine-args "$V41_ENGINE_ARGS" "$@"
    status=$?
  elif [ "$phase" = start ]; then
    v41_start "$box" "$model"
    status=$?
    cp "$run/prefilld.log" "$run/decoded.log" "$box/results/" 2>/dev/null
  else
    # Daemons a `v41 start` call left ready are used as they are: the start alone takes minutes.
    { curl -sf -o /dev/null http://127.0.0.1:9470/readyz && curl -sf -o /dev/null http://127.0.0.1:9471/readyz; } ||
      v41_start "$box" "$model" &&
      PYTHONPATH=bench PYTHONUNBUFFERED=1 timeout "$limit" .venv/bin/python bench/gpu/prefill_box.py bridged \
        --lengths "$lengths" --out "$box/results/bridged" "$@" 2>&1 | tee "$box/results/bridged.log" &&
      PYTHONUNBUFFERED=1 timeout "${ANSWER_LIMIT:-180}" .venv/bin/python bench/bridge.py --decoded-log "$run/decoded.log" \
        --no-midblock --lengths "${ANSWER_LENGTHS:-16384}" --out "$box/results/answers" 2>&1 | tee "$box/results/answers.log"
    status=${PIPESTATUS[0]}
    cp "$run/prefilld.log" "$run/decoded.log" "$box/results/" 2>/dev/null
  fi
  set -e
  # What comes back is at most 8 files: the results as one archive, and the tables beside it.
  local out=${OUT:-var/gpu/out}
  mkdir -p "$out" && tar -C "$box" -czf "$out/v41-results.tgz" results
  find "$box/results" -name '*.json' ! -name prompts.json -exec cp {} "$out/" \; -exec cat {} \;
  return $status
}

# The V4.1 device session rehearsed on this machine, no GPU (bench/gpu/v41_dry_run.py says what it
# proves): vLLM's CUDA wheel and the V4.1 parts' wheels from .gpu-carry/ installed as `unpack`
# installs them, into DRY_KIT; the parts' wheels built for the device's Python 3.12 alone are
# fetched again for this Python, with CCCL's headers for the build; DeepGEMM built by `unpack`'s own
# function over this Python's torch, the CUDA wheels' headers as CUDA_HOME; then the script.
# DRY_PYTHON: the Python whose torch it runs over (the engines' .venv; a torch 2.11 one is closer to
# the device's), DRY_PATH: more of its path (its other packages).
dry_run() {
  local py=${DRY_PYTHON:-.venv/bin/python} w nv cu
  kit=${DRY_KIT:-/tmp/pdb-v41-dry}
  compgen -G ".gpu-carry/v41-*" >/dev/null || { echo "kit: dry-run reads the V4.1 parts: V41=1 ... prepare first" >&2; exit 1; }
  if [ ! -e "$kit/site/vllm" ]; then
    rm -rf "$kit" && mkdir -p "$kit/tree" "$kit/bin" "$kit/cuda/lib64" "$kit/stub"
    cat .gpu-carry/v32-* | tar x -C "$kit/tree" && cat .gpu-carry/v41-* | tar x -C "$kit/tree"
    # shellcheck disable=SC2046
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$kit/here" "nvidia-cuda-cccl==13.0.85" \
      "$(grep -h '^apache-tvm-ffi==' bench/gpu/vllm-deps.txt)" $(grep -h '^\(ml-dtypes\|torch-c-dlpack-ext\)==' bench/gpu/deepseek-v41-deps.txt)
    for w in "$kit"/tree/wheels/vllm-*.whl "$kit"/tree/wheels/{tilelang,z3,cloudpickle,ml_dtypes,torch_c_dlpack,apache_tvm}*.whl \
      "$kit"/here/*.whl; do
      "$py" -m pip install -q --no-index --no-deps --no-compile --target "$kit/site" "$w" 2>/dev/null ||
        echo "kit: dry-run: $(basename "$w") is not for this Python (its copy for this one is)" >&2
    done
    # No driver here: a libcuda.so.1 whose every entry point vLLM's native ops link answers
    # CUDA_ERROR_NO_DEVICE (100), so they load and their torch symbols resolve.
    nm -D --undefined-only "$kit"/site/vllm/*.so | awk '$2 ~ /^cu[A-Z]/ {print "int " $2 "(void) { return 100; }"}' |
      sort -u >"$kit/stub/cuda.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$kit/stub/libcuda.so.1" "$kit/stub/cuda.c"
  fi
  printf '#!/bin/sh\nPYTHONPATH="%s" LD_LIBRARY_PATH="%s" exec "%s" "$@"\n' "$kit/site:prefilld/engine:common/engine${DRY_PATH:+:$DRY_PATH}" \
    "$kit/stub" "$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" >"$kit/bin/python3" && chmod +x "$kit/bin/python3"
  # CUDA_HOME for DeepGEMM's build: the CUDA wheels' headers and libraries merged, and Triton's copy
  # of the compiler's (crt/, which cuda_runtime.h includes); no nvcc runs here, nothing JITs.
  mkdir -p "$kit/cuda/include"
  for nv in $(PATH="$kit/bin:$PATH" python3 -c 'import nvidia, os, triton
print(*(os.path.join(p, "cu13") for p in nvidia.__path__), os.path.join(os.path.dirname(triton.__file__), "backends/nvidia"))'); do
    for w in "$nv"/include/*; do [ ! -e "$w" ] || [ -e "$kit/cuda/include/${w##*/}" ] || ln -s "$w" "$kit/cuda/include/"; done
    for cu in cudart nvrtc; do [ ! -e "$nv/lib/lib$cu.so.13" ] || ln -sfn "$nv/lib/lib$cu.so.13" "$kit/cuda/lib64/lib$cu.so"; done
  done
  [ -d "$kit/tree/deepgemm" ] && PATH="$kit/bin:$PATH" CUDA_HOME="$kit/cuda" deepgemm
  PATH="$kit/bin:$PATH" CUDA_HOME="$kit/cuda" PYTHONUNBUFFERED=1 python3 bench/gpu/v41_dry_run.py "$@"
}

case "${1:-}" in
  prepare) prepare ;;
  dry-run) shift; dry_run "$@" ;;
  remote)
    shift
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    case "${1:-}" in
      stage | unpack | start | stop) "$1" ;;
      e2e) shift; e2e "$@" ;;
      mlx-cuda) shift; mlx_cuda "$@" ;;
      prefill-box) shift; prefill_box "$@" ;;
      v41) shift; v41 "$@" ;;
      *) echo "usage: bench/gpu/kit.sh remote stage|unpack|start|e2e|stop|mlx-cuda|prefill-box|v41" >&2; exit 2 ;;
    esac ;;
  *) echo "usage: bench/gpu/kit.sh prepare | dry-run | remote stage|unpack|start|e2e|stop|mlx-cuda|prefill-box|v41" >&2; exit 2 ;;
esac
