#!/usr/bin/env python3
"""A cache-shape twin of the decoder model, for benchmarking the shard path elsewhere.

`push_throughput` needs a real decoded, and decoded needs its real engine to publish the
cache spec. Where the real model cannot travel (a lent benchmark box takes tens of MiB, not
the 114 MB model plus its engine), this writes a model that mlx-lm loads like the real one and
whose KV cache has exactly the real one's shape: the same layers, KV heads, head_dim, dtype and
quantization, so every block is the same number of bytes in the same tensors. Only the widths
that do not reach the cache (query heads, hidden size, MLP, vocabulary) shrink, and the weights are random: the store
does not interpret cache values.

    .venv/bin/python bench/twin_model.py models/smollm2-mlx OUT_DIR
"""

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama


def main(src: Path, dst: Path):
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "llama":
        sys.exit(f"{src}: twin supports llama-architecture models, not {config.get('model_type')}")
    q = config["quantization"]
    # The cache sees only KV heads and head_dim: one query head per KV head, a hidden width
    # of one quantization group per KV head and a small vocabulary shrink the weights ~50x.
    kv_heads, group = config["num_key_value_heads"], q["group_size"]
    twin = {**config, "num_attention_heads": kv_heads, "hidden_size": kv_heads * group,
            "intermediate_size": group, "vocab_size": 4096}
    model = llama.Model(llama.ModelArgs.from_dict(twin))
    nn.quantize(model, group_size=q["group_size"], bits=q["bits"])
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(twin, indent=2) + "\n")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, dst / f.name)
    size = sum(f.stat().st_size for f in dst.iterdir())
    print(f"twin of {src} in {dst}: {size / 1e6:.1f} MB")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
