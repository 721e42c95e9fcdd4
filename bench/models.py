#!/usr/bin/env python3
"""Model-family conformance: for every family row, is the bridged cache the decoder's own cache?

One row per (family, cache dtype, KV quantization). For each row:

1. same input: the decoder adapter's `Engine` prefills a real prompt natively (mlx-lm's own
   `generate_step`, chunks of 384 tokens so chunks and blocks do not line up) while every layer's
   input is recorded; the cache path rebuilt from the decoder's bundle (what the prefill plugin
   runs) reconstructs each block from those inputs; every tensor is compared with the decoder's
   cache (`tensors_exact` of `tensors_total`, `max_ulp`).
2. through both daemons (release binaries, real vLLM-CPU and mlx-lm): `--prompts` real chat prompts
   (license texts; a row may take changelogs and source code in turn, `Row.sources`, and a base
   model gets plain prompts through /v1/completions), each asked natively (`x-pd-bridge-mode:
   native`) and bridged, greedy, 32 tokens, through decoded's OpenAI front door: the verdict and the
   answers' text agreement.
3. the bridged blocks themselves: the same `Engine`, in this process, restores each prompt's blocks
   from the run's store (the files the front door restored) and generates: first-token agreement,
   32-token greedy agreement and KL(native ‖ bridged) of the first token's distribution, against
   the same `Engine` prefilling the whole prompt; and the blocks' tensor bytes per token (what the
   wire carried) against the decoder's own cache bytes per token (`payload_ratio`). A row in bf16 or
   with a quantized KV cache is also compared, natively and bridged, with the same weights in full
   precision (`vs_full_precision`): that separates the decoder's own rounding from the bridge's.

    bench/models.sh [--rows smollm2,llama3,gemma3_270m:float32,...] [--prompts 8]

Writes bench/results/models.json (one row per family row) and MODELS.md (the support table).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

# bench/'s own modules: Python puts a script's folder first on its path.
from corpora import QUESTIONS, corpora
from daemons import BLOCK_TOKENS, ROOT, Daemons, model_folder
from front_door import Client, EngineLog, Prompts, timed
from model_rows import ROWS, Row
from models_decoder import (GREEDY, chain, engine_for, file_tensor_bytes, generation, kl, own_bytes,
                            rounding_flips, same_input, store_blocks, tokenize_request)
from models_md import support_table, write_models_md
from runs import machine_info


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_row(row: Row, args, texts: dict[str, str]) -> dict:
    started = time.monotonic()
    run = ROOT / args.run_dir / f"{row.family}-{row.cache_dtype}"
    result = {"family": row.family, "model": row.model, "cache_dtype": row.cache_dtype, "weights": row.weights,
              "kv_bits": row.kv_bits or 0, "prefill_dtype": row.prefill_dtype,
              "chat": row.chat, "sources": list(row.sources),
              # A BLAS preloaded for MLX's CPU dense matmuls (both daemons and this process inherit it).
              "ld_preload": os.environ.get("LD_PRELOAD")}
    config = json.loads((model_folder(row.model, "mlx") / "config.json").read_text())
    config |= config.get("text_config", {})  # a published multimodal config nests the text model's keys
    max_len = min(int(config.get("max_position_embeddings", row.max_len)), row.max_len)
    rows_out, prompts = [], []
    with Daemons(row.model, str(run.relative_to(ROOT)), max_len, row.decoder_config(), row.prefill_dtype,
                 kv_space_gb=row.kv_space_gb) as daemons:
        client = Client(daemons.front)
        engine_log = EngineLog(daemons.decoded_log)
        makers = [Prompts(client, texts[source], f"{row.family}-{row.cache_dtype} {source}",
                          QUESTIONS[source] if row.chat else None) for source in row.sources]
        for i in range(args.prompts):
            prompt = makers[i % len(makers)].make(row.prompt_length(i))
            prompt["source"] = row.sources[i % len(makers)]
            native = timed(client, engine_log, prompt, "native", GREEDY)
            bridged = timed(client, engine_log, prompt, "bridge", GREEDY)
            for r in (native, bridged):
                if r["error"]:
                    raise SystemExit(f"{row.family}: prompt {i} {r['mode']}: {r['error']}")
            prompts.append(prompt)
            rows_out.append({"tag": prompt["tag"], "source": prompt["source"], "prompt_tokens": prompt["prompt_tokens"],
                             "verdict": bridged["verdict"], "same_text": native["text"] == bridged["text"],
                             "native_ttft_s": native["ttft_s"], "bridged_ttft_s": bridged["ttft_s"],
                             "native_text": native["text"][:120], "bridged_text": bridged["text"][:120]})
            log(f"  {row.family}/{row.cache_dtype} prompt {i}: {prompt['prompt_tokens']} tokens, "
                f"verdict {bridged['verdict']['outcome']}, same text {rows_out[-1]['same_text']}")
    store = store_blocks(run / "decoded-0" / "store")

    engine = engine_for(row, run / "bundle")
    # A reduced-precision decoder (bf16, quantized KV) is also compared with the same model in full
    # precision, natively and bridged: its own rounding, not the bridge, may be what flips a token.
    full = row.cache_dtype == "float32" and not row.kv_bits
    reference = None if full else engine_for(Row(row.family, row.model, "float32", row.weights), run / "reference")
    result["cache_classes"] = sorted({layer["cache_class"] for layer in engine.spec["layers"]})
    result["bridged"] = all(r["verdict"]["outcome"] == "bridged" for r in rows_out)
    first_agree = greedy_agree = 0
    kls, sent, tokens_sent = [], 0, 0
    from pdbridge_cache.kinds import POOLED, ROWS, SNAPSHOT

    pooled = any(layer["kind"] == POOLED for layer in engine.spec["layers"])
    for prompt, out in zip(prompts, rows_out):
        tokens = engine.tokenize(tokenize_request(prompt))
        paths = chain(store, tokens, engine.per_block)
        native_lp, native_tokens = generation(engine, tokens, [])
        bridged_lp, bridged_tokens = generation(engine, tokens, paths)
        out.update(blocks_restored=len(paths), first_token_same=native_tokens[0] == bridged_tokens[0],
                   greedy_same=native_tokens == bridged_tokens, kl=kl(native_lp, bridged_lp))
        if reference is not None:
            reference_lp, reference_tokens = generation(reference, tokens, [])
            out["full_precision"] = {
                "native_first_token_same": native_tokens[0] == reference_tokens[0],
                "bridged_first_token_same": bridged_tokens[0] == reference_tokens[0],
                "native_kl": kl(reference_lp, native_lp), "bridged_kl": kl(reference_lp, bridged_lp)}
        first_agree += out["first_token_same"]
        greedy_agree += out["greedy_same"]
        kls.append(out["kl"])
        if pooled:
            out["rounding_flips"] = rounding_flips(engine, tokens, paths, run / "export")
        sent += sum(file_tensor_bytes(p) for p in paths)
        tokens_sent += len(paths) * BLOCK_TOKENS
    probe = engine.tokenize(tokenize_request(prompts[0]))
    own = own_bytes(engine, ROWS)
    snapshot = own_bytes(engine, SNAPSHOT)
    per_block = snapshot + own_bytes(engine, POOLED)
    # With a partial block at the end, as a tail (pools have none).
    result.update(same_input(engine, probe[: (len(probe) // BLOCK_TOKENS) * BLOCK_TOKENS + (0 if pooled else 7)]))
    n = len(rows_out)
    result.update({
        "prompts": n,
        "first_token_agreement": first_agree / n,
        "greedy32_agreement": greedy_agree / n,
        "front_door_text_agreement": sum(r["same_text"] for r in rows_out) / n,
        "kl_mean": sum(kls) / n,
        "kl_max": max(kls),
        "payload_bytes_per_token": sent / tokens_sent if tokens_sent else None,
        # Rows per token, plus a recurrent state or pools per block (per_block_bytes) where there are.
        "decoder_cache_bytes_per_token": own + per_block / BLOCK_TOKENS,
        "payload_ratio": (sent / tokens_sent) / (own + per_block / BLOCK_TOKENS) if tokens_sent else None,
        "snapshot_bytes": snapshot,
        "per_block_bytes": per_block,
        "wall_s": round(time.monotonic() - started, 1),
        "per_prompt": rows_out,
    })
    # Where the bridge's time goes: the prefill engine's forward, and the plugin's reconstruction
    # (for a recurrent state, block after block on one thread), as prefilld reports them.
    stages = [r["verdict"].get("timings_ms") or {} for r in rows_out]
    result["timing_s_mean"] = {
        name: round(sum(t.get(key, 0.0) for t in stages) / n / 1e3, 3)
        for name, key in (("prefill_engine", "prefill_prefill"), ("reconstruct", "prefill_reconstruct"),
                          ("bridge", "bridge"))
    } | {"native_ttft": round(sum(r["native_ttft_s"] for r in rows_out) / n, 3),
         "bridged_ttft": round(sum(r["bridged_ttft_s"] for r in rows_out) / n, 3)}
    if reference is not None:
        vs = [r["full_precision"] for r in rows_out]
        result["vs_full_precision"] = {
            "reference": "the same weights, float32, KV cache not quantized, native",
            "native_first_token_agreement": sum(v["native_first_token_same"] for v in vs) / n,
            "bridged_first_token_agreement": sum(v["bridged_first_token_same"] for v in vs) / n,
            "native_kl_mean": sum(v["native_kl"] for v in vs) / n,
            "bridged_kl_mean": sum(v["bridged_kl"] for v in vs) / n,
        }
    if pooled:
        flips = [r["rounding_flips"] for r in rows_out]
        result["rounding_flips"] = {
            "what": "values of the bridged blocks (from the prefill engine's layer inputs) that differ from the "
                    "decoder's own export of the same prompt, per stored field: a flipped fp8/fp4 rounding step",
            **{field: {"differing": sum(f[field][0] for f in flips), "values": sum(f[field][1] for f in flips)}
               for field, counts in flips[0].items() if isinstance(counts, tuple)},
            "blocks_bit_identical": sum(f["blocks_identical"] for f in flips),
            "blocks": sum(f["blocks"] for f in flips),
        }
    log(f"{row.family}/{row.cache_dtype}: exact {result['tensors_exact']}/{result['tensors_total']}, first-token "
        f"{result['first_token_agreement']:.2f}, KL {result['kl_mean']:.2e}, payload ratio {result['payload_ratio']}")
    return result


def write(out: Path, kept: dict, key) -> dict:
    """models.json and MODELS.md from the rows measured so far, in ROWS order."""
    order = {(r.family, r.model, r.cache_dtype, r.kv_bits or 0): i for i, r in enumerate(ROWS)}
    rows = sorted(kept.values(), key=lambda r: order.get(key(r), len(order)))
    results = {
        "generated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "wall_s": round(sum(r["wall_s"] for r in rows), 1),
        "block_tokens": BLOCK_TOKENS,
        "rows": rows,
    }
    out.write_text(json.dumps(results, indent=2) + "\n")
    write_models_md(results)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", help="comma list of families, or family:dtype, to run (default: all); their rows "
                                  "replace the same rows of an existing models.json, the others stay")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--run-dir", default="var/bench-models")
    args = p.parse_args()
    wanted = args.rows.split(",") if args.rows else []
    chosen = [r for r in ROWS if not wanted or r.family in wanted or f"{r.family}:{r.cache_dtype}" in wanted]
    out = ROOT / args.out / "models.json"
    key = lambda r: (r["family"], r["model"], r["cache_dtype"], r["kv_bits"])  # noqa: E731
    kept = {}
    if args.rows and out.is_file():
        kept = {key(r): r for r in json.loads(out.read_text())["rows"]}
    texts = corpora()
    for row in chosen:
        log(f"row {row.family} ({row.model}, {row.cache_dtype}, kv_bits {row.kv_bits})")
        result = run_row(row, args, texts)
        kept[key(result)] = result
        # After every row: a long run stopped halfway keeps what it measured.
        results = write(out, kept, key)
    log(f"wrote {out} and MODELS.md ({results['wall_s']:.0f} s of runs)")
    print(support_table(results["rows"]))
    return 0 if all(r["bridged"] and r["tensors_exact"] == r["tensors_total"] for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
