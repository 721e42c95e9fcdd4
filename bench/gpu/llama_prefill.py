#!/usr/bin/env python3
"""A Llama-3-8B-shaped prefill in torch: the baseline pd-bridge's reconstruction rides on.

`Cfg` is the shape (hidden 4096, 32 q / 8 kv heads of 128, ffn 14336, rotate-half RoPE base 500000;
the reconstruction's 4-bit group and block size too). `Prefill` is 32 such layers in bf16 with
random weights, run in chunks that each attend to a contiguous KV prefix (vLLM's is paged; same
bytes) with FlashAttention-2 through torch's SDPA flash kernel (causal aligned bottom-right, GQA
native), or the math path on a CPU; `check_attention` picks the flash path that matches the math.
`reconstruct_overhead.py` and `mlx_cuda.py` measure reconstruction next to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def rope_tables(cfg: Cfg, max_pos: int, device):
    """cos/sin [max_pos, head_dim/2] fp32; theta = pos * base^(-i/half) in fp32, as MLX's rope."""
    half = cfg.head_dim // 2
    inv = torch.exp(-torch.arange(half, dtype=torch.float32) * (math.log(cfg.rope_theta) / half))
    pos = torch.arange(max_pos, dtype=torch.float32)
    theta = pos[:, None] * inv[None, :]
    return theta.cos().contiguous().to(device), theta.sin().contiguous().to(device)


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


def chunks_of(T, C):
    return [(s, min(C, T - s)) for s in range(0, T, C)]


def run_prefill(model, T, C, attention=True):
    for s, c in chunks_of(T, C):
        model.forward_chunk(s, c, attention=attention)
