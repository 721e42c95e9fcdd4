#!/usr/bin/env python3
"""Where a bridged answer goes wrong on a GPU machine, one layer of the path at a time, on the
decoder's own model (default: the test model) and MLX's default device then its CPU:

  native     greedy tokens from a fresh cache (the reference);
  restored   the native cache's rows restored through the codec (`kinds.restore`), greedy from there;
  from_file  the same rows written and read back as safetensors (what the store and the adapter do);
  same_input the cache path (what the plugin runs) vs the native cache, tensors bit-exact.

    .venv/bin/python bench/gpu/diagnose.py [--model models/smollm2-mlx] [--blocks 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from pdbridge_cache import kinds
from pdbridge_cache.check import native_prefill, same_input
from pdbridge_cache.layers import CachePath
from pdbridge_mlx.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
BLOCK, STEP = 256, 512


def greedy(engine: Engine, cache, tokens: list[int]) -> list[int]:
    steps = generate_step(mx.array(tokens), engine.model, prompt_cache=cache, max_tokens=8,
                          prefill_step_size=STEP, **engine.kv_args)
    return [int(t) for t, _ in steps]


def on_device(model: str, blocks: int, tmp: str) -> dict:
    engine = Engine(model, block_tokens=BLOCK, dtype=mx.float32, bundle_dir=tmp)
    tokens = engine.tokenizer.encode((ROOT / "LICENSE").read_text())[:blocks * BLOCK + 9]
    n = blocks * BLOCK
    out = {"device": str(mx.default_device()), "native": greedy(engine, make_prompt_cache(engine.model), tokens)}
    native, _, _ = native_prefill(engine.model, tokens, STEP, engine.kv_args)
    rows = [{k: [a] for k, a in kinds.codec_for(c).tensors(c).items()} for c in native]
    out["restored"] = greedy(engine, kinds.restore(engine.templates, rows, n, mx.float32), tokens[n:])
    path = Path(tmp) / "rows.safetensors"
    mx.save_safetensors(str(path), {f"{i}.{k}": v[0] for i, r in enumerate(rows) for k, v in r.items()})
    loaded = mx.load(str(path))
    back = [{k: [loaded[f"{i}.{k}"]] for k in r} for i, r in enumerate(rows)]
    out["from_file"] = greedy(engine, kinds.restore(engine.templates, back, n, mx.float32), tokens[n:])
    result = same_input(engine.model, CachePath.from_bundle(str(engine.bundle_path)), tokens, BLOCK, STEP,
                        engine.kv_args)
    out["same_input"] = f"{result.tensors_exact}/{result.tensors_total}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-mlx"))
    p.add_argument("--blocks", type=int, default=4)
    args = p.parse_args()
    for device in (mx.default_device(), mx.cpu):
        mx.set_default_device(device)
        with tempfile.TemporaryDirectory(prefix="pdb-diagnose-") as tmp:
            print(json.dumps(on_device(args.model, args.blocks, tmp)), flush=True)


if __name__ == "__main__":
    main()
