#!/usr/bin/env bash
# The test suite: installs what it needs (idempotent, cached under the repo),
# builds the daemons, and runs every test against the real binaries.
set -euo pipefail
cd "$(dirname "$0")/.."

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
# The generated model families the end-to-end tests bridge (seconds each, idempotent).
for family in llama3 qwen3 gemma3 deepseek_v3 gpt_oss qwen3_next deepseek_v41; do
  .venv/bin/python scripts/make-tiny-model.py --family "$family"
done
cargo build --workspace --bins --locked
cargo nextest run --workspace --locked --no-fail-fast "$@"
# The engine adapters' own tests, on the real engines (unittest: the engines'
# environment has no pytest).
.venv/bin/python -m unittest discover -s common/engine/tests
.venv/bin/python -m unittest discover -s decoded/engine/tests
.venv/bin/python -m unittest discover -s prefilld/engine/tests
