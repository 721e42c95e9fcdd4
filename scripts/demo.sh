#!/usr/bin/env bash
# The main job: builds both daemons, starts them from the example configs on
# loopback, shows that each answers health and metrics, and stops them cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-engines.sh
cargo build --workspace --bins --locked --release
run=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$run"' EXIT

start() {
  local name=$1 grpc=$2 admin=$3
  ./target/release/"$name" --config deploy/examples/"$name".toml \
    --grpc-listen "127.0.0.1:$grpc" --admin-listen "127.0.0.1:$admin" 2>"$run/$name.log" &
  echo $! > "$run/$name.pid"
  for _ in $(seq 50); do curl -sf "http://127.0.0.1:$admin/healthz" >/dev/null && return; sleep 0.1; done
  echo "$name did not start:" >&2; cat "$run/$name.log" >&2; exit 1
}

start decoded 7070 9470
start prefilld 7071 9471
for pair in decoded:9470 prefilld:9471; do
  name=${pair%%:*} admin=${pair##*:}
  echo "== $name: /healthz $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$admin/healthz")," \
       "/readyz $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$admin/readyz")"
  curl -s "http://127.0.0.1:$admin/metrics" | grep '^pdbridge_'
done
for name in prefilld decoded; do
  kill -TERM "$(cat "$run/$name.pid")"
  wait "$(cat "$run/$name.pid")" && echo "== $name stopped cleanly (exit 0)"
done
