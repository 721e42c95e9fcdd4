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

Usage:  python bench/gpu/reconstruct_overhead.py --out DIR   (GPU)
        python bench/gpu/reconstruct_overhead.py --smoke     (CPU, tiny shapes, Triton interpreter:
                                                              correctness of the math only)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass

if "--smoke" in sys.argv:  # must precede triton's import: @triton.jit reads it at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402
    HAVE_TRITON = True
except Exception:  # pragma: no cover - triton missing
    HAVE_TRITON = False

CACHE_DTYPE = torch.float16  # the decoder's (mlx-lm) activation / cache dtype
MODEL_DTYPE = torch.bfloat16  # the prefill engine's dtype


@dataclass
class Cfg:
    hidden: int = 4096
    layers: int = 32
    n_q: int = 32
    n_kv: int = 8
    head_dim: int = 128
    ffn: int = 14336
    eps: float = 1e-5
    rope_theta: float = 500000.0
    block: int = 256
    group: int = 64
    bits: int = 4

    @property
    def kv_out(self) -> int:
        return self.n_kv * self.head_dim

    @property
    def cache_bytes_per_token(self) -> int:  # K and V, all layers, fp16
        return 2 * self.layers * self.kv_out * torch.finfo(CACHE_DTYPE).bits // 8


# ----------------------------------------------------------------------------------------------
# The decoder's reconstruction bundle (random, MLX affine 4-bit layout)
# ----------------------------------------------------------------------------------------------

def make_bundle(cfg: Cfg, group: int, device, gen: torch.Generator, n_layers: int | None = None):
    """Per layer: norm weight [H] fp16; k and v projections stacked as one [2*kv_out, H] matrix in
    MLX affine form: packed int32 [2*kv_out, H/8] (8 nibbles a word, element j at bits 4j..4j+3),
    scales and biases fp16 [2*kv_out, H/group]. Stacking Wk over Wv is a load-time concatenation;
    each row's numbers are MLX's."""
    n_layers = n_layers or cfg.layers
    N, H = 2 * cfg.kv_out, cfg.hidden
    out = []
    for _ in range(n_layers):
        wq = torch.randint(-(2**31), 2**31 - 1, (N, H // 8), dtype=torch.int32, generator=gen)
        s = 0.004 + 0.004 * torch.rand(N, H // group, generator=gen)   # ~N(0, 0.02)-like weights
        b = -7.5 * s + 0.002 * torch.randn(N, H // group, generator=gen)
        norm = 1.0 + 0.1 * torch.randn(H, generator=gen)
        out.append(dict(wq=wq.to(device), scales=s.to(CACHE_DTYPE).to(device),
                        biases=b.to(CACHE_DTYPE).to(device), norm=norm.to(CACHE_DTYPE).to(device),
                        group=group))
    return out


def rope_tables(cfg: Cfg, max_pos: int, device):
    """cos/sin [max_pos, head_dim/2] fp32; theta = pos * base^(-i/half) in fp32, as MLX's rope."""
    half = cfg.head_dim // 2
    inv = torch.exp(-torch.arange(half, dtype=torch.float32) * (math.log(cfg.rope_theta) / half))
    pos = torch.arange(max_pos, dtype=torch.float32)
    theta = pos[:, None] * inv[None, :]
    return theta.cos().contiguous().to(device), theta.sin().contiguous().to(device)


# ----------------------------------------------------------------------------------------------
# Reconstruction, three ways.  out: [nb, 2, n_kv, block, head_dim] (one layer's slice of the packed
# buffer; each [n_kv, block, head_dim] slab is a contiguous [1, n_kv, B, head_dim] tensor).
# ----------------------------------------------------------------------------------------------

def dequant_eager(wq, scales, biases, group):
    N, KW = wq.shape
    shifts = torch.arange(0, 32, 4, device=wq.device, dtype=torch.int32)
    q = (wq.unsqueeze(-1) >> shifts) & 0xF                      # [N, K/8, 8], element j of a word
    q = q.reshape(N, -1, group).to(torch.float32)
    w = q * scales.float().unsqueeze(-1) + biases.float().unsqueeze(-1)
    return w.reshape(N, KW * 8).to(scales.dtype)


def recon_layer_eager(cfg, lw, h, start, out, cos_t, sin_t, cdt=CACHE_DTYPE):
    C = h.shape[0]
    hf = h.float()
    x = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + cfg.eps)).to(cdt) * lw["norm"].to(cdt)
    W = dequant_eager(lw["wq"], lw["scales"].to(cdt), lw["biases"].to(cdt), lw["group"])
    kv = x @ W.t()                                              # [C, 2*kv_out] in cdt (fp32 accumulate)
    half = cfg.head_dim // 2
    k = kv[:, : cfg.kv_out].view(C, cfg.n_kv, cfg.head_dim).float()
    cos = cos_t[start:start + C, None, :]
    sin = sin_t[start:start + C, None, :]
    k1, k2 = k[..., :half], k[..., half:]
    kr = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1).to(cdt)
    nb = C // cfg.block
    out[:, 0].copy_(kr.view(nb, cfg.block, cfg.n_kv, cfg.head_dim).transpose(1, 2))
    out[:, 1].copy_(kv[:, cfg.kv_out:].view(nb, cfg.block, cfg.n_kv, cfg.head_dim).transpose(1, 2))


if HAVE_TRITON:
    @triton.jit
    def _rmsnorm_kernel(X, W, Y, stride_x, stride_y, eps, N: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, N)
        x = tl.load(X + row * stride_x + offs).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(W + offs)
        y = (x * r).to(Y.dtype.element_ty) * w
        tl.store(Y + row * stride_y + offs, y)

    @triton.jit
    def _dequant_kernel(WQ, SC, BI, W, K: tl.constexpr, G: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        k = tl.program_id(1) * BK + tl.arange(0, BK)
        pw = tl.load(WQ + n[:, None] * (K // 8) + (k // 8)[None, :])
        q = (pw >> ((k % 8) * 4)[None, :]) & 0xF
        s = tl.load(SC + n[:, None] * (K // G) + (k // G)[None, :]).to(tl.float32)
        b = tl.load(BI + n[:, None] * (K // G) + (k // G)[None, :]).to(tl.float32)
        tl.store(W + n[:, None] * K + k[None, :], (q.to(tl.float32) * s + b).to(W.dtype.element_ty))

    @triton.jit
    def _rope_pack_store(lo, hi, COS, SIN, OUT, offs_m, m_ok, offset, hid,
                         s_blk, s_kv, s_head, N_KV: tl.constexpr, HD: tl.constexpr,
                         BT: tl.constexpr):
        # lo/hi: fp32 [BM, HD/2], already rounded to the cache dtype (the projection's output).
        HALF: tl.constexpr = HD // 2
        offs_h = tl.arange(0, HALF)
        is_k = hid < N_KV
        pos = offset + offs_m
        rmask = m_ok[:, None] & is_k
        cs = tl.load(COS + pos[:, None] * HALF + offs_h[None, :], mask=rmask, other=1.0)
        sn = tl.load(SIN + pos[:, None] * HALF + offs_h[None, :], mask=rmask, other=0.0)
        o_lo = lo * cs - hi * sn                                   # V heads: cs=1, sn=0 -> exact copy
        o_hi = hi * cs + lo * sn
        kv = hid // N_KV
        head = hid % N_KV
        base = OUT + (offs_m // BT) * s_blk + kv * s_kv + head * s_head + (offs_m % BT) * HD
        tl.store(base[:, None] + offs_h[None, :], o_lo.to(OUT.dtype.element_ty), mask=m_ok[:, None])
        tl.store(base[:, None] + HALF + offs_h[None, :], o_hi.to(OUT.dtype.element_ty),
                 mask=m_ok[:, None])

    @triton.jit
    def _rope_pack_kernel(KV, COS, SIN, OUT, M, offset, stride_m, s_blk, s_kv, s_head,
                          N_KV: tl.constexpr, HD: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr):
        HALF: tl.constexpr = HD // 2
        hid = tl.program_id(1)
        offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
        offs_h = tl.arange(0, HALF)
        m_ok = offs_m < M
        src = KV + offs_m[:, None] * stride_m + hid * HD + offs_h[None, :]
        lo = tl.load(src, mask=m_ok[:, None], other=0.0).to(tl.float32)
        hi = tl.load(src + HALF, mask=m_ok[:, None], other=0.0).to(tl.float32)
        _rope_pack_store(lo, hi, COS, SIN, OUT, offs_m, m_ok, offset, hid, s_blk, s_kv, s_head,
                         N_KV, HD, BT)

    @triton.jit
    def _w4a16_rope_pack_kernel(X, WQ, SC, BI, COS, SIN, OUT, M, offset, stride_xm,
                                s_blk, s_kv, s_head,
                                K: tl.constexpr, G: tl.constexpr, N_KV: tl.constexpr,
                                HD: tl.constexpr, BT: tl.constexpr,
                                BM: tl.constexpr, BK: tl.constexpr):
        # One program: BM tokens x one head (128 outputs, as two halves so RoPE's rotate-half pairs
        # (i, i+64) meet in the epilogue). Heads 0..N_KV-1 are K (RoPE), N_KV..2N_KV-1 are V.
        HALF: tl.constexpr = HD // 2
        KW: tl.constexpr = K // 8
        KG: tl.constexpr = K // G
        hid = tl.program_id(1)
        offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
        offs_h = tl.arange(0, HALF)
        offs_k = tl.arange(0, BK)
        m_ok = offs_m < M
        n_lo = hid * HD + offs_h
        n_hi = n_lo + HALF
        acc_lo = tl.zeros((BM, HALF), dtype=tl.float32)
        acc_hi = tl.zeros((BM, HALF), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + offs_k
            a = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None], other=0.0)
            shift = ((kk % 8) * 4)[None, :]
            widx = (kk // 8)[None, :]
            gidx = (kk // G)[None, :]
            q = (tl.load(WQ + n_lo[:, None] * KW + widx) >> shift) & 0xF
            s = tl.load(SC + n_lo[:, None] * KG + gidx).to(tl.float32)
            b = tl.load(BI + n_lo[:, None] * KG + gidx).to(tl.float32)
            w = (q.to(tl.float32) * s + b).to(X.dtype.element_ty)
            acc_lo = tl.dot(a, tl.trans(w), acc=acc_lo)
            q = (tl.load(WQ + n_hi[:, None] * KW + widx) >> shift) & 0xF
            s = tl.load(SC + n_hi[:, None] * KG + gidx).to(tl.float32)
            b = tl.load(BI + n_hi[:, None] * KG + gidx).to(tl.float32)
            w = (q.to(tl.float32) * s + b).to(X.dtype.element_ty)
            acc_hi = tl.dot(a, tl.trans(w), acc=acc_hi)
        lo = acc_lo.to(OUT.dtype.element_ty).to(tl.float32)      # the projection's fp16 output
        hi = acc_hi.to(OUT.dtype.element_ty).to(tl.float32)
        _rope_pack_store(lo, hi, COS, SIN, OUT, offs_m, m_ok, offset, hid, s_blk, s_kv, s_head,
                         N_KV, HD, BT)

    _W4A16_CONFIGS = [
        triton.Config({"BM": 128, "BK": 64}, num_warps=8, num_stages=3),
        triton.Config({"BM": 128, "BK": 128}, num_warps=8, num_stages=3),
        triton.Config({"BM": 64, "BK": 64}, num_warps=4, num_stages=4),
        triton.Config({"BM": 256, "BK": 64}, num_warps=8, num_stages=3),
    ]
    _w4a16_autotuned = None
    if os.environ.get("TRITON_INTERPRET") != "1":
        _w4a16_autotuned = triton.autotune(configs=_W4A16_CONFIGS, key=["M", "K", "G"])(
            _w4a16_rope_pack_kernel)


def _out_strides(out):
    # out: [nb, 2, n_kv, block, head_dim]; the kernels compute token offsets within a block.
    assert out.stride(4) == 1 and out.stride(3) == out.shape[4]
    return out.stride(0), out.stride(1), out.stride(2)


def rmsnorm_triton(h, w, eps, out_dtype=CACHE_DTYPE):
    C, H = h.shape
    y = torch.empty((C, H), dtype=out_dtype, device=h.device)
    _rmsnorm_kernel[(C,)](h, w, y, h.stride(0), y.stride(0), eps, N=H,
                          num_warps=8 if H >= 2048 else 4)
    return y


def dequant_triton(lw):
    N, KW = lw["wq"].shape
    K = KW * 8
    W = torch.empty((N, K), dtype=lw["scales"].dtype, device=lw["wq"].device)
    BN, BK = 32, 256
    _dequant_kernel[(N // BN, K // BK)](lw["wq"], lw["scales"], lw["biases"], W, K=K,
                                         G=lw["group"], BN=BN, BK=BK, num_warps=4)
    return W


def recon_layer_cublas_fused(cfg, lw, h, start, out, cos_t, sin_t):
    C = h.shape[0]
    x = rmsnorm_triton(h, lw["norm"], cfg.eps)
    kv = x @ dequant_triton(lw).t()
    BM = 64
    sb, sk, sh = _out_strides(out)
    _rope_pack_kernel[(triton.cdiv(C, BM), 2 * cfg.n_kv)](
        kv, cos_t, sin_t, out, C, start, kv.stride(0), sb, sk, sh,
        N_KV=cfg.n_kv, HD=cfg.head_dim, BT=cfg.block, BM=BM, num_warps=4)


def recon_layer_triton_w4a16(cfg, lw, h, start, out, cos_t, sin_t):
    C = h.shape[0]
    x = rmsnorm_triton(h, lw["norm"], cfg.eps)
    sb, sk, sh = _out_strides(out)
    args = (x, lw["wq"], lw["scales"], lw["biases"], cos_t, sin_t, out, C, start, x.stride(0),
            sb, sk, sh)
    meta = dict(K=cfg.hidden, G=lw["group"], N_KV=cfg.n_kv, HD=cfg.head_dim, BT=cfg.block)
    if _w4a16_autotuned is not None:
        grid = lambda m: (triton.cdiv(C, m["BM"]), 2 * cfg.n_kv)  # noqa: E731
        _w4a16_autotuned[grid](*args, **meta)
    else:
        BM, BK = 32, 64
        _w4a16_rope_pack_kernel[(triton.cdiv(C, BM), 2 * cfg.n_kv)](*args, **meta, BM=BM, BK=BK)


VARIANTS = {
    "eager": recon_layer_eager,
    "cublas_fused": recon_layer_cublas_fused,
    "triton_w4a16": recon_layer_triton_w4a16,
}


def reconstruct(cfg, bundle, variant, cap, start, out, cos_t, sin_t, before=None, after=None):
    """All layers of one chunk. cap: [L, C, H] captured residuals; out: [L, nb, 2, n_kv, B, hd].
    `before(l)` / `after(l)` let a caller make a stream wait on, or record, an event per layer."""
    fn = VARIANTS[variant]
    for l in range(len(bundle)):
        if before is not None:
            before(l)
        fn(cfg, bundle[l], cap[l], start, out[l], cos_t, sin_t)
        if after is not None:
            after(l)


def reference_f64(cfg, lw, h, start):
    """float64 reference: K [C, n_kv, hd] (RoPE applied) and V, from the same 4-bit weights."""
    C = h.shape[0]
    hd = h.double()
    x = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + cfg.eps) * lw["norm"].double()
    N, KW = lw["wq"].shape
    shifts = torch.arange(0, 32, 4, device=h.device, dtype=torch.int32)
    q = ((lw["wq"].unsqueeze(-1) >> shifts) & 0xF).reshape(N, -1, lw["group"]).double()
    W = (q * lw["scales"].double().unsqueeze(-1) + lw["biases"].double().unsqueeze(-1)).reshape(N, -1)
    kv = x @ W.t()
    half = cfg.head_dim // 2
    inv = torch.exp(-torch.arange(half, dtype=torch.float64, device=h.device)
                    * (math.log(cfg.rope_theta) / half))
    th = torch.arange(start, start + C, dtype=torch.float64, device=h.device)[:, None] * inv
    cos, sin = th.cos()[:, None, :], th.sin()[:, None, :]
    k = kv[:, : cfg.kv_out].view(C, cfg.n_kv, cfg.head_dim)
    k = torch.cat([k[..., :half] * cos - k[..., half:] * sin,
                   k[..., half:] * cos + k[..., :half] * sin], -1)
    return k, kv[:, cfg.kv_out:].view(C, cfg.n_kv, cfg.head_dim)


def unpack(cfg, out_l):
    """[nb, 2, n_kv, B, hd] -> K, V as [C, n_kv, hd]."""
    nb = out_l.shape[0]
    k = out_l[:, 0].transpose(1, 2).reshape(nb * cfg.block, cfg.n_kv, cfg.head_dim)
    v = out_l[:, 1].transpose(1, 2).reshape(nb * cfg.block, cfg.n_kv, cfg.head_dim)
    return k, v


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# ----------------------------------------------------------------------------------------------
# The prefill baseline: Llama-3-8B-shaped layers, bf16, chunked, FlashAttention-2
# ----------------------------------------------------------------------------------------------

class Prefill:
    def __init__(self, cfg: Cfg, max_tokens: int, chunk: int, device, gen):
        self.cfg, self.chunk, self.device = cfg, chunk, device
        H, L = cfg.hidden, cfg.layers
        qkv = (cfg.n_q + 2 * cfg.n_kv) * cfg.head_dim

        def w(o, i):
            return (torch.randn(o, i, device=device, dtype=MODEL_DTYPE, generator=gen)
                    * (0.5 / math.sqrt(i)))

        self.ln1 = [torch.ones(H, device=device, dtype=MODEL_DTYPE) for _ in range(L)]
        self.ln2 = [torch.ones(H, device=device, dtype=MODEL_DTYPE) for _ in range(L)]
        self.wqkv = [w(qkv, H) for _ in range(L)]
        self.wo = [w(H, cfg.n_q * cfg.head_dim) for _ in range(L)]
        self.wgu = [w(2 * cfg.ffn, H) for _ in range(L)]
        self.wd = [w(H, cfg.ffn) for _ in range(L)]
        # contiguous KV cache [T, n_kv, hd] per layer (vLLM's is paged; same bytes)
        self.kc = [torch.empty(max_tokens, cfg.n_kv, cfg.head_dim, device=device, dtype=MODEL_DTYPE)
                   for _ in range(L)]
        self.vc = [torch.empty_like(self.kc[0]) for _ in range(L)]
        self.embed = torch.randn(chunk, H, device=device, dtype=MODEL_DTYPE, generator=gen)
        cos, sin = rope_tables(cfg, max(max_tokens, 16384), device)
        self.cos, self.sin = cos, sin
        self.attn_impl = "flash_gqa"

    def _rope(self, x, start):
        C, half = x.shape[0], self.cfg.head_dim // 2
        cos = self.cos[start:start + C, None, :]
        sin = self.sin[start:start + C, None, :]
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def attention(self, q, k, v):
        """q [1, n_q, C, hd]; k, v [1, n_kv, S, hd] with S >= C: causal, bottom-right aligned."""
        if self.attn_impl == "flash_gqa":
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
        rep = self.cfg.n_q // self.cfg.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.attn_impl == "flash_expand":
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
        if self.attn_impl == "efficient_lower_right":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            from torch.nn.attention.bias import causal_lower_right
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]))
        # math (CPU smoke): explicit bottom-right causal mask
        C, S = q.shape[2], k.shape[2]
        mask = torch.ones(C, S, dtype=torch.bool, device=q.device).tril(S - C)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward_chunk(self, start, C, capture=None, layer_events=None, attention=True):
        cfg = self.cfg
        hd, nq, nkv = cfg.head_dim, cfg.n_q, cfg.n_kv
        h = self.embed[:C]
        end = start + C
        for l in range(cfg.layers):
            if capture is not None:  # what extract_hidden_states keeps: the layer's input residual
                capture[l].copy_(h)
                if layer_events is not None:
                    layer_events[l].record()
            x = F.rms_norm(h, (cfg.hidden,), self.ln1[l], cfg.eps)
            qkv = x @ self.wqkv[l].t()
            q = self._rope(qkv[:, : nq * hd].view(C, nq, hd), start)
            k = self._rope(qkv[:, nq * hd:(nq + nkv) * hd].view(C, nkv, hd), start)
            self.kc[l][start:end].copy_(k)
            self.vc[l][start:end].copy_(qkv[:, (nq + nkv) * hd:].view(C, nkv, hd))
            if attention:
                o = self.attention(q.unsqueeze(0).transpose(1, 2),
                                   self.kc[l][:end].unsqueeze(0).transpose(1, 2),
                                   self.vc[l][:end].unsqueeze(0).transpose(1, 2))
                o = o.transpose(1, 2).reshape(C, nq * hd)
            else:
                o = q.reshape(C, nq * hd)
            h = h + o @ self.wo[l].t()
            x = F.rms_norm(h, (cfg.hidden,), self.ln2[l], cfg.eps)
            gu = x @ self.wgu[l].t()
            h = h + (F.silu(gu[:, : cfg.ffn]) * gu[:, cfg.ffn:]) @ self.wd[l].t()
        return h


def check_attention(model: Prefill, device):
    """Does the flash op do GQA and bottom-right causal for C < S? Compare with the math path."""
    cfg = model.cfg
    g = torch.Generator(device=device).manual_seed(1)
    C, S = 256, 768
    q = torch.randn(1, C, cfg.n_q, cfg.head_dim, device=device, dtype=MODEL_DTYPE, generator=g)
    k = torch.randn(1, S, cfg.n_kv, cfg.head_dim, device=device, dtype=MODEL_DTYPE, generator=g)
    v = torch.randn(1, S, cfg.n_kv, cfg.head_dim, device=device, dtype=MODEL_DTYPE, generator=g)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    rep = cfg.n_q // cfg.n_kv
    mask = torch.ones(C, S, dtype=torch.bool, device=device).tril(S - C)
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(rep, 1),
                                         v.float().repeat_interleave(rep, 1), attn_mask=mask)
    result = {}
    for impl in ("flash_gqa", "flash_expand", "efficient_lower_right"):
        model.attn_impl = impl
        try:
            err = rel_err(model.attention(q, k, v), ref)
            result[impl] = err
            if err < 2e-2:
                return impl, result
        except Exception as e:  # noqa: BLE001
            result[impl] = f"{type(e).__name__}: {e}"[:300]
    raise RuntimeError(f"no flash attention path matched the reference: {result}")


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def cuda_time(fn, reps, warmup, stream):
    times = []
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            fn()
            b.record(stream)
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    return times


def med(xs):
    return statistics.median(xs) if xs else None


class Bufs:
    """Double-buffered capture (device), packed output (device) and pinned host staging. The
    packed buffers are flat so that a chunk of nb blocks views them as one contiguous
    [L, nb, 2, n_kv, B, hd] tensor (a strided pinned destination would make torch copy through
    a temporary, synchronously)."""

    def __init__(self, cfg: Cfg, chunk: int, device):
        self.cfg = cfg
        nb = chunk // cfg.block
        L = cfg.layers
        self.cap = [torch.randn(L, chunk, cfg.hidden, device=device, dtype=MODEL_DTYPE)
                    for _ in range(2)]
        n = L * nb * 2 * cfg.kv_out * cfg.block
        self._out = [torch.empty(n, device=device, dtype=CACHE_DTYPE) for _ in range(2)]
        self._host = [torch.empty(n, dtype=CACHE_DTYPE, pin_memory=True) for _ in range(2)]

    def _view(self, flat, nb):
        c = self.cfg
        return flat[: c.layers * nb * 2 * c.kv_out * c.block].view(
            c.layers, nb, 2, c.n_kv, c.block, c.head_dim)

    def out(self, slot, nb):
        return self._view(self._out[slot], nb)

    def host(self, slot, nb):
        return self._view(self._host[slot], nb)


def chunks_of(T, C):
    return [(s, min(C, T - s)) for s in range(0, T, C)]


def run_prefill(model, T, C, attention=True):
    for s, c in chunks_of(T, C):
        model.forward_chunk(s, c, attention=attention)


def run_recon_serial(cfg, bundle, variant, bufs, T, C, cos, sin, d2h):
    """Reconstruct every chunk on the current stream; with d2h, copy each chunk to pinned memory
    on the same stream (serial: compute, then copy)."""
    for s, c in chunks_of(T, C):
        nb = c // cfg.block
        out = bufs.out(0, nb)
        reconstruct(cfg, bundle, variant, bufs.cap[0][:, :c], s, out, cos, sin)
        if d2h:
            bufs.host(0, nb).copy_(out, non_blocking=True)


def run_d2h_only(cfg, bufs, T, C):
    for i, (s, c) in enumerate(chunks_of(T, C)):
        nb = c // cfg.block
        bufs.host(i % 2, nb).copy_(bufs.out(i % 2, nb), non_blocking=True)


def run_capture_only(cfg, model, bufs, T, C):
    for s, c in chunks_of(T, C):
        for l in range(cfg.layers):
            bufs.cap[0][l, :c].copy_(model.embed[:c])


def run_overlapped(cfg, model, bundle, variant, bufs, T, C, streams, gran, d2h_log):
    """Prefill (main stream, with capture) + reconstruction (side stream) + D2H per layer (copy
    stream). gran='chunk': the side stream starts a chunk once the prefill step that computed it
    ends (what vLLM's extract_hidden_states route offers: states arrive per step).
    gran='layer': it starts layer l of a chunk as soon as the prefill captured layer l's input."""
    main, side, copy = streams
    ev_rec, ev_d2h = [], []
    for i, (s, c) in enumerate(chunks_of(T, C)):
        slot, nb = i % 2, c // cfg.block
        cap, out, host = bufs.cap[slot][:, :c], bufs.out(slot, nb), bufs.host(slot, nb)
        if i >= 2:
            main.wait_event(ev_rec[i - 2])          # capture slot free again
        lev = [torch.cuda.Event() for _ in range(cfg.layers)] if gran == "layer" else None
        model.forward_chunk(s, c, capture=cap, layer_events=lev)
        step_done = torch.cuda.Event()
        step_done.record(main)
        done = [torch.cuda.Event() for _ in range(cfg.layers)]
        with torch.cuda.stream(side):
            if i >= 2:
                side.wait_event(ev_d2h[i - 2])      # output slot copied out
            if gran == "layer":
                before = lambda l, lev=lev: side.wait_event(lev[l])  # noqa: E731
            else:
                side.wait_event(step_done)
                before = None
            reconstruct(cfg, bundle, variant, cap, s, out, model.cos, model.sin, before=before,
                        after=lambda l, done=done: done[l].record(side))
        layer_bytes = c * 2 * cfg.kv_out * CACHE_DTYPE.itemsize
        with torch.cuda.stream(copy):
            for l in range(cfg.layers):
                copy.wait_event(done[l])
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record(copy)
                host[l].copy_(out[l], non_blocking=True)
                b.record(copy)
                d2h_log.append((a, b, layer_bytes))
        ev_rec.append(done[-1])
        ev_d2h.append(b)
    main.wait_event(ev_d2h[-1])


# ----------------------------------------------------------------------------------------------
# Correctness (on device, small shapes)
# ----------------------------------------------------------------------------------------------

def check_recon(cfg, bundle, variants, device, cos, sin, C=512, start=8192):
    g = torch.Generator(device=device).manual_seed(2)
    h = torch.randn(C, cfg.hidden, device=device, dtype=MODEL_DTYPE, generator=g) * 3.0
    nb = C // cfg.block
    res = {}
    outs = {}
    for layer in (0, len(bundle) - 1):
        lw = bundle[layer]
        kref, vref = reference_f64(cfg, lw, h, start)
        for var in variants:
            out = torch.full((nb, 2, cfg.n_kv, cfg.block, cfg.head_dim), float("nan"),
                             device=device, dtype=CACHE_DTYPE)
            try:
                VARIANTS[var](cfg, lw, h, start, out, cos, sin)
                k, v = unpack(cfg, out)
                r = dict(nan=int(torch.isnan(out).sum()), k_rel=rel_err(k, kref),
                         v_rel=rel_err(v, vref))
                outs[(layer, var)] = out
                if var != "eager" and ("eager" in variants):
                    e = outs[(layer, "eager")]
                    r["equal_to_eager_frac"] = float((out == e).float().mean())
                    r["rel_vs_eager"] = rel_err(out, e)
            except Exception as ex:  # noqa: BLE001
                r = dict(error=f"{type(ex).__name__}: {ex}"[:500])
            r["ok"] = ("error" not in r and r["nan"] == 0 and r["k_rel"] < 5e-3
                       and r["v_rel"] < 5e-3)
            res[f"layer{layer}_{var}"] = r
    return res


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
        triton_version=getattr(triton, "__version__", None) if HAVE_TRITON else None,
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
