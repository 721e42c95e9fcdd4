#!/usr/bin/env bash
# The test suite in two tiers; installs what they need (idempotent, cached under the repo) and
# builds the daemons first.
#   scripts/test.sh [all]    both tiers (the README's test command, what CI runs)
#   scripts/test.sh fast     unit tests, the daemons on a fixed spec (no engine), the cache codec's
#                            conformance and the contracts' golden files: a few minutes
#   scripts/test.sh engines  end to end on the real engines (vLLM and mlx-lm) and the engine
#                            adapters' own suites
# Arguments after the tier go to cargo nextest (e.g. a test name filter).
# Each tier prints its time; `all` prints both at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

tier=all
case "${1:-}" in
  all|fast|engines) tier=$1; shift ;;
esac

scripts/setup-engines.sh
scripts/setup-prometheus.sh
# deploy/check.sh verifies the service units with systemd-analyze.
if ! command -v systemd-analyze >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq systemd >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq systemd; }
  else
    echo "test.sh: systemd-analyze is missing; install Debian's systemd package" >&2
    exit 1
  fi
fi
# The models (one core of Python) while the daemons build.
models_log=$(mktemp)
scripts/prepare-test-models.sh >"$models_log" 2>&1 &
models_pid=$!
cargo build --workspace --bins --locked
if ! wait "$models_pid"; then
  cat "$models_log" >&2
  echo "test.sh: preparing the models failed" >&2
  exit 1
fi
cat "$models_log" >&2
rm -f "$models_log"

# One stream of Python suites, named by "folder pattern" pairs in one word list (unittest: the
# engines' environment has no pytest); every one runs, the status says whether all passed.
py_suites() {
  local pairs status=0 i
  read -rd "" -a pairs <<<"$1" || true  # splits at white space without expanding the patterns
  for (( i = 0; i + 1 < ${#pairs[@]}; i += 2 )); do
    .venv/bin/python -m unittest discover -s "${pairs[i]}" -p "${pairs[i + 1]}" || status=1
  done
  return "$status"
}

# A tier: each stream of Python suites in `streams` in the background beside the nextest tests of
# filter $1 (whose groups, .config/nextest.toml, say what runs at once); the CPU decoder computes on
# one core, so the streams keep the machine's cores busy. The suites' output is shown when all end.
tier() {
  local filter=$1 status=0 logs=() pids=() stream i
  shift
  for stream in "${streams[@]}"; do
    logs+=("$(mktemp)")
    py_suites "$stream" >"${logs[-1]}" 2>&1 &
    pids+=($!)
  done
  cargo nextest run --workspace --locked --no-fail-fast -E "$filter" "$@" || status=$?
  for i in "${!pids[@]}"; do
    wait "${pids[i]}" || status=$?
    echo "test.sh: the Python suites, stream $(( i + 1 )) of ${#pids[@]}:" >&2
    cat "${logs[i]}" >&2
    rm -f "${logs[i]}"
  done
  return "$status"
}

# The fast tier's suites in two streams: the chat tokenizer's (every tokenizer under models/) takes
# as long as the rest together, and the nextest tests mostly wait on their daemons.
fast() {
  streams=("decoded/engine/tests test_chat.py"
           "common/engine/tests test_*.py decoded/engine/tests test_golden.py
            decoded/engine/tests test_stop_text.py prefilld/engine/tests test_params.py
            prefilld/engine/tests test_capture.py prefilld/engine/tests test_streamer.py
            prefilld/engine/tests test_link.py prefilld/engine/tests test_kv_quant.py
            prefilld/engine/tests test_ring.py prefilld/engine/tests test_kv_quant_fused.py
            bench/gpu test_carry.py")
  tier 'not binary(engines)' "$@"
}

engines() {
  streams=("decoded/engine/tests test_adapter.py prefilld/engine/tests test_plugin.py
            prefilld/engine/tests test_reconstruct.py prefilld/engine/tests test_deepseek_v41*.py")
  tier 'binary(engines)' "$@"
}

times=()
run_tier() {
  local name=$1 start=$SECONDS
  shift
  echo "test.sh: $name tier" >&2
  "$name" "$@"
  times+=("$name $(( SECONDS - start )) s")
  echo "test.sh: $name tier passed in $(( SECONDS - start )) s" >&2
}

case "$tier" in
  all) run_tier fast "$@"; run_tier engines "$@" ;;
  *) run_tier "$tier" "$@" ;;
esac
echo "test.sh: tiers: $(IFS=,; echo "${times[*]}" | sed 's/,/, /g')" >&2
