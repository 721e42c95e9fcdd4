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

# Each tier's Python suites in streams, started in the background (the CPU decoder computes on one
# core, so the streams keep the machine's cores busy): their pids and logs by tier.
declare -A stream_pids=() stream_logs=()
start_streams() {
  local tier=$1 stream log
  shift
  for stream in "$@"; do
    log=$(mktemp)
    py_suites "$stream" >"$log" 2>&1 &
    stream_pids[$tier]+="$! "
    stream_logs[$tier]+="$log "
  done
}

# Waits for tier $1's streams and shows their output; the status says whether all passed.
wait_streams() {
  local name=$1 status=0 pids logs i
  read -ra pids <<<"${stream_pids[$name]:-}"
  read -ra logs <<<"${stream_logs[$name]:-}"
  for i in "${!pids[@]}"; do
    wait "${pids[i]}" || status=$?
    echo "test.sh: the $name tier's Python suites, stream $(( i + 1 )) of ${#pids[@]}:" >&2
    cat "${logs[i]}" >&2
    rm -f "${logs[i]}"
  done
  return "$status"
}

# A tier: its streams (`<name>_streams`, unless started earlier) beside the nextest tests of filter
# $2 (whose groups, .config/nextest.toml, say what runs at once).
tier() {
  local name=$1 filter=$2 status=0
  local -n suites="${name}_streams"
  shift 2
  [ -n "${stream_pids[$name]:-}" ] || start_streams "$name" "${suites[@]}"
  cargo nextest run --workspace --locked --no-fail-fast -E "$filter" "$@" || status=$?
  wait_streams "$name" || status=$?
  return "$status"
}

# The fast tier's suites in two streams: the chat tokenizer's (every tokenizer under models/) takes
# as long as the rest together, and the nextest tests mostly wait on their daemons.
fast_streams=("decoded/engine/tests test_chat.py"
              "common/engine/tests test_*.py decoded/engine/tests test_golden.py
               decoded/engine/tests test_stop_text.py prefilld/engine/tests test_params.py
               prefilld/engine/tests test_capture.py prefilld/engine/tests test_streamer.py
               prefilld/engine/tests test_link.py prefilld/engine/tests test_kv_quant.py
               prefilld/engine/tests test_ring.py prefilld/engine/tests test_kv_quant_fused.py
               bench/gpu test_carry.py")
engines_streams=("decoded/engine/tests test_adapter.py prefilld/engine/tests test_plugin.py
                 prefilld/engine/tests test_reconstruct.py prefilld/engine/tests test_deepseek_v41*.py")

fast() {
  tier fast 'not binary(engines)' "$@"
}

engines() {
  # A thread for each lane of .config/nextest.toml (a --test-threads argument still wins).
  NEXTEST_TEST_THREADS=3 tier engines 'binary(engines)' "$@"
}

times=()
run_tier() {
  local name=$1 start=$SECONDS status=0
  shift
  echo "test.sh: $name tier" >&2
  "$name" "$@" || status=$?
  times+=("$name $(( SECONDS - start )) s")
  [ "$status" = 0 ] || { echo "test.sh: $name tier failed in $(( SECONDS - start )) s" >&2; return "$status"; }
  echo "test.sh: $name tier passed in $(( SECONDS - start )) s" >&2
}

case "$tier" in
  # The engines' Python suites start with the fast tier, whose tests leave about half the CPU idle;
  # if it fails they are waited for, and the engines' nextest tests do not run.
  all)
    start_streams engines "${engines_streams[@]}"
    run_tier fast "$@" || { wait_streams engines || true; exit 1; }
    run_tier engines "$@" ;;
  *) run_tier "$tier" "$@" ;;
esac
echo "test.sh: tiers: $(IFS=,; echo "${times[*]}" | sed 's/,/, /g')" >&2
