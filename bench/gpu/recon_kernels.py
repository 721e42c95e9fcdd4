#!/usr/bin/env python3
"""pd-bridge's reconstruction math on a CUDA GPU, three ways, and its correctness check.

For one layer of one chunk, from the captured residual h entering the layer (bf16):

    x = rms_norm(h, w_norm, eps)            fp32 accumulation
    k = x @ dequant(Wk).T ; v = x @ dequant(Wv).T      MLX affine 4-bit (uint32-packed, LSB first,
                                                     per-group scale and bias), fp16 = decoder dtype
    k = rope(k, positions offset..offset+T)  rotate-half ("traditional": false)
    pack K and V per block into contiguous [1, n_kv, block, head_dim] fp16 tensors.

  eager        dequantize in torch -> cuBLAS fp16 GEMM (k and v in one GEMM) -> RoPE, cast, pack
  cublas_fused Triton RMSNorm, Triton dequant, cuBLAS GEMM, one Triton RoPE+cast+pack kernel
  triton_w4a16 Triton RMSNorm, then one Triton kernel: 4-bit GEMM dequantizing in the K loop, with
               RoPE+cast+pack in the epilogue

`make_bundle` builds the decoder's bundle (random weights in MLX's 4-bit layout); `check_recon`
compares each variant with a float64 reference. Set TRITON_INTERPRET=1 before importing this to
run the Triton kernels on a CPU.
"""

from __future__ import annotations

import math
import os

import torch

from llama_prefill import CACHE_DTYPE, MODEL_DTYPE, Cfg, rel_err

try:
    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402
    HAVE_TRITON = True
    TRITON_VERSION = getattr(triton, "__version__", None)
except Exception:  # pragma: no cover - triton missing
    HAVE_TRITON = False
    TRITON_VERSION = None


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
