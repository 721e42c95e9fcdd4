#!/usr/bin/env bash
# The main job: bridge a real long prompt between the two daemons.
#
# Installs the engines and prepares the model (both cached under the repo),
# builds the daemons, starts decoded and prefilld from deploy/examples/ with a
# fresh store, sends one long prompt (this repository's LICENSE, ~2,400
# tokens, and a question) through decoded's front door bridged, then forced
# native, prints both answers, and ends with one JSON line of results.
#
#   scripts/demo.sh [--model smollm2|gemma3-270m|qwen2.5-coder-1.5b|llama3|qwen3|…]   (default:
#   the embedded SmolLM2; gemma3-270m: the real Gemma 3 270M, a base model without a chat
#   template, asked through /v1/completions; qwen2.5-coder-1.5b: the real Qwen2.5-Coder-1.5B-Instruct
#   with its own chat template; other names are generated families, see scripts/make-tiny-model.py)
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-engines.sh
source scripts/model-args.sh "$@"
if [ ${#args[@]} -gt 0 ]; then echo "usage: scripts/demo.sh [--model NAME]" >&2; exit 2; fi
cargo build --workspace --bins --locked --release

run=var/demo
rm -rf "$run"
mkdir -p "$run"
# The example configs speak mutual TLS: a CA and one certificate per daemon (the CA is reused).
./target/release/pdbridge certs --out var/certs prefill-1 mac-1 >/dev/null
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

# A fresh store and sockets of its own, so earlier runs cannot help the demo.
export PDB_STORE__DIR="$run/store" PDB_ENGINE__SOCKET="$run/engine.sock" PDB_ENGINE__MODEL="$decoder_model"
export PDB_STORE__BLOCK_TOKENS="$block_tokens" PDB_FRONT__MIN_BRIDGE_TOKENS="$block_tokens"
./target/release/decoded --config deploy/examples/decoded.toml >"$run/decoded.log" 2>&1 &
pids+=($!)
unset PDB_STORE__DIR PDB_ENGINE__SOCKET PDB_ENGINE__MODEL PDB_STORE__BLOCK_TOKENS PDB_FRONT__MIN_BRIDGE_TOKENS
export PDB_ENGINE__PLUGIN_SOCKET="$run/plugin.sock" PDB_ENGINE__MODEL="$prefill_model" PDB_ENGINE__DTYPE="$prefill_dtype"
./target/release/prefilld --config deploy/examples/prefilld.toml >"$run/prefilld.log" 2>&1 &
pids+=($!)
unset PDB_ENGINE__PLUGIN_SOCKET PDB_ENGINE__MODEL PDB_ENGINE__DTYPE

wait_ready() {
  local name=$1 admin=$2 deadline=$((SECONDS + 900))
  until curl -sf "http://127.0.0.1:$admin/readyz" >/dev/null; do
    if (( SECONDS > deadline )); then
      echo "$name did not become ready; its log:" >&2; tail -40 "$run/$name.log" >&2; exit 1
    fi
    sleep 1
  done
  echo "== $name ready" >&2
}
wait_ready decoded 9470
wait_ready prefilld 9471

api=chat
[ "$chat" = 1 ] || api=completions
.venv/bin/python scripts/demo_client.py --url http://127.0.0.1:8080 --document LICENSE --api "$api"
