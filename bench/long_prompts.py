#!/usr/bin/env python3
"""Long prompts (16K-128K tokens) bridged end to end, with the memory of every process measured.

Starts decoded and prefilld (release binaries) on the generated long-context checkpoint
(`scripts/make-tiny-model.py --family llama-long`: Llama-shaped, 135,168 positions) with a fresh
store, then for each target length bridges one cold chat prompt of that many tokens (streaming,
temperature 0, max_tokens 1) and, up to `--native-max` tokens, serves the same prompt natively to
compare the first token. While each request runs, a sampler reads the resident set size of the four
processes every 0.2 s from /proc: decoded, its mlx-lm adapter, prefilld, and vLLM (its API server
with every process under it, summed). The point: the daemons' memory must not grow with the prompt
beyond the blocks in flight (the original system's block writer grew quadratically and died at 98K).

    bench/long_prompts.sh [--lengths 16384,32768,65536,131072] [--native-max 32768]

Writes OUT/long_prompts.json: one row per length with `prompt_tokens`, `outcome`, `cached_tokens`,
`ttft_bridged_s`, `rss_peak_mb` (per process), and where affordable `ttft_native_s` and
`same_first_token`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time

# bench/'s own modules: Python puts a script's folder first on its path.
from corpora import corpus
from daemons import BLOCK_TOKENS, ROOT, Daemons
from front_door import Client, EngineLog, Prompts, timed
from runs import machine_info

MODEL = "tiny-llama-long"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="16384,32768,65536,131072")
    p.add_argument("--native-max", type=int, default=32768, help="longest prompt also served natively")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--run-dir", default="var/bench-long")
    args = p.parse_args()
    targets = [int(x) for x in args.lengths.split(",") if x.strip()]
    config = json.loads((ROOT / "models" / f"{MODEL}-mlx" / "config.json").read_text())
    max_len = config["max_position_embeddings"]

    with Daemons(MODEL, args.run_dir, max_len) as daemons:
        t0 = time.monotonic()
        client = Client(daemons.front)
        engine_log = EngineLog(daemons.decoded_log)
        run_id = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
        # The corpus, repeated: 128K tokens need more text than one copy (every prompt still starts
        # with a unique tag, so none shares a block with another).
        prompts = Prompts(client, corpus() * 2, run_id)
        idle = daemons.sampler().sample()
        print(f"== ready; idle RSS MB {idle}", file=sys.stderr, flush=True)
        rows = []
        for target in targets:
            prompt = prompts.make(target)
            row = {"target": target, "prompt_tokens": prompt["prompt_tokens"]}
            with daemons.sampler() as sampler:
                bridged = timed(client, engine_log, prompt, "auto", 1)
            verdict = bridged["verdict"] or {}
            row |= {
                "outcome": verdict.get("outcome"),
                "reason": verdict.get("reason"),
                "cached_tokens": verdict.get("cached_tokens"),
                "blocks": verdict.get("blocks"),
                "bytes": verdict.get("bytes"),
                "ttft_bridged_s": bridged["ttft_s"],
                "prefill_engine_s": (verdict.get("timings_ms") or {}).get("prefill_prefill", 0) / 1e3 or None,
                "rss_peak_mb": {k: round(v, 1) for k, v in sampler.peak.items()},
                "error": bridged["error"],
            }
            if target <= args.native_max and not bridged["error"]:
                with daemons.sampler() as sampler:
                    native = timed(client, engine_log, prompt, "native", 1)
                row |= {
                    "ttft_native_s": native["ttft_s"],
                    "rss_peak_mb_native": {k: round(v, 1) for k, v in sampler.peak.items()},
                    # max_tokens 1: each text is exactly the first token's.
                    "same_first_token": bool(native["text"]) and native["text"] == bridged["text"],
                    "first_token_text": [bridged["text"], native["text"]],
                    "native_error": native["error"],
                }
            rows.append(row)
            print(f"[{time.monotonic() - t0:7.1f} s] {json.dumps(row)}", file=sys.stderr, flush=True)
        result = {
            "what": "long prompts bridged on the generated llama-long checkpoint; peak RSS per process",
            "model": MODEL,
            "model_config": {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim", "max_position_embeddings")},
            "block_tokens": BLOCK_TOKENS,
            "machine": machine_info(),
            "idle_rss_mb": {k: round(v, 1) for k, v in idle.items()},
            "wall_s": round(time.monotonic() - t0, 1),
            "rows": rows,
        }
        out = ROOT / args.out / "long_prompts.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}", file=sys.stderr)
        return 0


if __name__ == "__main__":
    sys.exit(main())
