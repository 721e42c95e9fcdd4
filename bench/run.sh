#!/usr/bin/env bash
# The bridge benchmark, end to end: build the release daemons, start decoded and
# prefilld from deploy/examples/ with a fresh store under var/bench/, wait for
# both /readyz, run bench/bridge.py (arguments pass through, e.g.
# `--lengths 512,1024,2048`), then stop both daemons with SIGTERM.
#
#   bench/run.sh [--model smollm2|llama3|qwen3|…] [--lengths 512,1024,2048,4096] [--out bench/results]
#                [--no-midblock] [--budget-s N]
#
# Results: bench/results/bridge.json and bridge_ttft.png; the daemons' logs
# stay in var/bench/. See BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-engines.sh
source scripts/model-args.sh "$@"
cargo build --workspace --bins --locked --release

run=var/bench
# The example configs listen on fixed ports: refuse to start beside other daemons.
for admin in 9470 9471; do
  if curl -sf -o /dev/null "http://127.0.0.1:$admin/healthz"; then
    echo "bench: something already serves 127.0.0.1:$admin (another decoded/prefilld?); stop it first" >&2
    exit 1
  fi
done
rm -rf "$run"
mkdir -p "$run"
# The example configs speak mutual TLS: a CA and one certificate per daemon (the CA is reused).
./target/release/pdbridge certs --out var/certs prefill-1 mac-1 >/dev/null
pids=()
cleanup() {
  local status=$? pid
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  # Each daemon ran in a process group of its own (setsid): anything an engine
  # left behind in it (vLLM's EngineCore and workers outlive a killed API
  # server) is ended too, first politely.
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  sleep 2
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  echo "== daemons stopped" >&2
  exit "$status"
}
trap cleanup EXIT INT TERM

# A fresh store, sockets and bundle cache of its own: no earlier run can help.
PDB_STORE__DIR="$run/store" PDB_ENGINE__SOCKET="$run/engine.sock" PDB_ENGINE__MODEL="$decoder_model" \
  setsid ./target/release/decoded --config deploy/examples/decoded.toml >"$run/decoded.log" 2>&1 &
pids+=($!)
PDB_ENGINE__PLUGIN_SOCKET="$run/plugin.sock" PDB_ENGINE__BUNDLE_DIR="$run/bundles" \
  PDB_ENGINE__MODEL="$prefill_model" PDB_ENGINE__DTYPE="$prefill_dtype" setsid ./target/release/prefilld --config deploy/examples/prefilld.toml >"$run/prefilld.log" 2>&1 &
pids+=($!)

wait_ready() {
  local name=$1 admin=$2 deadline=$((SECONDS + 900))
  until curl -sf -o /dev/null "http://127.0.0.1:$admin/readyz"; do
    if (( SECONDS > deadline )) || ! kill -0 "${pids[$3]}" 2>/dev/null; then
      echo "$name did not become ready; its log:" >&2; tail -40 "$run/$name.log" >&2; exit 1
    fi
    sleep 1
  done
  echo "== $name ready after ${SECONDS}s" >&2
}
wait_ready decoded 9470 0
wait_ready prefilld 9471 1

.venv/bin/python bench/bridge.py --url http://127.0.0.1:8080 --decoded-log "$run/decoded.log" ${args[@]+"${args[@]}"}
