#!/usr/bin/env bash
# Puts Debian's Prometheus (prometheus and promtool, 2.42) under var/prometheus/ for the tests:
# deploy/check.py runs `promtool check` and `promtool test rules` on deploy/prometheus/, and the
# engines tier scrapes the daemons with the real server. The package is unpacked, not installed:
# nothing runs as a service and nothing outside the repo changes. Idempotent.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/var/prometheus"
[ -x "$dest/usr/bin/promtool" ] && [ -x "$dest/usr/bin/prometheus" ] && exit 0

download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
# `apt-get download` writes into the working directory; the lists may be missing on a fresh machine.
if ! (cd "$download" && apt-get download -qq prometheus 2>/dev/null); then
  [ "$(id -u)" = 0 ] || { echo "setup-prometheus.sh: apt-get download prometheus failed (run apt-get update)" >&2; exit 1; }
  apt-get update -qq
  (cd "$download" && apt-get download -qq prometheus)
fi
rm -rf "$dest.tmp"
dpkg-deb -x "$download"/prometheus_*.deb "$dest.tmp"
rm -rf "$dest"
mv "$dest.tmp" "$dest"
echo "setup-prometheus.sh: $("$dest/usr/bin/prometheus" --version 2>&1 | head -1)" >&2
