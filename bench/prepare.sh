# Sourced (from the repo root) by the bench scripts that drive the release daemons: installs the
# engines, prepares the test model and builds the release binaries, each step idempotent.
scripts/setup-engines.sh
.venv/bin/python scripts/prepare-model.py
cargo build --workspace --bins --locked --release
