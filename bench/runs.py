#!/usr/bin/env python3
"""A bench run's record: the machine it ran on (CPU, memory, load, commit), a timestamped log, and
`run_rows`, which runs a benchmark's rows and writes its result file."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from corpora import ROOT, corpus


def machine_info() -> dict:
    cpu_model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu_model = platform.processor() or "unknown"
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout)
    except OSError:
        commit, dirty = "", None
    return {
        "cpu_model": cpu_model,
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "mem_gib": mem_gib,
        "loadavg_at_start": list(os.getloadavg()),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "note": "both engines (vLLM-CPU prefill, mlx-lm decode) and both daemons share these cores, "
                "with other processes on the machine (see the load averages)",
    }


def log(msg: str) -> None:
    print(f"[{dt.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def run_rows(benchmark: str, names: list[str], run_row, setup: dict, out: str) -> list[dict]:
    """Runs `run_row(name, corpus text)` for each row in turn and writes the result file `out`: the
    benchmark, when and how long, the machine (load averages before and after), `setup`, the rows."""
    started, started_utc = time.monotonic(), dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    info = machine_info()
    text = corpus()
    rows = []
    for name in names:
        log(f"row {name}")
        rows.append(run_row(name, text))
    info["loadavg_at_end"] = list(os.getloadavg())
    result = {"benchmark": benchmark, "started_utc": started_utc, "duration_s": round(time.monotonic() - started, 1),
              "machine": info, "setup": setup, "rows": rows}
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return rows
