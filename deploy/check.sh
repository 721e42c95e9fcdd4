#!/usr/bin/env bash
# Validates the deployment files under deploy/ (for the test suite, and before shipping a change):
# runs check.py beside this script, whose docstring says what is checked.
#
# Usage: deploy/check.sh            exit 0 when everything passes, 1 with FAIL lines otherwise.
# Needs python3 (PYTHON= picks another) and systemd-analyze (Debian: apt-get install -y systemd).
# Without systemd-analyze it fails unless PDB_DEPLOY_CHECK_NO_SYSTEMD=1 (e.g. on macOS), which
# skips only that step.
set -uo pipefail

py=${PYTHON:-python3}
command -v "$py" >/dev/null 2>&1 || { echo "FAIL: $py not found (set PYTHON=)" >&2; exit 1; }
"$py" "$(dirname "$0")/check.py" || exit 1
