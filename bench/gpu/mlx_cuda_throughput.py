#!/usr/bin/env python3
"""`mlx_cuda.py throughput`: the plugin's cache path (`pdbridge_cache.layers.CachePath`) on MLX's
CUDA backend at real model shapes with random 4-bit weights, per family, dtype, chunk and variant
(shipped: MLX's quantized matmul; dense: the weights dequantized once); what moving captured states
from torch to MLX costs; and the reconstruction's share of torch's prefill of a Llama-3-8B shape
(`llama_prefill.py`), serial and overlapped on a thread of its own."""

from __future__ import annotations

import importlib
import queue
import statistics
import threading
import time
import traceback

import mlx.core as mx
import mlx.nn as nn

from mlx_cuda_device import DTYPES, GPU, SMOKE, checkpoint, log
from pdbridge_cache import kinds
from pdbridge_cache.layers import CachePath


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

    from llama_prefill import Cfg, Prefill, chunks_of  # beside this script, so on its path

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
