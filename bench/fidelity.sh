#!/usr/bin/env bash
# Bridge fidelity (issue 4): same-input exactness, chunk independence, store round trip and
# end-to-end agreement bridged vs native vs plain transfer. In-process (vLLM server with the
# plugin + mlx-lm + HF transformers), no daemons. Heavy: holds /tmp/pdb-heavy.lock.
#
#   bench/fidelity.sh [--n 20] [--lengths 1024,2048,3072,4096,5120,6144] [--budget-s 3600]
#
# Writes bench/results/fidelity.json and bench/results/fidelity.md.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python || ! -f models/smollm2-hf/config.json ]]; then
  scripts/setup-engines.sh
  .venv/bin/python scripts/prepare-model.py
fi
exec flock /tmp/pdb-heavy.lock .venv/bin/python bench/fidelity.py "$@"
