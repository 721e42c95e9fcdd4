#!/usr/bin/env python3
"""DeepSeek-V4.1 at full width and reduced depth, in the published checkpoint format, drawn on the GPU
by torch layer by layer: one folder that vLLM's own CUDA class and the decoder's mlx-lm both load.

Width: mlx-lm's ``deepseek_v41`` defaults (hidden 5120; 64 query heads of 512, the last 64 dims rotary; q rank
1280; 8 output groups of rank 1024; 384 routed experts of 2304 with 6 per token and one shared; an
indexer of 32 heads of 128 keeping 512; a window of 128; 4 hyper-connection streams). Depth: 4 layers,
one of each kind vLLM's class has: a window-only layer (ratio 0), a ratio-2 layer that
makes the pooled KV and index keys (a source), a ratio-2 layer that reads them, and a full-length
(ratio 1) source. Format (`pdbridge_vllm.deepseek_checkpoint`): DeepSeek's names, fp8 e4m3
projections and fp4 experts with ue8m0 scales, the rest bf16 (mixers, sinks, router bias and
compressors fp32). The values follow scripts/make-tiny-model.py's distributions (projections
N(0, 1/fan_in), the head 4x that), from one seed; the tokenizer is the test model's (SmolLM2's
49,152 ids). 30.6 GB, nearly all of it the fp4 experts.

`specs()` runs the same code on torch's meta device: config.json and every tensor's name, shape and
dtype without the bytes (bench/gpu/v41_dry_run.py, on a machine without a GPU).

Usage: .venv/bin/python bench/gpu/deepseek_v41_wide.py [--out models] [--tokenizer models/smollm2-mlx]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from mlx_lm.models.deepseek_v41 import ModelArgs
from safetensors.torch import save_file

from pdbridge_vllm import deepseek_checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
SEED = 20261205
DEVICE = "cuda"
NAME = "deepseek-v41-wide"
# mlx-lm's class defaults where they differ from the tiny family's; the rest as mlx-lm defaults them.
WIDTH = {
    "hidden_size": 5120, "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1280, "qk_rope_head_dim": 64,
    "o_groups": 8, "o_lora_rank": 1024, "moe_intermediate_size": 2304, "n_routed_experts": 384,
    "num_experts_per_tok": 6, "n_shared_experts": 1, "sliding_window": 128, "index_n_heads": 32,
    "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 135168,
}
# RoPE without YaRN scaling: both engines then rotate every layer plainly (vLLM's window layers
# always do; with a default rope_type its pooled layers do too, at compress_rope_theta, as mlx-lm's
# YaRN at factor 1 does).
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
KINDS = ([0, 2, 2, 1], [1, 3], [1, 3])  # compress ratios, KV sources, index sources: one layer each


def tiny_generator():
    """scripts/make-tiny-model.py as a module: its tensor list and distributions are this model's too."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "scripts/make-tiny-model.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "scripts"))
    spec.loader.exec_module(module)
    return module


def config_for(tiny, tokenizer: Path) -> dict:
    ratios, kv, index = KINDS
    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    generation = json.loads((tokenizer / "generation_config.json").read_text())
    # Every key mlx-lm's class has, written out: vLLM's config class has no defaults of its own.
    defaults = {f.name: list(f.default) if isinstance(f.default, tuple) else f.default
                for f in dataclasses.fields(ModelArgs) if f.default is not dataclasses.MISSING}
    config = defaults | {k: v for k, v in tiny.DEEPSEEK_V41.items() if k != "weights"} | WIDTH
    return config | {"num_hidden_layers": len(ratios), "compress_ratios": ratios, "kv_source_layer_ids": kv,
                     "index_source_layer_ids": index, "vocab_size": vocab, "rope_scaling": ROPE,
                     # Read by vLLM's V4 base classes, fixed in mlx-lm's; without noaux_tc vLLM's
                     # router has no e_score_correction_bias (mlx-lm's always adds it).
                     "hidden_act": "silu", "num_nextn_predict_layers": 0, "topk_method": "noaux_tc",
                     **generation}


def draw(kind: str, shape: tuple[int, ...], gen: torch.Generator | None, lm_head_scale: float) -> torch.Tensor:
    """make-tiny-model's `random_weights` distributions, on the GPU (on the meta device without `gen`)."""
    z = torch.randn(shape, generator=gen, device=gen.device if gen is not None else "meta")
    if kind in ("linear", "router", "lm_head"):
        return z / shape[-1] ** 0.5 * (lm_head_scale if kind == "lm_head" else 1.0)
    offset, scale = {"embed": (0.0, 1.0), "norm": (1.0, 0.1), "bias": (0.0, 0.1), "sink": (0.0, 1.0)}[kind]
    return offset + scale * z


def host(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else t.cpu()


def published(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One tensor as the published checkpoint stores it (DeepSeek's name; fp8, fp32 or bf16)."""
    if any(p in name for p in ckpt.FP8):
        codes, scale = ckpt.encode_fp8(w)
        return {name: codes, f"{name.removesuffix('.weight')}.scale": scale}
    return {name: w if any(p in name for p in ckpt.FP32) else w.to(torch.bfloat16)}


def layer_tensors(tiny, config: dict, spec: dict, i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, (kind, shape) in tiny.LAYERS["deepseek_v41"](config, spec, i).items():
        if ".switch_mlp." in name:  # experts one by one: never the whole stack in fp32
            proj = {v: k for k, v in ckpt.EXPERT_PROJ.items()}[name.split(".")[-2]]
            for e in range(shape[0]):
                codes, scale = ckpt.encode_fp4(draw(kind, shape[1:], gen, 0))
                base = f"layers.{i}.ffn.experts.{e}.{proj}"
                out |= {f"{base}.weight": host(codes), f"{base}.scale": host(scale)}
            continue
        w = draw(kind, shape, gen, 0)
        if name.endswith(".o_a_proj.weight"):
            w = w.reshape(-1, shape[-1])
        out |= {k: host(v) for k, v in published(ckpt.deepseek_name(f"model.layers.{i}.{name}"), w).items()}
    return out


def shards(tiny, config: dict, gen: torch.Generator | None) -> list:
    """The checkpoint's shards, each a function that draws its tensors (on the host, or meta ones)."""
    spec = tiny.DEFAULT_WEIGHTS | {"bits": 0, "lm_head_scale": 4.0}
    h, vocab = config["hidden_size"], config["vocab_size"]
    out = [lambda: {"embed.weight": host(draw("embed", (vocab, h), gen, 0).to(torch.bfloat16))}]
    out += [lambda i=i: layer_tensors(tiny, config, spec, i, gen) for i in range(config["num_hidden_layers"])]
    out.append(lambda: {"norm.weight": host(draw("norm", (h,), gen, 0).to(torch.bfloat16)),
                        "head.weight": host(draw("lm_head", (vocab, h), gen, 4.0).to(torch.bfloat16))})
    return out


def config_json(config: dict) -> dict:
    keep = ("architectures", "model_type", "tie_word_embeddings", "bos_token_id", "eos_token_id")
    text = {k: v for k, v in config.items() if k not in keep} | {"model_type": "deepseek_v41_text"}
    top = {k: config[k] for k in keep if k in config} | {"torch_dtype": "bfloat16"}
    return top | {"text_config": text, "quantization_config": ckpt.QUANTIZATION_CONFIG}


def specs(tokenizer: Path) -> tuple[dict, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """config.json and each tensor's (shape, dtype), drawn as `write` draws them, on the meta device."""
    tiny = tiny_generator()
    config = config_for(tiny, tokenizer)
    tensors = {}
    for shard in shards(tiny, config, None):
        tensors |= {name: (tuple(t.shape), t.dtype) for name, t in shard().items()}
    return config_json(config), tensors


def write(folder: Path, tokenizer: Path) -> None:
    tiny = tiny_generator()
    config = config_for(tiny, tokenizer)
    for name in tiny.TOKENIZER_FILES:
        shutil.copy2(tokenizer / name, folder / name)
    todo = shards(tiny, config, torch.Generator(device=DEVICE).manual_seed(SEED))
    index = {}
    for k, shard in enumerate(todo):  # one shard in host memory at a time
        tensors = shard()
        file = f"model-{k + 1:05d}-of-{len(todo):05d}.safetensors"
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        index |= {name: file for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (folder / "config.json").write_text(json.dumps(config_json(config), indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "models")
    p.add_argument("--tokenizer", type=Path, default=ROOT / "models/smollm2-mlx")
    args = p.parse_args()
    folder = args.out / NAME
    if (folder / "config.json").exists():
        print(f"{folder}: present")
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    started = time.monotonic()
    write(folder, args.tokenizer)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"{folder}: {size / 1e9:.1f} GB in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
