#!/usr/bin/env python3
"""Generates small checkpoints of other shapes than the test model, deterministically (fixed seed),
as the same two folders `prepare-model.py` builds for it:

    models/tiny-<family>-mlx/   decoder (mlx-lm): linears MLX affine (4-bit group 32 unless the family
                                says otherwise), the rest fp32.
    models/tiny-<family>-hf/    prefill (vLLM): the same weights dequantized with MLX's formula, fp32.

Random weights, scaled so activations stay O(1) through the layers; norm weights are perturbed
around 1 so that they matter. The tokenizer is the test model's (SmolLM2), so real text tokenizes as
it does there. Families:

    llama-long   Llama-shaped, 2 layers, hidden 256, 4 heads / 2 KV heads of 64, 135,168 positions
                 (128K + 4K, rope_theta 5e5): for bridging prompts of 16K-128K tokens.
    llama3       the same shape, 8,192 positions, with Llama 3.1 rope scaling (factor 8 over an original
                 1,024 positions, so 22 of the 32 rotary frequencies are scaled, not just the slowest).
    qwen3        Qwen3-shaped (same sizes, per-head q/k RMSNorms, rope_theta 1e6), linears 8-bit group 64.

Idempotent like prepare-model.py: a folder whose stamp matches is left alone.

Usage: .venv/bin/python scripts/make-tiny-model.py --family llama-long|llama3|qwen3 [--out models]
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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# Per family, the config.json keys plus "weights": how the tensors are made, popped before writing.
# The stamp is the whole entry; llama-long predates "weights" and gets V1_WEIGHTS, so its stamp stays.
V1_WEIGHTS = {"bits": 4, "group_size": 32, "head_norms": [], "lm_head_scale": 0}
LLAMA_LONG = {
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
}
FAMILIES = {
    "llama-long": LLAMA_LONG,
    "llama3": LLAMA_LONG
    | {
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
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "attention_bias": False,
        # 8-bit so the project covers both of MLX's usual widths; q_norm/k_norm are RMSNorms over head_dim.
        "weights": {"bits": 8, "group_size": 64, "head_norms": ["q_norm", "k_norm"], "lm_head_scale": 4.0},
    },
}


def random_weights(config: dict, spec: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Float32 weights in HF names, which mlx-lm's llama and qwen3 share. `spec["head_norms"]` are
    extra per-layer attention norms over head_dim; a nonzero `spec["lm_head_scale"]` adds an untied
    output projection that large: with the embedding tied, a random model's logits are dominated by
    the current token's own embedding and greedy decoding just repeats it, which would make token
    agreement between the engines a test of nothing. Extra tensors are drawn after the others, so
    families without them keep their draws."""
    h, f, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(size: int = h) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

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
        weights |= {f"{p}.self_attn.{n}.weight": norm(d) for n in spec["head_norms"]}
    weights["model.norm.weight"] = norm()
    if spec["lm_head_scale"]:
        weights["lm_head.weight"] = spec["lm_head_scale"] * linear(config["vocab_size"], h)
    return weights


def quantized(weights: dict[str, np.ndarray], bits: int, group_size: int) -> dict[str, mx.array]:
    """The decoder's tensors: every 2-D projection affine-quantized, the embedding and norms fp32."""
    out = {}
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            wq, scales, biases = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
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
    config = dict(FAMILIES[family])
    spec = V1_WEIGHTS | config.pop("weights", {})
    config = {
        **config,
        "vocab_size": len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]),
        **generation,
        "torch_dtype": "float32",
        "quantization": {"group_size": spec["group_size"], "bits": spec["bits"], "mode": "affine"},
    }
    config["quantization_config"] = config["quantization"]
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    write_json(folder / "tokenizer_config.json", tokenizer_config)
    rng = np.random.default_rng(SEED)
    weights = quantized(random_weights(config, spec, rng), spec["bits"], spec["group_size"])
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
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
    # The family's whole entry (config and weights spec) is in the stamp: editing it rebuilds the folders.
    family = json.dumps(FAMILIES[args.family], sort_keys=True)
    stamp = f"make-tiny-model v{SCRIPT_VERSION}\nfamily {args.family} seed {SEED} {family}\n"
    mlx_folder = args.out / f"tiny-{args.family}-mlx"
    hf_folder = args.out / f"tiny-{args.family}-hf"
    ensure(mlx_folder, stamp, lambda tmp: build_mlx(tmp, args.family, args.tokenizer))
    ensure(hf_folder, stamp, lambda tmp: build_hf(tmp, mlx_folder))


if __name__ == "__main__":
    main()
