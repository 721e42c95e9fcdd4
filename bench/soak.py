#!/usr/bin/env python3
"""A bounded soak: both daemons on the test model, a steady mix of cold (bridged), warm (cached) and
native chats for `--minutes`, with the resident set and open files of every process sampled every
`--every` seconds. Flat is the goal: a leak shows as growth between the first and the last part.

    bench/soak.sh [--minutes 10] [--every 10]

Writes OUT/soak.json: the samples, every request's verdict and status, and per process the mean RSS
and open files over the first, the second and the last fifth of the run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import threading
import time

# bench/'s own modules: Python puts a script's folder first on its path.
from corpora import corpus
from daemons import ROOT, Daemons, descendants, open_files
from front_door import Client, EngineLog, Prompts, timed
from runs import machine_info

MODEL = "smollm2"
MAX_LEN = 8192
# (mode, expected outcome, prompt tokens): a cold prompt every third request.
MIX = [("auto", "bridged", 768), ("auto", "cached", None), ("native", "native", 160)]


def sample(daemons: Daemons) -> dict:
    decoded, prefilld = daemons.pid("decoded"), daemons.pid("prefilld")
    sampler = daemons.sampler()
    rss = sampler.sample()
    files = {
        "decoded": open_files(decoded),
        "mlx_adapter": sum(open_files(p) for p in descendants(decoded)),
        "prefilld": open_files(prefilld),
        "vllm": sum(open_files(p) for p in descendants(prefilld)),
    }
    return {"rss_mb": {k: round(v, 1) for k, v in rss.items()}, "open_files": files}


def summarize(samples: list[dict]) -> dict:
    """Per process, the mean over each fifth of the run: the first holds the warm-up (allocator
    pools, the engines' first requests), so flat means the second and the last fifths agree."""
    n = max(1, len(samples) // 5)
    parts = {"first_fifth": samples[:n], "second_fifth": samples[n:2 * n], "last_fifth": samples[-n:]}
    out = {}
    for metric in ("rss_mb", "open_files"):
        for role in samples[0][metric]:
            out.setdefault(role, {})[metric] = {
                name: round(sum(r[metric][role] for r in rows) / len(rows), 1) for name, rows in parts.items()
            }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--every", type=float, default=10, help="seconds between samples")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--run-dir", default="var/bench-soak")
    args = p.parse_args()

    with Daemons(MODEL, args.run_dir, MAX_LEN) as daemons:
        client = Client(daemons.front)
        log = EngineLog(daemons.decoded_log)
        prompts = Prompts(client, corpus(), dt.datetime.now(dt.timezone.utc).strftime("soak-%Y%m%dT%H%M%S"))
        samples, requests = [], []
        stop = threading.Event()
        t0 = time.monotonic()

        def sampler():
            while not stop.is_set():
                samples.append({"t_s": round(time.monotonic() - t0, 1), **sample(daemons)})
                stop.wait(args.every)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        warm = None
        i = 0
        while time.monotonic() - t0 < args.minutes * 60:
            mode, expected, tokens = MIX[i % len(MIX)]
            if expected == "cached":
                prompt = warm
            else:
                prompt = prompts.make(tokens)
            row = timed(client, log, prompt, mode, 8)
            if expected == "bridged":
                warm = prompt
            outcome = (row["verdict"] or {}).get("outcome")
            requests.append({"t_s": round(time.monotonic() - t0, 1), "mode": mode, "expected": expected,
                             "outcome": outcome, "status": row["http_status"], "error": row["error"],
                             "prompt_tokens": prompt["prompt_tokens"], "ttft_s": row["ttft_s"]})
            print(f"[{time.monotonic() - t0:6.0f} s] {mode} {prompt['prompt_tokens']} -> {outcome} "
                  f"{row['error'] or ''}", file=sys.stderr, flush=True)
            i += 1
        stop.set()
        thread.join()
        samples.append({"t_s": round(time.monotonic() - t0, 1), **sample(daemons)})

    wrong = [r for r in requests if r["error"] or r["outcome"] != r["expected"]]
    result = {
        "what": "bounded soak: steady bridged/cached/native mix; RSS and open files per process",
        "model": MODEL,
        "machine": machine_info(),
        "minutes": args.minutes,
        "requests": len(requests),
        "wrong_verdicts_or_errors": len(wrong),
        "summary": summarize(samples),
        "samples": samples,
        "request_log": requests,
    }
    out = ROOT / args.out / "soak.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}: {len(requests)} requests, {len(wrong)} wrong; {json.dumps(result['summary'])}",
          file=sys.stderr)
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
