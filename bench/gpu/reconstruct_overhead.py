#!/usr/bin/env python3
"""GPU cost of pd-bridge's reconstruction next to the prefill it rides on (issue 5, item 5).

What the prefill plugin does for every layer of every block (``prefilld/engine/pdbridge_vllm/
reconstruct.py`` does it with MLX on CPU), done here with torch/Triton on one CUDA GPU:

    x = rms_norm(h, w_norm, eps)            h: captured residual entering the layer (bf16), fp32 accumulation
    k = x @ dequant(Wk).T ; v = x @ dequant(Wv).T      MLX affine 4-bit (uint32-packed, LSB first,
                                                     per-group scale and bias), fp16 = decoder dtype
    k = rope(k, positions offset..offset+T)  rotate-half ("traditional": false), base 500000
    pack K and V per (layer, block of 256) into contiguous [1, n_kv, 256, head_dim] fp16 tensors,
    async D2H into pinned host memory.

Three implementations of that math (all produce the same packed layout):
  eager        dequantize in torch (unpack, scale*q + bias) -> cuBLAS fp16 GEMM (k and v in one GEMM)
               -> RoPE, cast and pack in eager torch ops.                                  [(a)]
  cublas_fused Triton RMSNorm, Triton dequant kernel, cuBLAS GEMM, one Triton RoPE+cast+pack
               kernel (the GEMM output is read once, the packed layout written once).       [(a), fused glue]
  triton_w4a16 Triton RMSNorm, then one Triton kernel: 4-bit GEMM with dequantization in the
               K loop and RoPE+cast+pack in the epilogue (nothing but x and the packed
               output touch device memory).                                                   [(b)]

The prefill it is compared with: 32 Llama-3-8B-shaped layers (hidden 4096, 32 q / 8 kv heads of
128, ffn 14336), bf16, random weights, run in chunks of --chunk tokens (8192, vLLM's default token
budget on a >70 GB Hopper card for the API server) attending to a contiguous KV prefix with
FlashAttention-2 (torch's SDPA flash kernel, causal aligned bottom-right, GQA native).

Timing: CUDA events, warm-up, repeats, median; no host sync inside a timed region except the one
after it. Reconstruction runs on a side stream and its D2H copies on a third; they wait on events
recorded by the prefill stream, never on the host.

The prefill model is `llama_prefill.py`, the three kernels and their check `recon_kernels.py`,
the timed stream runs `recon_streams.py`; this script drives them and writes the result.

Usage:  python bench/gpu/reconstruct_overhead.py --out DIR   (GPU)
        python bench/gpu/reconstruct_overhead.py --smoke     (CPU, tiny shapes, Triton interpreter:
                                                              correctness of the math only)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

if "--smoke" in sys.argv:  # must precede triton's import: @triton.jit reads it at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from llama_prefill import CACHE_DTYPE, MODEL_DTYPE, Cfg, Prefill, check_attention, rope_tables, run_prefill  # noqa: E402
from recon_kernels import HAVE_TRITON, TRITON_VERSION, check_recon, make_bundle, reconstruct  # noqa: E402
from recon_streams import (Bufs, cuda_time, med, run_capture_only, run_d2h_only,  # noqa: E402
                           run_overlapped, run_recon_serial)


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

NOTES = [
    "Prefill baseline: 32 Llama-3-8B-shaped layers (hidden 4096, 32 q / 8 kv heads x 128, ffn "
    "14336, SwiGLU, RMSNorm, rotate-half RoPE base 500000), bf16, random weights, no embedding / "
    "lm_head (one logit row is negligible). Chunked prefill with CHUNK-token chunks, each attending "
    "to a contiguous bf16 KV prefix; attention = FlashAttention-2 through torch's "
    "aten._scaled_dot_product_flash_attention (causal bottom-right, GQA native unless noted). "
    "vLLM on Hopper uses FlashAttention-3 and fused norm/RoPE/activation kernels, so a real vLLM "
    "prefill is likely faster than this baseline (mostly in attention at long lengths): "
    "prefill_no_attention_ms is the same forward with attention skipped, a lower bound.",
    "Reconstruction: RMSNorm (fp32 accumulation) of the captured bf16 residual -> fp16; MLX affine "
    "4-bit k/v projections (uint32-packed nibbles LSB first, fp16 scales and biases per group, "
    "GROUP elements a group; k and v stacked in one [2048, 4096] matrix); rotate-half RoPE on K "
    "(fp32 angles, base 500000, positions offset per chunk); cast to fp16; packed per (layer, block "
    "of 256 tokens) into contiguous [1, 8, 256, 128] tensors ([L, nb, 2, 8, 256, 128] per chunk), "
    "then async D2H into pinned host memory. Weights are dequantized on every call (no cached "
    "dense copy).",
    "reconstruct_ms_serial: the best variant for all 32 layers and all blocks of the prompt, plus "
    "the D2H of the result, on one stream with nothing else running (compute then copy, per chunk). "
    "reconstruct_compute_ms: the same without D2H, per variant.",
    "Overlapped: prefill on the main stream capturing each layer's input into a double-buffered "
    "capture buffer (a device copy, included in the cost), reconstruction on a side stream and D2H "
    "per layer on a copy stream, synchronised only by CUDA events (no host sync until the end). "
    "reconstruct_ms_overlapped_extra = median wall time of that minus median prefill_ms. "
    "granularity 'chunk' starts a chunk's reconstruction after its prefill step (vLLM's "
    "extract_hidden_states delivers states per step); 'layer' starts layer l as soon as its input "
    "is captured (an in-model hook). overhead_pct_overlapped uses 'chunk'.",
    "d2h_gbps: pinned D2H bandwidth copying the whole prompt's packed cache alone (one copy per "
    "chunk, 10^9 bytes/s); d2h_gbps_during_overlap: bytes over the summed durations of the per-layer "
    "copies in the overlapped run (last repeat). Host-side consumption of the pinned buffers (framing, socket) is not modelled.",
]


def gpu_main(args):
    t_start = time.time()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = Cfg(group=args.group)
    lengths = [int(x) for x in args.lengths.split(",")]
    max_T = max(lengths)
    chunk = args.chunk
    os.makedirs(args.out, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    res = dict(
        device=torch.cuda.get_device_name(0),
        sm_count=props.multi_processor_count,
        gpu_mem_gib=round(props.total_memory / 2**30, 1),
        torch_version=torch.__version__, cuda_version=torch.version.cuda,
        triton_version=TRITON_VERSION,
        python=platform.python_version(),
        prefill_dtype="bfloat16", cache_dtype="float16", group_size=cfg.group, bits=cfg.bits,
        chunk_tokens=chunk, block_tokens=cfg.block,
        cache_bytes_per_token=cfg.cache_bytes_per_token,
        hidden_state_bytes_per_token=cfg.layers * cfg.hidden * 2,
        method_notes=[n.replace("CHUNK", str(chunk)).replace("GROUP", str(cfg.group)) for n in NOTES],
        lengths=[], skipped=[], log=[],
    )

    def log(msg):
        line = f"[{time.time() - t_start:7.1f}s] {msg}"
        print(line, flush=True)
        res["log"].append(line)

    def save():
        with open(os.path.join(args.out, "gpu_reconstruct.json"), "w") as f:
            json.dump(res, f, indent=1)

    def left():
        return args.budget_s - (time.time() - t_start)

    gen = torch.Generator(device=device).manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)

    # ceilings
    a = torch.randn(8192, 8192, device=device, dtype=MODEL_DTYPE)
    main = torch.cuda.Stream()
    t = cuda_time(lambda: a @ a, 10, 3, main)
    res["ceiling_bf16_matmul_tflops"] = round(2 * 8192**3 / (med(t) * 1e-3) / 1e12, 1)
    del a
    log(f"device {res['device']}, torch {torch.__version__}, bf16 8192^3 "
        f"{res['ceiling_bf16_matmul_tflops']} TFLOP/s")

    model = Prefill(cfg, max_T, chunk, device, gen)
    impl, att_check = check_attention(model, device)
    model.attn_impl = impl
    res["attention_impl"] = impl
    res["attention_check_rel_err"] = att_check
    log(f"attention path {impl}: {att_check}")

    bundle = make_bundle(cfg, cfg.group, device, cpu_gen)
    variants = ["eager"] + (["cublas_fused", "triton_w4a16"] if HAVE_TRITON else [])
    t0 = time.time()
    res["correctness"] = check_recon(cfg, bundle, variants, device, model.cos, model.sin)
    bundle32 = make_bundle(cfg, 32, device, cpu_gen, n_layers=cfg.layers)
    res["correctness_group32"] = check_recon(cfg, bundle32, variants, device, model.cos, model.sin)
    log(f"correctness ({time.time() - t0:.1f}s, includes Triton compile): "
        + json.dumps({k: {kk: (round(vv, 6) if isinstance(vv, float) else vv)
                          for kk, vv in v.items()} for k, v in res["correctness"].items()}))
    ok_variants = [v for v in variants
                   if all(r.get("ok") for k, r in res["correctness"].items() if k.endswith("_" + v))]
    res["variants_ok"] = ok_variants
    if not ok_variants:
        raise RuntimeError("no reconstruction variant passed the correctness check")

    bufs = Bufs(cfg, chunk, device)
    side = torch.cuda.Stream()
    copy = torch.cuda.Stream()
    streams = (main, side, copy)
    save()

    for T in lengths:
        if left() < 20:
            res["skipped"].append(f"{T}: time budget spent")
            log(f"skip {T}: time budget spent")
            continue
        C = min(chunk, T)
        assert T % C == 0 and C % cfg.block == 0
        R, W = (5, 1) if T <= 32768 else (3, 0)
        row = dict(tokens=T, chunk_tokens=C, n_chunks=T // C, repeats=R, warmup=W,
                   cache_bytes_per_token=cfg.cache_bytes_per_token,
                   cache_bytes_total=T * cfg.cache_bytes_per_token)
        res["lengths"].append(row)
        try:
            p = cuda_time(lambda: run_prefill(model, T, C), R, W, main)
            row["prefill_ms"] = med(p)
            row["prefill_ms_all"] = [round(x, 2) for x in p]
            row["prefill_tok_s"] = T / (med(p) * 1e-3)
            log(f"T={T}: prefill {med(p):.1f} ms ({row['prefill_tok_s']:.0f} tok/s) {row['prefill_ms_all']}")
            p2 = cuda_time(lambda: run_prefill(model, T, C, attention=False), min(R, 3), W, main)
            row["prefill_no_attention_ms"] = med(p2)
            comp = {}
            for var in ok_variants:
                t = cuda_time(lambda: run_recon_serial(cfg, bundle, var, bufs, T, C, model.cos,
                                                       model.sin, d2h=False), 5, 1, main)
                comp[var] = med(t)
            row["reconstruct_compute_ms"] = comp
            best = min(comp, key=comp.get)
            row["variant"] = best
            if T == 8192:
                comp32 = {}
                for var in ok_variants:
                    t = cuda_time(lambda: run_recon_serial(cfg, bundle32, var, bufs, T, C,
                                                           model.cos, model.sin, d2h=False), 5, 1, main)
                    comp32[var] = med(t)
                row["reconstruct_compute_ms_group32"] = comp32
            t = cuda_time(lambda: run_recon_serial(cfg, bundle, best, bufs, T, C, model.cos,
                                                   model.sin, d2h=True), 5, 1, main)
            row["reconstruct_ms_serial"] = med(t)
            t = cuda_time(lambda: run_d2h_only(cfg, bufs, T, C), 5, 1, main)
            row["d2h_ms"] = med(t)
            row["d2h_gbps"] = T * cfg.cache_bytes_per_token / (med(t) * 1e-3) / 1e9
            t = cuda_time(lambda: run_capture_only(cfg, model, bufs, T, C), 3, 1, main)
            row["capture_copy_ms"] = med(t)
            row["overhead_pct_serial"] = 100 * row["reconstruct_ms_serial"] / row["prefill_ms"]
            log(f"T={T}: recon compute {json.dumps({k: round(v, 2) for k, v in comp.items()})} ms; "
                f"serial (best={best}, +D2H) {row['reconstruct_ms_serial']:.2f} ms "
                f"= {row['overhead_pct_serial']:.2f}%; D2H {row['d2h_ms']:.2f} ms "
                f"{row['d2h_gbps']:.1f} GB/s; capture copies {row['capture_copy_ms']:.2f} ms; "
                f"no-attention prefill {row['prefill_no_attention_ms']:.1f} ms")
            save()
            row["overlapped"] = {}
            for gran in ("chunk", "layer"):
                need = (R + W) * (row["prefill_ms"] + row["reconstruct_ms_serial"]) * 1e-3 * 1.2 + 2
                if left() < need:
                    res["skipped"].append(f"{T}: overlapped/{gran} (needs ~{need:.0f}s, "
                                          f"{left():.0f}s left)")
                    log(f"skip overlapped {gran} at {T}: budget")
                    continue
                d2h_log = []
                t = cuda_time(lambda: run_overlapped(cfg, model, bundle, best, bufs, T, C, streams,
                                                     gran, d2h_log), R, W, main)
                per_run = len(d2h_log) // (R + W)
                last = d2h_log[-per_run:]
                busy = sum(x[0].elapsed_time(x[1]) for x in last)   # copy-stream busy time
                nbytes = sum(x[2] for x in last)
                extra = med(t) - row["prefill_ms"]
                row["overlapped"][gran] = dict(
                    wall_ms=med(t), wall_ms_all=[round(x, 2) for x in t], extra_ms=extra,
                    extra_pct=100 * extra / row["prefill_ms"],
                    d2h_gbps=nbytes / (busy * 1e-3) / 1e9 if busy > 0 else None,
                    d2h_busy_ms=busy, d2h_bytes=nbytes)
                log(f"T={T}: overlapped/{gran} wall {med(t):.1f} ms, extra {extra:.2f} ms "
                    f"({100 * extra / row['prefill_ms']:.2f}%) {row['overlapped'][gran]['wall_ms_all']}")
            if "chunk" in row["overlapped"]:
                row["reconstruct_ms_overlapped_extra"] = row["overlapped"]["chunk"]["extra_ms"]
                row["overhead_pct_overlapped"] = row["overlapped"]["chunk"]["extra_pct"]
                g = row["overlapped"]["chunk"]
                row["d2h_gbps_during_overlap"] = g["d2h_gbps"]
            # what the link would need: the packed fp16 cache over 10 GbE (~1.16 GB/s)
            row["link_10gbe_s"] = T * cfg.cache_bytes_per_token / 1.16e9
            row["link_tok_s_10gbe"] = 1.16e9 / cfg.cache_bytes_per_token
        except Exception as ex:  # noqa: BLE001
            row["error"] = f"{type(ex).__name__}: {ex}"
            log(f"T={T}: ERROR {row['error']}\n{traceback.format_exc()}")
            torch.cuda.synchronize()
        save()

    res["elapsed_s"] = time.time() - t_start
    save()
    # final table
    print("\n tokens | prefill ms | tok/s | recon serial ms | serial % | ovl extra ms (chunk/layer)"
          " | ovl % | D2H GB/s | variant | compute ms per variant")
    for r in res["lengths"]:
        if "prefill_ms" not in r:
            print(f" {r['tokens']:6d} | {r.get('error', 'not run')}")
            continue
        ov = r.get("overlapped", {})
        oc = ov.get("chunk", {}).get("extra_ms")
        ol = ov.get("layer", {}).get("extra_ms")
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        print(f" {r['tokens']:6d} | {r['prefill_ms']:10.1f} | {r['prefill_tok_s']:6.0f} | "
              f"{fmt(r.get('reconstruct_ms_serial'))} | {fmt(r.get('overhead_pct_serial'))} | "
              f"{fmt(oc)}/{fmt(ol)} | {fmt(r.get('overhead_pct_overlapped'))} | "
              f"{fmt(r.get('d2h_gbps'))} | {r.get('variant')} | "
              f"{json.dumps({k: round(v, 2) for k, v in r.get('reconstruct_compute_ms', {}).items()})}")
    print(f"elapsed {res['elapsed_s']:.0f}s; skipped: {res['skipped']}")


def smoke_main(args):
    """CPU, tiny shapes: the three variants (Triton in its interpreter) against the float64
    reference, and one prefill chunk through the math attention path."""
    torch.manual_seed(0)
    cfg = Cfg(hidden=256, layers=2, n_q=4, n_kv=2, head_dim=64, ffn=512, block=16, group=32)
    dev = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    cos, sin = rope_tables(cfg, 4096, dev)
    bundle = make_bundle(cfg, cfg.group, dev, gen)
    variants = ["eager"] + (["cublas_fused", "triton_w4a16"] if HAVE_TRITON else [])
    res = check_recon(cfg, bundle, variants, dev, cos, sin, C=64, start=1000)
    for k, v in res.items():
        print(k, v)
    model = Prefill(cfg, 256, 64, dev, torch.Generator().manual_seed(0))
    model.attn_impl = "math"
    cap = torch.empty(cfg.layers, 64, cfg.hidden, dtype=MODEL_DTYPE)
    model.forward_chunk(0, 64, capture=cap)
    h = model.forward_chunk(64, 64, capture=cap)
    out = torch.empty(cfg.layers, 4, 2, cfg.n_kv, cfg.block, cfg.head_dim, dtype=CACHE_DTYPE)
    reconstruct(cfg, bundle, "eager", cap, 64, out, cos, sin)
    print("prefill ok", tuple(h.shape), bool(torch.isfinite(h.float()).all()),
          "recon finite", bool(torch.isfinite(out.float()).all()))
    assert all(r["ok"] for r in res.values()), res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="stop starting new measurements after this many seconds")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        smoke_main(args)
    else:
        gpu_main(args)


if __name__ == "__main__":
    main()
