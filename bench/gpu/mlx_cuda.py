#!/usr/bin/env python3
"""The plugin's reconstruction on a GPU with the code that ships, and exactness across backends
(issue 17). Runs where MLX has its CUDA backend (`mlx[cuda13]`) beside torch; `kit.sh`
says how it travels to a lent H200.

throughput  `pdbridge_cache.layers.CachePath` — the class the vLLM plugin reconstructs with — on
            `mx.gpu`, at real model shapes with random 4-bit weights (what a Mac decoder loads),
            per family, dtype, chunk of tokens per call and variant:
              shipped  the decoder's modules as they are (MLX's quantized matmul on 4-bit weights);
              dense    the same modules after mlx-lm's `dequantize_model`: each weight dequantized
                       once to the compute dtype, dense GEMMs.
            `layers_measured` of a family's layers are built; tok/s is scaled to its full depth.
            Beside it, torch's prefill of a Llama-3-8B shape (`reconstruct_overhead.py`'s, bf16,
            FlashAttention, chunks of 8192) at 8K-128K tokens: the reconstruction's share of the
            prefill, serial, and overlapped (MLX on its own thread reconstructing each chunk while
            torch prefills the next, as the plugin's streamer thread does beside vLLM's step loop).
            Also what moving captured states from torch to MLX costs (DLPack vs through the host).
fidelity    SmolLM2-135M, 4-bit (the test model's weights, embedding quantized too so it travels):
            its native prefill on MLX's CPU backend gives every layer's input — in a bridge, the
            prefill engine's output. The cache path rebuilds the cache from those inputs on the CPU
            and on CUDA, block by block as the plugin does; per backend pair, elements exact and
            max ulp. Then the decoder on backend B continues from the cache built on A and from the
            one built on B (its own kernels — what an exact mode gives): first-token agreement, KL
            of the first-token distributions, agreement of 32 greedy tokens, per prompt length.

    python bench/gpu/mlx_cuda.py throughput --out DIR [--quick]
    python bench/gpu/mlx_cuda.py fidelity --model DIR --out DIR [--prompts 8]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import queue
import re
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pdbridge_cache import kinds
from pdbridge_cache.check import native_prefill
from pdbridge_cache.layers import CachePath

ROOT = Path(__file__).resolve().parents[2]

BLOCK_TOKENS = 256
# `--smoke` (anywhere, CPU only): the same code on MLX's CPU backend standing in for CUDA, tiny sizes.
SMOKE = "--smoke" in sys.argv
GPU = mx.cpu if SMOKE else mx.gpu
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}

# Real shapes (their attention paths; the vocabulary is cut, nothing here reads it).
FAMILIES = {
    "llama3_8b": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, vocab_size=1024,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
    "qwen3_8b": dict(
        model_type="qwen3", hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, vocab_size=1024,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False),
    "gemma3_12b": dict(
        model_type="gemma3_text", hidden_size=3840, num_hidden_layers=48, intermediate_size=15360,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6, vocab_size=1024,
        sliding_window=1024, sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        query_pre_attn_scalar=256, max_position_embeddings=131072),
    "deepseek_v3": dict(
        model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, intermediate_size=18432,
        moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rms_norm_eps=1e-6,
        vocab_size=1024, rope_theta=10000.0, max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def checkpoint(args, result: dict) -> None:
    """What is measured so far, so a run cut short by its time limit still leaves it."""
    Path(args.out, f"{args.what}.json").write_text(json.dumps({**result, "complete": False}, indent=1, default=str))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build(config: dict, layers: int, dtype: mx.Dtype, variant: str) -> CachePath:
    """The decoder's cache path for `config` cut to `layers` layers: mlx-lm's own model class,
    random weights quantized to 4 bits (group 64) as a Mac decoder's model is."""
    from mlx_lm.utils import dequantize_model

    config = {**config, "num_hidden_layers": layers}
    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = family.Model(family.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    nn.quantize(model, group_size=64, bits=4)
    if variant == "dense":
        model = dequantize_model(model)
    path = CachePath(model, kinds.decoder_caches(model, None, 64), dtype)
    mx.eval([(model.layers[i].input_layernorm.parameters(), path.module(i).parameters()) for i in path.layers])
    return path


def median_s(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def reconstruct_rate(path: CachePath, chunk: int, hidden_size: int, dtype: mx.Dtype, offset: int = 8192,
                     streams: int = 1, reps: int = 5) -> float:
    """Seconds per `chunk` tokens over the path's layers (one `block` call: one eval)."""
    hidden = mx.random.normal((chunk, len(path.layers), hidden_size)).astype(dtype)
    mx.eval(hidden)
    on = [mx.new_stream(GPU) for _ in range(streams)] if streams > 1 else None
    return median_s(lambda: path.block(hidden, offset, on), reps)


def throughput(args) -> dict:
    mx.set_default_device(GPU)
    rows, errors = [], {}
    chunks = [256] if SMOKE else [2048] if args.quick else [256, 2048, 8192]
    families = ["llama3_8b"] if args.quick else list(FAMILIES)
    for family in families:
        config = FAMILIES[family]
        total = config["num_hidden_layers"]
        measured = min(total, args.layers)
        for dtype_name in ("bfloat16", "float32"):
            for variant in ("shipped", "dense"):
                try:
                    path = build(config, measured, DTYPES[dtype_name], variant)
                    for chunk in chunks:
                        for streams in ((1, 4) if variant == "shipped" and chunk == 2048 else (1,)):
                            s = reconstruct_rate(path, chunk, config["hidden_size"], DTYPES[dtype_name], streams=streams)
                            tok_s = chunk / s * measured / total
                            rows.append({"family": family, "dtype": dtype_name, "variant": variant, "chunk": chunk,
                                         "mlx_streams": streams, "layers_measured": measured, "layers_total": total,
                                         "ms_per_chunk_measured": s * 1e3, "tok_s_full_depth": tok_s})
                            log(f"{family} {dtype_name} {variant} chunk {chunk} streams {streams}: "
                                f"{tok_s / 1e3:.1f}K tok/s at {total} layers")
                    del path
                except Exception as e:  # a family MLX CUDA cannot run: recorded, not fatal
                    errors[f"{family}/{dtype_name}/{variant}"] = f"{type(e).__name__}: {e}"
                    log(f"{family} {dtype_name} {variant}: {errors[f'{family}/{dtype_name}/{variant}']}")
                    traceback.print_exc()
                mx.clear_cache()
        checkpoint(args, {"reconstruction": rows, "errors": errors})
    result = {"reconstruction": rows, "errors": errors}
    if not SMOKE:
        result["transfer"] = transfer_cost()
        result["share"] = prefill_share(args)
    return result


def transfer_cost() -> dict:
    """Captured states [2048 tokens, 32 layers, 4096] bf16 from torch (CUDA) into MLX (CUDA)."""
    import torch

    t = torch.randn(2048, 32, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    out = {"tokens": 2048, "bytes": t.numel() * 2}

    def via_host():
        mx.eval(mx.array(t.view(torch.int16).cpu().numpy()).view(mx.bfloat16))

    out["via_host_ms"] = median_s(via_host, 5) * 1e3
    try:
        def via_dlpack():
            mx.eval(mx.from_dlpack(t))

        out["dlpack_ms"] = median_s(via_dlpack, 5) * 1e3
        same = mx.from_dlpack(t).view(mx.int16)
        out["dlpack_equal"] = bool(mx.array_equal(same, mx.array(t.view(torch.int16).cpu().numpy())).item())
    except Exception as e:
        out["dlpack_error"] = f"{type(e).__name__}: {e}"
    return out


def prefill_share(args) -> dict:
    """The best llama3_8b reconstruction next to torch's prefill of the same shape, serial and overlapped."""
    import torch

    from reconstruct_overhead import Cfg, Prefill, chunks_of  # beside this script, so on its path

    cfg, chunk = Cfg(), 8192
    lengths = [8192, 32768, 131072] if not args.quick else [8192]
    gen = torch.Generator(device="cuda").manual_seed(0)
    model = Prefill(cfg, max(lengths), chunk, torch.device("cuda"), gen)
    out = {"prefill_model": "torch, Llama-3-8B shape, bf16, FlashAttention, chunks of 8192", "lengths": []}
    for dtype_name, variant in (("bfloat16", "dense"), ("bfloat16", "shipped")):
        path = build(FAMILIES["llama3_8b"], cfg.layers, mx.bfloat16, variant)
        hidden = mx.random.normal((chunk, cfg.layers, cfg.hidden)).astype(mx.bfloat16)
        mx.eval(hidden)
        for T in lengths:
            pieces = chunks_of(T, chunk)

            def prefill():
                for start, c in pieces:
                    model.forward_chunk(start, c)
                torch.cuda.synchronize()

            def reconstruct():
                for start, c in pieces:
                    path.block(hidden[:c], start)

            def overlapped():
                ready: queue.Queue = queue.Queue()

                def worker():
                    while (item := ready.get()) is not None:
                        event, start, c = item
                        event.synchronize()
                        path.block(hidden[:c], start)

                thread = threading.Thread(target=worker)
                thread.start()
                for start, c in pieces:
                    model.forward_chunk(start, c)
                    event = torch.cuda.Event()
                    event.record()
                    ready.put((event, start, c))
                ready.put(None)
                thread.join()
                torch.cuda.synchronize()

            reps = 3 if T <= 32768 else 1
            p = median_s(prefill, reps, warmup=1)
            r = median_s(reconstruct, reps, warmup=1)
            o = median_s(overlapped, reps, warmup=1)
            row = {"tokens": T, "dtype": dtype_name, "variant": variant, "prefill_ms": p * 1e3,
                   "reconstruct_ms": r * 1e3, "overlapped_ms": o * 1e3,
                   "share_serial_pct": 100 * r / p, "share_overlapped_pct": 100 * (o - p) / p}
            out["lengths"].append(row)
            log(f"share {variant} {T}: prefill {p * 1e3:.0f} ms, reconstruct {r * 1e3:.0f} ms "
                f"({row['share_serial_pct']:.1f} %), overlapped +{row['share_overlapped_pct']:.1f} %")
        del path
        mx.clear_cache()
    return out


# ---------------------------------------------------------------------------------------------
# fidelity
# ---------------------------------------------------------------------------------------------

def corpus() -> str:
    """Real prose: the repo's LICENSE and the license texts of this Python's installed packages."""
    files = [ROOT / "LICENSE"]
    for site in sorted({Path(p) for p in sys.path if p.endswith("site-packages")}):
        files += sorted(f for f in site.glob("*.dist-info/*") if re.match(r"(?i)licen[cs]e", f.name) and f.is_file())
    seen, parts = set(), []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > 500 and text not in seen:
            seen.add(text)
            parts.append(text)
    return "\n\n".join(parts)


def blocks_on(device, path: CachePath, hidden: list, n: int) -> list[dict[str, list]]:
    """Each layer's tensors for tokens [0, n), block by block as the plugin sends them, computed on `device`."""
    parts: list[dict[str, list]] = [dict() for _ in path.layers]
    with mx.stream(mx.default_stream(device)):
        for lo in range(0, n, BLOCK_TOKENS):
            hi = min(lo + BLOCK_TOKENS, n)
            inputs = mx.stack([hidden[layer][lo:hi] for layer in path.layers], axis=1)
            for layer, name, array in path.block(inputs, lo, [mx.default_stream(device)]):
                parts[layer].setdefault(name, []).append(array)
    return parts


def ordered_bits(x: mx.array) -> np.ndarray:
    """A float tensor's bit patterns as integers in the order of the values, so that the distance
    of two is their distance in units in the last place of the tensor's own dtype."""
    width = x.dtype.size * 8
    i = np.array(x.view({16: mx.int16, 32: mx.int32}[width])).astype(np.int64)
    return np.where(i < 0, -(1 << (width - 1)) - i, i)


def compare(a: list[dict[str, list]], b: list[dict[str, list]]) -> tuple[int, int, int, float]:
    """(elements equal, elements, max ulp, max |difference| over the tensor's largest |value|)
    between two reconstructions."""
    equal = total = ulp = 0
    rel = 0.0
    for la, lb in zip(a, b):
        for name in la:
            for x, y in zip(la[name], lb[name]):
                same = np.array(x == y)
                equal, total = equal + int(same.sum()), total + same.size
                ulp = max(ulp, int(np.abs(ordered_bits(x) - ordered_bits(y)).max()))
                xf, yf = np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))
                rel = max(rel, float(np.abs(xf - yf).max() / max(np.abs(yf).max(), 1e-30)))
    return equal, total, ulp, rel


def continue_from(device, model, path: CachePath, parts: list, n: int, last: int, steps: int):
    """The decoder on `device` after a cache restored from `parts` (tokens [0, n)), fed `last`:
    (first-token log-probabilities, greedy tokens)."""
    with mx.stream(mx.default_stream(device)):
        moved = [{k: [mx.array(x) for x in v] for k, v in layer.items()} for layer in parts]
        cache = kinds.restore(path.templates, moved, n, path.dtype)
        y, first, tokens = mx.array([[last]]), None, []
        for _ in range(steps):
            logits = model(y, cache=cache)[:, -1, :].astype(mx.float32)
            if first is None:
                first = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = mx.argmax(logits, axis=-1)
            tokens.append(token.item())
            y = token[None]
        return np.array(first[0]), tokens


def fidelity(args) -> dict:
    from mlx_lm.utils import load_model
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    ids = tokenizer.encode(corpus()).ids
    log(f"corpus: {len(ids)} tokens")
    backends = {"cpu": mx.cpu, "cuda": GPU}
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        model, _ = load_model(Path(args.model))
        model.set_dtype(dtype)
        path = CachePath(model, kinds.decoder_caches(model, None, 64), dtype)
        for length in (int(x) for x in args.lengths.split(",")):
            stats = {pair: {"equal": 0, "total": 0, "ulp": 0, "rel": 0.0, "first_same": 0, "kl": [], "greedy_same": 0}
                     for pair in ("cuda->cpu", "cpu->cuda")}
            for p in range(args.prompts):
                start = (p * 7919 * 3) % max(1, len(ids) - length)
                tokens = ids[start:start + length]
                mx.set_default_device(mx.cpu)
                _, hidden, _ = native_prefill(model, tokens[:-1], 2048, {})  # the prefill engine's layer inputs
                built = {name: blocks_on(device, path, hidden, length - 1) for name, device in backends.items()}
                for pair in stats:
                    src, dst = pair.split("->")
                    s = stats[pair]
                    e, t, u, r = compare(built[src], built[dst])
                    s["equal"], s["total"], s["ulp"], s["rel"] = s["equal"] + e, s["total"] + t, max(s["ulp"], u), max(s["rel"], r)
                    mx.set_default_device(backends[dst])
                    theirs = continue_from(backends[dst], model, path, built[src], length - 1, tokens[-1], args.steps)
                    own = continue_from(backends[dst], model, path, built[dst], length - 1, tokens[-1], args.steps)
                    p_own = np.exp(own[0])
                    s["kl"].append(float(np.sum(p_own * (own[0] - theirs[0]))))
                    s["first_same"] += int(own[1][0] == theirs[1][0])
                    s["greedy_same"] += int(own[1] == theirs[1])
                mx.set_default_device(mx.cpu)
                # After every prompt: a run cut short by its time limit keeps the prompts it finished.
                done = [{"dtype": dtype_name, "prompt_tokens": length, "pair": pair, "prompts": p + 1,
                         "elements_exact_pct": 100 * s["equal"] / s["total"], "max_ulp": s["ulp"],
                         "max_rel_diff": s["rel"],
                         "first_token_agreement": s["first_same"] / (p + 1),
                         f"greedy_{args.steps}_agreement": s["greedy_same"] / (p + 1),
                         "kl_mean": statistics.mean(s["kl"]), "kl_max": max(s["kl"])} for pair, s in stats.items()]
                checkpoint(args, {"model": Path(args.model).name, "rows": rows + done})
            rows += done
            for row in done:
                log(json.dumps(row))
        del model, path
    return {"model": Path(args.model).name, "block_tokens": BLOCK_TOKENS, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--layers", type=int, default=8, help="layers built per family (tok/s scaled to full depth)")
    t.add_argument("--quick", action="store_true")
    f = sub.add_parser("fidelity")
    f.add_argument("--model", required=True)
    f.add_argument("--prompts", type=int, default=8)
    f.add_argument("--lengths", default="512,2048,6144")
    f.add_argument("--dtypes", default="float32,bfloat16")
    f.add_argument("--steps", type=int, default=32)
    for s in (t, f):
        s.add_argument("--out", required=True)
        s.add_argument("--smoke", action="store_true", help="MLX's CPU backend standing in for CUDA")
    args = p.parse_args()
    started = time.time()
    result = throughput(args) if args.what == "throughput" else fidelity(args)
    import mlx_lm

    result.update({"complete": True, "what": args.what, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                   "device": mx.device_info() if hasattr(mx, "device_info") else str(mx.default_device()),
                   "python": platform.python_version(), "duration_s": round(time.time() - started, 1)})
    out = Path(args.out) / f"{args.what}.json"
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
