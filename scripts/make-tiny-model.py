#!/usr/bin/env python3
"""Generates small checkpoints of other shapes than the test model, deterministically (fixed seed),
as the same two folders `prepare-model.py` builds for it:

    models/tiny-<family>-mlx/   decoder (mlx-lm): linears MLX affine 4-bit (group 32), the rest fp32.
    models/tiny-<family>-hf/    prefill (vLLM): the same weights dequantized with MLX's formula, fp32.

Random weights, scaled so activations stay O(1) through the layers; norm weights are perturbed
around 1 so that they matter. The tokenizer is the test model's (SmolLM2), so real text tokenizes as
it does there. Families:

    llama-long   Llama-shaped, 2 layers, hidden 256, 4 heads / 2 KV heads of 64, 135,168 positions
                 (128K + 4K, rope_theta 5e5): for bridging prompts of 16K-128K tokens.

Idempotent like prepare-model.py: a folder whose stamp matches is left alone.

Usage: .venv/bin/python scripts/make-tiny-model.py --family llama-long [--out models]
"""

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from modelkit import build_hf, ensure, write_json

SCRIPT_VERSION = 1
SEED = 20261201
GROUP_SIZE = 32
BITS = 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

FAMILIES = {
    "llama-long": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_traditional": False,
        "max_position_embeddings": 135168,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
    },
}


def llama_weights(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Float32 weights in HF/mlx-lm llama names."""
    h, f, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((config["vocab_size"], h)).astype(np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        weights |= {
            f"{p}.input_layernorm.weight": norm(),
            f"{p}.self_attn.q_proj.weight": linear(q, h),
            f"{p}.self_attn.k_proj.weight": linear(kv, h),
            f"{p}.self_attn.v_proj.weight": linear(kv, h),
            f"{p}.self_attn.o_proj.weight": linear(h, q),
            f"{p}.post_attention_layernorm.weight": norm(),
            f"{p}.mlp.gate_proj.weight": linear(f, h),
            f"{p}.mlp.up_proj.weight": linear(f, h),
            f"{p}.mlp.down_proj.weight": linear(h, f),
        }
    weights["model.norm.weight"] = norm()
    return weights


def quantized(weights: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """The decoder's tensors: every 2-D projection 4-bit affine, the embedding and norms fp32."""
    out = {}
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            wq, scales, biases = mx.quantize(mx.array(w), group_size=GROUP_SIZE, bits=BITS)
            base = name.removesuffix(".weight")
            out |= {name: wq, f"{base}.scales": scales, f"{base}.biases": biases}
        else:
            out[name] = mx.array(w)
    return out


def build_mlx(folder: Path, family: str, tokenizer_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / name, folder / name)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    config = {
        **FAMILIES[family],
        "vocab_size": len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]),
        **generation,
        "torch_dtype": "float32",
        "quantization": {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"},
    }
    config["quantization_config"] = config["quantization"]
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    write_json(folder / "tokenizer_config.json", tokenizer_config)
    rng = np.random.default_rng(SEED)
    mx.save_safetensors(str(folder / "model.safetensors"), quantized(llama_weights(config, rng)), {"format": "mlx"})
    write_json(folder / "config.json", config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = Path(__file__).resolve().parent.parent
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--out", type=Path, default=root / "models", help="parent folder (default: %(default)s)")
    parser.add_argument(
        "--tokenizer", type=Path, default=root / "models" / "smollm2-mlx", help="folder with the tokenizer files"
    )
    args = parser.parse_args()
    missing = [n for n in TOKENIZER_FILES if not (args.tokenizer / n).is_file()]
    if missing:
        raise SystemExit(f"make-tiny-model: {args.tokenizer} lacks {missing} (run scripts/prepare-model.py first)")
    # The family's whole config is in the stamp: editing it rebuilds the folders.
    family = json.dumps(FAMILIES[args.family], sort_keys=True)
    stamp = f"make-tiny-model v{SCRIPT_VERSION}\nfamily {args.family} seed {SEED} {family}\n"
    mlx_folder = args.out / f"tiny-{args.family}-mlx"
    hf_folder = args.out / f"tiny-{args.family}-hf"
    ensure(mlx_folder, stamp, lambda tmp: build_mlx(tmp, args.family, args.tokenizer))
    ensure(hf_folder, stamp, lambda tmp: build_hf(tmp, mlx_folder))


if __name__ == "__main__":
    main()
