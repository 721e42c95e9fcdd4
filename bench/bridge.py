#!/usr/bin/env python3
"""The bridge benchmark (issue 5, item 4): time to first token, bridged vs native, by prompt length.

Talks to a running `decoded` front door (and, through it, `prefilld`); `bench/run.sh` starts both
from deploy/examples/ with a fresh store and runs this. Standard library plus Pillow (for the PNG).

    .venv/bin/python bench/bridge.py [--lengths 512,1024,2048,4096] [--out bench/results]

For each target length it builds a cold prompt from real text (license texts found in the
environment's dist-info folders and this repo's LICENSE; every prompt starts with a unique tag and
a different slice of the text, so no block of it can already be in the store), sized with decoded's
own tokenizer (`POST /pd/v1/tokenize`, chat template included) to the target ±5 % — aimed at the
smallest size >= the target, so the whole-block part is the target and the decoder's own tail
prefill is a few tokens. Then, on that one prompt:

  bridged  `X-PD-Bridge-Mode: auto`, streaming, temperature 0, max_tokens 32. Must say `bridged`.
  native   `X-PD-Bridge-Mode: native` (never reads the store, so the same prompt is still cold for
           the decoder). Must say `native` / `requested`.

and, with `--midblock` (default on), one more bridged request on a fresh prompt of target + B/2
tokens: the average case for the decoder's tail prefill (up to B-1 tokens the decoder computes
itself after restoring the bridged blocks).

Per row it keeps the whole `X-PD-Bridge` verdict, TTFT (request sent -> first streamed content
chunk), decode tokens/s ((chunks - 1) / (last chunk - first chunk)), the stage breakdown (the
verdict's stages; the decode engine's own `restore`/`prefill`/`first_token`/`decode` read from
decoded's log, since a streamed verdict is sent before the engine has run), and the load average.
A row whose outcome is not the expected one is rejected: listed with its reason, never averaged.

Derived per length: prefill-engine time = the verdict's `prefill_prefill` (vLLM with the capture
hook on, same token ids); bridge overhead = bridged TTFT - prefill-engine time; floor =
max(prefill-engine time, payload bytes / link rate) for 10 GbE (1.25e9 B/s); payload bytes/token =
bytes / (blocks x block_tokens + the verdict's tail_tokens: the prompt's tail after its last whole
block, bridged for the request), next to the decoder's own cache bytes/token.

Writes OUT/bridge.json and OUT/bridge_ttft.png, prints a markdown table.
The shared client (front_door.py), texts (corpora.py) and run record (runs.py) are their own
modules beside this one; the table and plot are bridge_report.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
import time
from pathlib import Path

# bench/'s own modules: Python puts a script's folder first on its path.
from bridge_report import fmt, plot, table
from corpora import QUESTION, corpus
from front_door import Client, EngineLog, Prompts, check, messages_for, timed
from runs import machine_info

LINK_RATE_10GBE = 1.25e9  # bytes/s: 10 Gbit/s


# ---------------------------------------------------------------------------
# Derived numbers.
# ---------------------------------------------------------------------------

def stages(row: dict) -> dict:
    """The stage breakdown, in seconds: the verdict's stages, the engine's, and the client's."""
    out = {k: round(ms / 1e3, 4) for k, ms in sorted(((row["verdict"] or {}).get("timings_ms") or {}).items())}
    for k, ms in sorted((row["engine_log"] or {}).items()):
        if k.startswith("engine_") and ms is not None:
            out[k] = round(ms / 1e3, 4)
    if row["ttft_s"] is not None:
        out["client_ttft"] = round(row["ttft_s"], 4)
        if "generate_start" in out:
            # Everything between the front door calling the engine and the first chunk reaching the
            # client: engine restore + tail prefill + first token + SSE.
            out["client_after_generate_start"] = round(row["ttft_s"] - out["generate_start"], 4)
    return out


def derive(row: dict, link_rate: float, cache_bpt: int) -> None:
    v = row["verdict"] or {}
    row["stages_s"] = stages(row)
    b = v.get("block_tokens") or 0
    row["tail_tokens"] = (v.get("prompt_tokens", 0) - v.get("cached_tokens", 0)) if v else None
    if row["mode"] == "native":
        return
    prefill_s = (v.get("timings_ms") or {}).get("prefill_prefill")
    prefill_s = None if prefill_s is None else prefill_s / 1e3
    blocks, nbytes = v.get("blocks") or 0, v.get("bytes") or 0
    wire_s = nbytes / link_rate
    row["prefill_engine_s"] = prefill_s
    row["prefill_engine_tok_s"] = (blocks * b / prefill_s) if prefill_s else None
    row["bridge_overhead_s"] = (row["ttft_s"] - prefill_s) if (prefill_s is not None and row["ttft_s"]) else None
    bridged_tokens = blocks * b + (v.get("tail_tokens") or 0)
    row["payload_bytes_per_token"] = nbytes / bridged_tokens if blocks and b else None
    row["payload_vs_cache"] = row["payload_bytes_per_token"] / cache_bpt if row["payload_bytes_per_token"] else None
    row["link_time_10gbe_s"] = wire_s
    row["floor_s"] = max(prefill_s or 0.0, wire_s)
    # Where the overhead goes: the bridge call beyond the prefill engine (reconstruction not hidden
    # behind the forward, the push's commit), and the decoder's part (restore, tail prefill, first
    # token, SSE); the rest is tokenize + planning.
    st = row["stages_s"]
    if prefill_s is not None and row["ttft_s"] and "bridge" in st and "generate_start" in st:
        row["overhead_split_s"] = {
            "bridge_beyond_prefill_engine": st["bridge"] - prefill_s,
            "decoder_restore_tail_first_token": row["ttft_s"] - st["generate_start"],
            "front_door_other": st["generate_start"] - st["bridge"],
        }


def cache_bytes_per_token(log_path: Path | None, default: int) -> tuple[int, str]:
    if log_path and log_path.exists():
        m = re.findall(r"bytes_per_token\S*?=\S*?(\d+)", re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text(errors="replace")))
        if m:
            return int(m[-1]), "decoded log (decode engine ready: bytes_per_token)"
    return default, "--cache-bytes-per-token"


# ---------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="decoded's front door")
    p.add_argument("--lengths", default="512,1024,2048,4096", help="target prompt lengths, tokens")
    p.add_argument("--out", default="bench/results", help="folder for bridge.json and bridge_ttft.png")
    p.add_argument("--decoded-log", default=None, help="decoded's log, for the engine's per-request stages")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--link-rate", type=float, default=LINK_RATE_10GBE, help="bytes/s for the floor (10 GbE)")
    p.add_argument("--cache-bytes-per-token", type=int, default=46080,
                   help="the decoder's own cache bytes/token, if decoded's log does not say")
    p.add_argument("--midblock", action=argparse.BooleanOptionalAction, default=True,
                   help="also a bridged row at target + B/2 tokens (average decoder tail)")
    p.add_argument("--budget-s", type=float, default=0,
                   help="skip a length whose native run would not fit in what is left (0: no limit)")
    args = p.parse_args()

    started_wall, t0 = dt.datetime.now(dt.timezone.utc), time.monotonic()
    client = Client(args.url)
    out = Path(args.out)
    log_path = Path(args.decoded_log) if args.decoded_log else None
    log = EngineLog(log_path)
    targets = [int(x) for x in args.lengths.split(",") if x.strip()]
    machine = machine_info()
    cache_bpt, cache_bpt_source = cache_bytes_per_token(log_path, args.cache_bytes_per_token)
    text = corpus()
    run_id = started_wall.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
    prompts = Prompts(client, text, run_id)
    _, block_tokens = client.tokenize([{"role": "user", "content": "x"}])
    print(f"== corpus {len(text):,} chars; block {block_tokens} tokens; decoder cache {cache_bpt} B/token; "
          f"load {machine['loadavg_at_start']}", file=sys.stderr)

    def say(msg):
        print(f"[{time.monotonic() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)

    # Warm both paths (first MLX/vLLM calls compile and allocate); not timed, not kept as rows.
    warm = []
    overhead = client.tokenize(messages_for(f"bench {run_id} prompt 0", ""))[0]  # tag, question, template
    for target, mode in ((block_tokens + 8, "auto"), (overhead + 24, "native")):
        pr = prompts.make(target)
        r = timed(client, log, pr, mode, 8)
        say(f"warm-up {mode} {pr['prompt_tokens']} tok: {r['verdict'] and r['verdict'].get('outcome')} "
            f"ttft {fmt(r['ttft_s'], 2)} s {r['error'] or ''}")
        warm.append({k: r[k] for k in ("mode", "prompt_tokens", "verdict", "ttft_s", "error")})

    rows, rejected, skipped, per_length = [], [], [], []
    native_rate = None  # s per token^1 of the last native row, for the budget check
    for target in targets:
        if args.budget_s and native_rate:
            estimate = native_rate * target * (1.0 + target / 16384) + 60
            left = args.budget_s - (time.monotonic() - t0)
            if estimate > left:
                say(f"skip {target}: native alone would take ~{estimate:.0f} s, {left:.0f} s left")
                skipped.append({"target": target, "reason": f"native estimated {estimate:.0f} s > {left:.0f} s left"})
                continue
        L = {"target": target}
        pr = prompts.make(target)
        L["prompt_tokens"] = pr["prompt_tokens"]
        plan = [("bridged", "auto", "bridged", pr), ("native", "native", "native", pr)]
        if args.midblock:
            plan.append(("midblock", "auto", "bridged", None))
        for kind, mode, expected, prompt in plan:
            for attempt in (1, 2):
                if prompt is None or attempt == 2:
                    if kind == "native":
                        break  # minutes per native row: no retry
                    prompt = prompts.make(target + (block_tokens // 2 if kind == "midblock" else 0))
                say(f"{target}: {kind} ({mode}) {prompt['prompt_tokens']} tok ...")
                r = timed(client, log, prompt, mode, args.max_tokens)
                r.update(kind=kind, target=target, expected=expected, attempt=attempt,
                         corpus_start=prompt["corpus_start"])
                derive(r, args.link_rate, cache_bpt)
                why = check(r, expected)
                v = r["verdict"] or {}
                say(f"{target}: {kind} -> {v.get('outcome')}/{v.get('reason')} ttft {fmt(r['ttft_s'], 2)} s "
                    f"decode {fmt(r['decode_tok_s'])} tok/s" + (f"  REJECTED: {why}" if why else ""))
                if why:
                    r["rejected"] = why
                    rejected.append({"target": target, "kind": kind, "attempt": attempt, "reason": why,
                                     "verdict": r["verdict"], "prompt_tokens": r["prompt_tokens"]})
                    rows.append(r)
                    continue
                r["rejected"] = None
                rows.append(r)
                L[kind] = r
                if kind == "native":
                    native_rate = r["ttft_s"] / r["prompt_tokens"] / (1.0 + r["prompt_tokens"] / 16384)
                break
        n, b = L.get("native"), L.get("bridged")
        if n and b:
            L["speedup"] = n["ttft_s"] / b["ttft_s"]
            L["same_text"] = n["text"] == b["text"]
            L["same_first_chunk"] = n["text"][:1] == b["text"][:1] and bool(n["text"])
        per_length.append(L)

    summary = []
    for L in per_length:
        n, b, m = L.get("native"), L.get("bridged"), L.get("midblock")
        summary.append({
            "target": L["target"],
            "prompt_tokens": L["prompt_tokens"],
            "native_ttft_s": n and n["ttft_s"],
            "bridged_ttft_s": b and b["ttft_s"],
            "native_over_bridged_ttft": L.get("speedup"),
            "prefill_engine_s": b and b["prefill_engine_s"],
            "prefill_engine_tok_s": b and b["prefill_engine_tok_s"],
            "bridge_overhead_s": b and b["bridge_overhead_s"],
            "bridge_overhead_split_s": b and b.get("overhead_split_s"),
            "bridged_stages_s": b and b["stages_s"],
            "floor_10gbe_s": b and b["floor_s"],
            "bridged_over_floor": (b["ttft_s"] / b["floor_s"]) if b and b["floor_s"] else None,
            "native_over_floor": (n["ttft_s"] / b["floor_s"]) if n and b and b["floor_s"] else None,
            "bridged_tail_tokens": b and b["tail_tokens"],
            "midblock_prompt_tokens": m and m["prompt_tokens"],
            "midblock_tail_tokens": m and m["tail_tokens"],
            "midblock_ttft_s": m and m["ttft_s"],
            "midblock_bridge_overhead_s": m and m["bridge_overhead_s"],
            "native_over_midblock_ttft_est": (n["ttft_s"] / n["prompt_tokens"] * m["prompt_tokens"] / m["ttft_s"])
            if n and m else None,
            "decode_tok_s_native": n and n["decode_tok_s"],
            "decode_tok_s_bridged": b and b["decode_tok_s"],
            "payload_bytes_per_token": b and b["payload_bytes_per_token"],
            "payload_vs_decoder_cache": b and b["payload_vs_cache"],
            "same_text_native_bridged": L.get("same_text"),
        })

    finished = time.monotonic() - t0
    result = {
        "benchmark": "pd-bridge bridge TTFT (bench/bridge.py)",
        "started_utc": started_wall.isoformat(timespec="seconds"),
        "duration_s": round(finished, 1),
        "machine": {**machine, "loadavg_at_end": list(os.getloadavg())},
        "setup": {
            "front_door": args.url,
            "lengths": targets,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "block_tokens": block_tokens,
            "link_rate_bytes_per_s": args.link_rate,
            "decoder_cache_bytes_per_token": cache_bpt,
            "decoder_cache_bytes_per_token_source": cache_bpt_source,
            "corpus_chars": len(text),
            "question": QUESTION,
            "definitions": {
                "ttft_s": "request sent -> first streamed chunk carrying delta.content, at the client",
                "decode_tok_s": "(content chunks - 1) / (last chunk time - first chunk time); one chunk per token",
                "prefill_engine_s": "verdict timings_ms.prefill_prefill: vLLM's prefill of the whole-block tokens "
                                    "with the capture hook on, as timed by prefilld",
                "bridge_overhead_s": "bridged ttft_s - prefill_engine_s",
                "floor_s": "max(prefill_engine_s, payload bytes / link rate)",
                "payload_bytes_per_token": "verdict bytes / (blocks * block_tokens + verdict tail_tokens)",
                "tail_tokens": "prompt tokens the decoder prefills itself after restoring the bridged blocks",
                "stages_s": "verdict timings (tokenize, bridge, prefill_*, generate_start), the decode engine's "
                            "own timings from decoded's log (engine_*), and client-side ttft",
            },
            "acceptance": "native rows must say native/requested; bridged and midblock rows must say bridged "
                          "with every whole block pushed by that request; anything else is rejected and "
                          "listed, never summarized",
        },
        "summary": summary,
        "rejected": rejected,
        "skipped": skipped,
        "warmup": warm,
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "bridge.json").write_text(json.dumps(result, indent=2) + "\n")
    title = f"pd-bridge TTFT on {machine['cpu_cores']} CPU cores ({machine['cpu_model'][:40]}), both engines on CPU"
    png = plot(per_length, out / "bridge_ttft.png", title)
    md = table(per_length)
    print(md)
    if rejected:
        print("\nRejected rows:")
        for r in rejected:
            print(f"- {r['target']} {r['kind']} (attempt {r['attempt']}): {r['reason']}")
    if skipped:
        print("\nSkipped: " + "; ".join(f"{s['target']}: {s['reason']}" for s in skipped))
    print(f"\nwrote {out / 'bridge.json'}" + (f" and {out / 'bridge_ttft.png'}" if png else "") +
          f" in {finished:.0f} s", file=sys.stderr)
    return 0 if per_length and all(L.get("native") and L.get("bridged") for L in per_length) else 1


if __name__ == "__main__":
    sys.exit(main())
