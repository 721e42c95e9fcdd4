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
# deploy/check.sh verifies the service units with systemd-analyze.
if ! command -v systemd-analyze >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq systemd >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq systemd; }
  else
    echo "test.sh: systemd-analyze is missing; install Debian's systemd package" >&2
    exit 1
  fi
fi
.venv/bin/python scripts/prepare-model.py
# The generated model families the tests bridge (seconds each, idempotent).
for family in llama3 qwen3 gemma3 deepseek_v3 gpt_oss qwen3_next deepseek_v41; do
  .venv/bin/python scripts/make-tiny-model.py --family "$family"
done
cargo build --workspace --bins --locked

# unittest: the engines' environment has no pytest.
py_suite() { .venv/bin/python -m unittest discover "$@"; }

fast() {
  cargo nextest run --workspace --locked --no-fail-fast -E 'not binary(engines)' "$@"
  py_suite -s common/engine/tests
  py_suite -s decoded/engine/tests -p 'test_golden.py'
  py_suite -s decoded/engine/tests -p 'test_stop_text.py'
  py_suite -s prefilld/engine/tests -p 'test_params.py'
}

# Two streams side by side, each mostly one core (the CPU decoder computes on one): the end-to-end
# tests, one at a time, and the engine adapters' own suites, whose output is shown when both end.
engines() {
  local status=0 py_log py_pid
  py_log=$(mktemp)
  { py_suite -s decoded/engine/tests -p 'test_adapter.py' && py_suite -s prefilld/engine/tests; } >"$py_log" 2>&1 &
  py_pid=$!
  cargo nextest run --workspace --locked --no-fail-fast -E 'binary(engines)' "$@" || status=$?
  wait "$py_pid" || status=$?
  echo "test.sh: the engine adapters' suites:" >&2
  cat "$py_log" >&2
  rm -f "$py_log"
  return "$status"
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
