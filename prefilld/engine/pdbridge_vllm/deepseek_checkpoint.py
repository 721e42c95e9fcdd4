"""DeepSeek-V4.1's checkpoint as DeepSeek publishes it, read into the plugin's own class.

The format: DeepSeek's tensor names (``layers.3.attn.wq_a.weight``, ``layers.3.ffn.experts.17.w1``, ``embed``,
``head``); the attention's and the shared expert's projections fp8 e4m3 with a ue8m0 (power-of-two) scale per
32x32 block (``quantization_config``: ``quant_method`` fp8, ``scale_fmt`` ue8m0, ``weight_block_size``
[32, 32]); the routed experts fp4 e2m1, two to a byte (the even element in the low nibble), with a ue8m0
scale per 32 inputs (``expert_dtype`` fp4); the rest bf16, but the hyper-connection mixers, the sinks, the
router's bias and the compressors fp32.

mlx-lm's ``deepseek_v41`` reads it into the decoder with its own ``Model.sanitize``, keeping the fp8 and fp4
weights packed (MLX's mxfp8 and mxfp4 are the same codes and scales); vLLM's CUDA class reads it natively.
The plugin's own CPU class reads it here, dequantized: a code times a power of two is exact in fp32, so it
computes with the very weights the decoder's packed matmuls use. No vLLM or MLX import: the tiny-checkpoint
generator writes its published-format checkpoint with `encode_fp8` and `encode_fp4`.
"""

from __future__ import annotations

import re

import torch

# (DeepSeek's, mlx-lm's), applied in this order to a name after "model." is prepended: the same
# renames as mlx-lm's sanitize, so the plugin's parameters keep the decoder's names.
RENAMES = (
    (".attn.", ".self_attn."),
    (".ffn.", ".mlp."),
    (".attn_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".hc_attn_", ".attn_hc."),
    (".hc_ffn_", ".ffn_hc."),
    (".attn_sink", ".sinks"),
    (".wq_a.", ".q_a_proj."),
    (".wq_b.", ".q_b_proj."),
    (".wkv.", ".kv_proj."),
    (".wgate.", ".gate_proj."),
    (".wo_a.", ".o_a_proj."),
    (".wo_b.", ".o_b_proj."),
    (".q_norm.", ".q_a_norm."),
    (".compressor.norm.", ".compressor.kv_norm."),
    (".indexer.wk.", ".indexer.k_proj."),
    (".gate.bias", ".gate.e_score_correction_bias"),
    (".shared_experts.w1.", ".shared_experts.gate_proj."),
    (".shared_experts.w2.", ".shared_experts.down_proj."),
    (".shared_experts.w3.", ".shared_experts.up_proj."),
)
TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight"}
EXPERT = re.compile(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight")
EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# Multimodal towers and the multi-token-prediction layers: not the text model's.
SKIPPED = ("vision.", "aligner.", "image_", "mtp.")

# fp8 projections (by DeepSeek's name) and what stays fp32 among the unquantized tensors.
FP8 = (".attn.wq_a.", ".attn.wkv.", ".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b.", ".indexer.wq_b.",
       ".shared_experts.w1.", ".shared_experts.w2.", ".shared_experts.w3.")
FP32 = (".hc_attn_", ".hc_ffn_", ".attn_sink", ".gate.bias", ".compressor.")
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
                       "activation_scheme": "dynamic", "expert_dtype": "fp4"}

BLOCK = 32
_FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


class CheckpointError(ValueError):
    """A tensor the published format does not have, or one it lacks."""


def mlx_name(name: str) -> str:
    """A DeepSeek tensor name as mlx-lm's sanitize names it (not for routed experts)."""
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    name = f"model.{name}"
    for theirs, ours in RENAMES:
        name = name.replace(theirs, ours)
    return name


def deepseek_name(name: str) -> str:
    """The inverse of `mlx_name`."""
    top = {ours: theirs for theirs, ours in TOP_LEVEL.items()}
    if name in top:
        return top[name]
    for theirs, ours in reversed(RENAMES):
        name = name.replace(ours, theirs)
    return name.removeprefix("model.")


def _scales(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 exponents (float8_e8m0fnu or their uint8 bytes) or float scales, as fp32."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        return torch.exp2(scale.view(torch.uint8).float() - 127.0)
    return scale.float()


def decode_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[out, in] e4m3 codes with a scale per 32x32 block ([ceil(out/32), in/32]) → fp32."""
    rows, cols = weight.shape
    per_block = _scales(scale).repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return weight.view(torch.float8_e4m3fn).float() * per_block


def decode_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[out, in/2] bytes of two e2m1 codes (even element low) with a scale per 32 inputs → [out, in] fp32."""
    codes = packed.view(torch.uint8).long()
    codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
    values = _FP4_VALUES.to(codes.device)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return values * _scales(scale).repeat_interleave(BLOCK, -1)


def encode_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 codes and ue8m0 scales per 32x32 block, the block's largest value within ±448."""
    rows, cols = weight.shape
    if cols % BLOCK:
        raise CheckpointError(f"an fp8 projection needs inputs in blocks of {BLOCK}, not {cols}")
    padded = torch.zeros(-(-rows // BLOCK) * BLOCK, cols, device=weight.device)
    padded[:rows] = weight.float()
    blocks = padded.reshape(-1, BLOCK, cols // BLOCK, BLOCK)
    exponent = torch.ceil(torch.log2(blocks.abs().amax((1, 3)).clamp_min(2.0**-100) / 448.0))
    scale = torch.exp2(exponent)
    codes = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows].to(torch.float8_e4m3fn)
    return codes, (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def encode_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 codes (int8, two per byte) and ue8m0 scales per 32 inputs, the group's largest within ±6."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, BLOCK)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(2.0**-100) / 6.0))
    scaled = (groups / torch.exp2(exponent)[..., None]).flatten(-2)
    magnitude = (scaled.abs()[..., None] - _FP4_VALUES.to(scaled.device)).abs().argmin(-1)
    codes = (magnitude + torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8), (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def read(weights: dict[str, torch.Tensor], n_experts: int, o_groups: int) -> dict[str, torch.Tensor]:
    """The checkpoint's text-model tensors under mlx-lm's names and in its layout (experts stacked, the
    grouped output projection [groups, rank, in]), dequantized to fp32 where they are fp8 or fp4."""
    scales = {n.removesuffix(".scale"): t for n, t in weights.items() if n.endswith(".scale")}
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in weights.items():
        if name.startswith(SKIPPED) or name.endswith(".scale") or ".engram." in name or name.endswith(".bias_vl"):
            continue
        scale = scales.pop(name.removesuffix(".weight"), None)
        if match := EXPERT.fullmatch(name):
            if scale is None:
                raise CheckpointError(f"{name}: a routed expert without its fp4 scale")
            layer, index, proj = match.groups()
            experts.setdefault((layer, proj), {})[int(index)] = decode_fp4(tensor, scale)
            continue
        value = tensor.float() if scale is None else decode_fp8(tensor, scale)
        renamed = mlx_name(name)
        if renamed.endswith(".o_a_proj.weight"):
            value = value.reshape(o_groups, -1, value.shape[-1])
        out[renamed] = value
    if scales:
        raise CheckpointError(f"scales without a weight: {sorted(scales)[:4]}")
    for (layer, proj), rows in experts.items():
        if sorted(rows) != list(range(n_experts)):
            raise CheckpointError(f"layer {layer} has {len(rows)} {proj} experts, the config {n_experts}")
        name = f"model.layers.{layer}.mlp.experts.switch_mlp.{EXPERT_PROJ[proj]}.weight"
        out[name] = torch.stack([rows[i] for i in range(n_experts)])
    return out
