#!/usr/bin/env python3
"""A Llama-3.1-8B-shaped checkpoint from one seed, both engines' folders, drawn on the GPU by MLX
layer by layer (seconds; numpy on the host would take minutes of device time):

    OUT/llama8b-mlx/  the decoder: projections and the output head MLX affine 4-bit, group 64 (as
                      mlx-lm's 4-bit conversions), the embedding and norms bf16.
    OUT/llama8b-hf/   the prefill weights: the same tensors through mx.dequantize, bf16, in the HF
                      layout; mlx-lm loads it too, so it is also the dense (unquantized) decoder.

Dummy weights cannot stand in: the plugin computes the decoder's cache from the decoder's own k/v
projections and norms, and the captured states must come from the same model. Shape: 32 layers,
hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocab 128,256, rope_theta 5e5 with Llama 3.1's
scaling, 135,168 positions (128K prompts and room to answer). The tokenizer is the test model's
(SmolLM2: its 49,152 ids are a subset of the vocab). Projections N(0, 1/fan_in), norms 1 + 0.1 N(0, 1),
the embedding N(0, 1), the head 4x a projection's scale (greedy answers then depend on the context).

Usage: .venv/bin/python bench/gpu/llama8b.py [--out models] [--tokenizer models/smollm2-mlx] [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import mlx.core as mx

SEED = 20261203
LAYERS_PER_SHARD = 4
BITS, GROUP = 4, 64
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "max_position_embeddings": 135168,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def layer_specs(c: dict) -> dict[str, tuple[str, tuple[int, int]]]:
    """One decoder layer's tensors: name -> (kind, shape)."""
    h, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {
        "input_layernorm.weight": ("norm", (h,)),
        "self_attn.q_proj.weight": ("linear", (q, h)),
        "self_attn.k_proj.weight": ("linear", (kv, h)),
        "self_attn.v_proj.weight": ("linear", (kv, h)),
        "self_attn.o_proj.weight": ("linear", (h, q)),
        "post_attention_layernorm.weight": ("norm", (h,)),
        "mlp.gate_proj.weight": ("linear", (f, h)),
        "mlp.up_proj.weight": ("linear", (f, h)),
        "mlp.down_proj.weight": ("linear", (h, f)),
    }


def draw(kind: str, shape: tuple[int, ...], key: mx.array) -> mx.array:
    z = mx.random.normal(shape, dtype=mx.float32, key=key)
    scale = {"linear": shape[-1] ** -0.5, "lm_head": 4 * shape[-1] ** -0.5, "norm": 0.1, "embed": 1.0}[kind]
    return ((1.0 if kind == "norm" else 0.0) + scale * z).astype(mx.bfloat16)


def both(name: str, kind: str, w: mx.array) -> tuple[dict, dict]:
    """(decoder tensors, prefill tensors) for one weight."""
    if kind not in ("linear", "lm_head"):
        return {name: w}, {name: w}
    wq, scales, biases = mx.quantize(w, group_size=GROUP, bits=BITS)
    base = name.removesuffix(".weight")
    dense = mx.dequantize(wq, scales, biases, group_size=GROUP, bits=BITS).astype(mx.bfloat16)
    return {name: wq, f"{base}.scales": scales, f"{base}.biases": biases}, {name: dense}


def shards(c: dict):
    """(shard name, [(name, kind, shape)]): the embedding with the first layers, the head with the last."""
    layers = c["num_hidden_layers"]
    count = -(-layers // LAYERS_PER_SHARD)
    for s in range(count):
        names = [("model.embed_tokens.weight", "embed", (c["vocab_size"], c["hidden_size"]))] if s == 0 else []
        for i in range(s * LAYERS_PER_SHARD, min(layers, (s + 1) * LAYERS_PER_SHARD)):
            names += [(f"model.layers.{i}.{n}", kind, shape) for n, (kind, shape) in layer_specs(c).items()]
        if s == count - 1:
            names += [("model.norm.weight", "norm", (c["hidden_size"],)),
                      ("lm_head.weight", "lm_head", (c["vocab_size"], c["hidden_size"]))]
        yield f"model-{s + 1:05d}-of-{count:05d}.safetensors", names


def build(out: Path, tokenizer: Path, config: dict) -> None:
    mlx_dir, hf_dir = out / "llama8b-mlx", out / "llama8b-hf"
    stamp = json.dumps({"seed": SEED, "config": config, "bits": BITS, "group": GROUP}, sort_keys=True)
    if all((d / ".stamp").is_file() and (d / ".stamp").read_text() == stamp for d in (mlx_dir, hf_dir)):
        print(f"llama8b: up to date in {out}")
        return
    start = time.monotonic()
    for d in (mlx_dir, hf_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for name in TOKENIZER_FILES:
            shutil.copy2(tokenizer / name, d / name)
    keys = iter(mx.random.split(mx.random.key(SEED), 1000))
    for shard, names in shards(config):
        decoder, prefill = {}, {}
        for name, kind, shape in names:
            d, p = both(name, kind, draw(kind, shape, next(keys)))
            decoder |= d
            prefill |= p
        mx.eval(decoder, prefill)
        mx.save_safetensors(str(mlx_dir / shard), decoder, metadata={"format": "mlx"})
        mx.save_safetensors(str(hf_dir / shard), prefill, metadata={"format": "pt"})
    quantization = {"group_size": GROUP, "bits": BITS, "mode": "affine"}
    (mlx_dir / "config.json").write_text(json.dumps(config | {"quantization": quantization,
                                                             "quantization_config": quantization}, indent=2))
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
    template = json.loads((tokenizer / "tokenizer_config.json").read_text())["chat_template"]
    (hf_dir / "chat_template.jinja").write_text(template)
    for d in (mlx_dir, hf_dir):
        (d / ".stamp").write_text(stamp)
    sizes = {d.name: sum(f.stat().st_size for f in d.iterdir()) / 1e9 for d in (mlx_dir, hf_dir)}
    print(f"llama8b: built in {time.monotonic() - start:.1f} s: " + ", ".join(f"{k} {v:.1f} GB" for k, v in sizes.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("models"))
    p.add_argument("--tokenizer", type=Path, default=Path("models/smollm2-mlx"))
    p.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"], help="fewer: a quick try of the script")
    args = p.parse_args()
    build(args.out, args.tokenizer, CONFIG | {"num_hidden_layers": args.layers})


if __name__ == "__main__":
    main()
