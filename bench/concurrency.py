#!/usr/bin/env python3
"""Many users at once: the decoder's continuous batching (issue 16, item 2), native and bridged.

Both daemons on the test model, with the decode adapter batching up to `engine.max_batch`
generations (mlx-lm's BatchGenerator; restored store blocks join as per-request caches). For 1, 4
and 8 concurrent users, each round fires that many streamed chats at once (a barrier), each on a
cold prompt of its own (~`--prompt-tokens`, real text, unique tag: nothing is in the store), greedy,
`--max-tokens` long:

  native   `X-PD-Bridge-Mode: native`: the decoder prefills every prompt itself (batched too);
  bridged  `X-PD-Bridge-Mode: auto`: prefilld bridges every prompt; must say `bridged`. On this rig
           prefilld's vLLM and the decoder share two cores, so concurrent bridges queue for them
           and their answers start one after another;
  cached   the bridged round's prompts again, at once: every answer restores its blocks from the
           store (what a bridged request's decoder side is once prefill runs on its own machine),
           and joins the batch with them; must say `cached`.

Per round: TTFT p50/p95 (nearest rank), aggregate decode tokens/s (every streamed chunk after each
request's first, over the time from the round's first first chunk to its last chunk), output
tokens/s (all chunks over the round's wall time), the mean per-user decode rate.

Then the daemons restart with `engine.max_batch = 1` (one generation at a time, the adapter before
batching), the largest round's bridged prompts are bridged again one by one (a fresh store) and
served at once from the store: the side-by-side ratio of what batching buys, and a check that every
batched answer equals the one served alone.

All of it for two decoder setups, because batching pays only where a step's cost does not grow with
the rows in it: `dense` (SmolLM2's weights dequantized to fp32 — the prefill side's folder — with
OpenBLAS preloaded for MLX's CPU backend through `engine.env`, as a Mac's Accelerate/Metal kernels
would do the matmuls) and `q4` (the default 4-bit decoder on MLX's bundled reference BLAS, whose
kernels cost the same per row batched or not).

    bench/concurrency.sh [--prompt-tokens 512] [--max-tokens 64] [--users 1,4,8] [--setups dense,q4]

Writes OUT/concurrency.json; prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import threading
import time
from pathlib import Path

# bench/'s own modules: Python puts a script's folder first on its path.
from corpora import corpus
from daemons import ROOT, Daemons
from front_door import Client, EngineLog, Prompts, check, timed
from runs import machine_info

MODEL = "smollm2"
MAX_LEN = 8192
# Per mode: the X-PD-Bridge-Mode header, and the outcome every answer must report.
MODES = {"native": ("native", "native"), "bridged": ("auto", "bridged"), "cached": ("auto", "cached")}


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def accepted(row: dict, mode: str) -> str | None:
    """Why a row must be rejected, or None."""
    if mode != "cached":
        return check(row, MODES[mode][1])
    outcome = (row["verdict"] or {}).get("outcome")
    return row["error"] or (None if outcome == "cached" else f"expected cached, got {outcome}")


def round_of(client: Client, log: EngineLog, prompts: list[dict], mode: str, max_tokens: int) -> dict:
    """All prompts at once, one user each."""
    rows: list[dict | None] = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def user(i: int) -> None:
        barrier.wait()
        rows[i] = timed(client, log, prompts[i], MODES[mode][0], max_tokens)

    t0 = time.monotonic()
    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    verdicts = [(r, accepted(r, mode)) for r in rows]
    rejected = [(r["prompt_tag"], why) for r, why in verdicts if why]
    ok = [r for r, why in verdicts if why is None]
    summary: dict = {"users": len(prompts), "mode": mode, "wall_s": round(wall, 2), "rejected": rejected}
    if ok:
        firsts = [r["started_monotonic"] + r["ttft_s"] for r in ok]
        lasts = [r["started_monotonic"] + r["last_chunk_s"] for r in ok]
        decoded_chunks = sum(r["completion_chunks"] - 1 for r in ok)
        ttfts = [r["ttft_s"] for r in ok]
        rates = [r["decode_tok_s"] for r in ok if r["decode_tok_s"]]
        summary.update({
            "ttft_p50_s": round(nearest_rank(ttfts, 0.5), 3),
            "ttft_p95_s": round(nearest_rank(ttfts, 0.95), 3),
            "aggregate_decode_tok_s": round(decoded_chunks / (max(lasts) - min(firsts)), 2),
            "output_tok_s": round(sum(r["completion_chunks"] for r in ok) / wall, 2),
            "per_user_decode_tok_s_mean": round(sum(rates) / len(rates), 2) if rates else None,
            "completion_tokens": [r["completion_tokens"] for r in ok],
        })
    summary["requests"] = [{k: r[k] for k in ("prompt_tag", "prompt_tokens", "ttft_s", "last_chunk_s", "total_s",
                                              "completion_chunks", "decode_tok_s", "finish_reason", "verdict",
                                              "error", "text")} for r in rows]
    return summary


def table(rounds: list[dict]) -> str:
    out = ["| decoder | max_batch | mode | users | TTFT p50 s | TTFT p95 s | aggregate decode tok/s | output tok/s | per-user decode tok/s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rounds:
        out.append(f"| {r['setup']} | {r['max_batch']} | {r['mode']} | {r['users']} | {r.get('ttft_p50_s')} | {r.get('ttft_p95_s')} | "
                   f"{r.get('aggregate_decode_tok_s')} | {r.get('output_tok_s')} | {r.get('per_user_decode_tok_s_mean')} |")
    return "\n".join(out)


def openblas() -> Path:
    """The OpenBLAS the engines' environment already holds (opencv's wheel, a vLLM dependency)."""
    found = sorted((ROOT / ".venv").glob("lib/python*/site-packages/opencv_python_headless.libs/libopenblas*.so"))
    if not found:
        raise SystemExit("no OpenBLAS in .venv (opencv-python-headless's libopenblas*.so)")
    return found[0]


# The decoder setups measured: name -> (decoder model folder under models/, None for the default
# 4-bit one; whether MLX's CPU backend gets OpenBLAS; concurrency levels, None: --users). The 4-bit
# decoder prefills at ~14 tokens/s here: its native rounds take minutes, so only 1 and 8 users.
SETUPS = {
    "dense": ("smollm2-hf", True, None),
    "q4": (None, False, [1, 8]),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--users", default="1,4,8")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--setups", default="dense,q4", help=f"decoder setups, of {','.join(SETUPS)}")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--run-dir", default="var/bench-concurrency")
    args = p.parse_args()
    started = time.monotonic()
    started_utc = dt.datetime.now(dt.timezone.utc)

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {msg}", file=sys.stderr, flush=True)

    def daemons(setup: str, max_batch: int, run_dir: str) -> Daemons:
        decoder_model, blas, _ = SETUPS[setup]
        decoder = f"max_batch = {max_batch}\n"
        if blas:
            decoder += f'[engine.env]\nLD_PRELOAD = "{openblas()}"\n'
        return Daemons(MODEL, run_dir, MAX_LEN, decoder=decoder, decoder_model=decoder_model)

    rounds: list[dict] = []
    summary: dict = {}
    ok = True
    for setup in args.setups.split(","):
        users = SETUPS[setup][2] or [int(u) for u in args.users.split(",")]
        largest: list[dict] = []
        with daemons(setup, args.max_batch, f"{args.run_dir}-{setup}") as d:
            client, log = Client(d.front), EngineLog(d.decoded_log)
            prompts = Prompts(client, corpus(), started_utc.strftime(f"conc-{setup}-%Y%m%dT%H%M%S"))
            # One short request first: the engines' one-time warm-up is nobody's TTFT.
            timed(client, log, prompts.make(args.prompt_tokens), "auto", 4)
            for n in users:
                bridged = [prompts.make(args.prompt_tokens) for _ in range(n)]
                for mode, batch in (("native", [prompts.make(args.prompt_tokens) for _ in range(n)]),
                                    ("bridged", bridged), ("cached", bridged)):
                    say(f"{setup}: {mode} x{n} ...")
                    result = round_of(client, log, batch, mode, args.max_tokens)
                    rounds.append({"setup": setup, "max_batch": args.max_batch, **result})
                    say(f"  {json.dumps({k: v for k, v in result.items() if k != 'requests'})}")
                largest = bridged
        # The same prompts, one generation at a time: bridged one by one (a fresh store), then at once.
        with daemons(setup, 1, f"{args.run_dir}-{setup}-serial") as d:
            client, log = Client(d.front), EngineLog(d.decoded_log)
            for prompt in largest:
                timed(client, log, prompt, "auto", 1)
            say(f"{setup}: cached x{len(largest)}, max_batch 1 ...")
            serial = round_of(client, log, largest, "cached", args.max_tokens)
            rounds.append({"setup": setup, "max_batch": 1, **serial})
            say(f"  {json.dumps({k: v for k, v in serial.items() if k != 'requests'})}")

        def pick(mode: str, n: int) -> dict:
            return next(r for r in rounds if r["setup"] == setup and r["max_batch"] == args.max_batch
                        and r["mode"] == mode and r["users"] == n)

        top = max(users)
        batched = pick("cached", top)
        texts = {q["prompt_tag"]: q["text"] for q in batched["requests"]}
        same = [texts.get(q["prompt_tag"]) == q["text"] for q in serial["requests"]]
        summary[setup] = {
            **{f"{mode}_aggregate_decode_{top}_over_1": ratio(pick(mode, top).get("aggregate_decode_tok_s"),
                                                              pick(mode, 1).get("aggregate_decode_tok_s"))
               for mode in MODES},
            f"cached_{top}_users_batched_over_serial_aggregate_decode": ratio(
                batched.get("aggregate_decode_tok_s"), serial.get("aggregate_decode_tok_s")),
            f"cached_{top}_users_serial_over_batched_wall": ratio(serial["wall_s"], batched["wall_s"]),
            "batched_answers_equal_serial": f"{sum(same)}/{len(same)}",
        }
        ok &= all(same)

    result = {
        "benchmark": "concurrency",
        "what": "continuous batching in the decode adapter: 1/4/8 concurrent users, native and bridged",
        "started_utc": started_utc.isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": machine_info(),
        "setup": {"model": MODEL, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                  "temperature": 0, "max_batch": args.max_batch, "block_tokens": 256,
                  "decoders": {
                      "dense": "models/smollm2-hf (the 4-bit weights dequantized, fp32) with OpenBLAS preloaded "
                               "for MLX's CPU backend (engine.env LD_PRELOAD)",
                      "q4": "models/smollm2-mlx (4-bit) on MLX's bundled reference BLAS",
                  },
                  "percentiles": "nearest rank",
                  "aggregate_decode_tok_s": "sum over requests of (streamed chunks - 1) / (last chunk of the round - "
                                            "first first-chunk of the round)"},
        "summary": summary,
        "rounds": rounds,
    }
    out = ROOT / args.out / "concurrency.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(rounds))
    print(json.dumps(summary, indent=2))
    say(f"wrote {out}")
    rejected = sum(len(r["rejected"]) for r in rounds)
    return 0 if rejected == 0 and ok else 1


def ratio(a, b):
    return round(a / b, 2) if a and b else None


if __name__ == "__main__":
    sys.exit(main())
