#!/usr/bin/env python3
"""The in-process half of a model row (bench/models.py): the decoder adapter's `Engine` for a row;
same-input exactness of the cache path; the bridged blocks found in a run's store and generation
from them next to a native prefill (first-token log-probabilities, greedy tokens, KL); where the
cache rounds to fp8/fp4, which values flipped a rounding step; and the bytes per token the wire
carried and the decoder's own cache holds."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from daemons import BLOCK_TOKENS, model_folder
from model_rows import Row

GREEDY = 32
SAME_INPUT_STEP = 384


def tokenize_request(prompt: dict):
    """The decoder adapter's request for a bench prompt: a chat, or a base model's plain prompt."""
    from pdbridge_cache.proto import engine_pb2

    if "messages" in prompt:
        return engine_pb2.TokenizeRequest(messages_json=json.dumps(prompt["messages"]))
    return engine_pb2.TokenizeRequest(prompt=prompt["prompt"])


def engine_for(row: Row, bundle_dir: Path):
    import mlx.core as mx
    from pdbridge_mlx.engine import Engine

    return Engine(str(model_folder(row.model, "mlx")), block_tokens=BLOCK_TOKENS,
                  dtype=getattr(mx, row.cache_dtype), bundle_dir=str(bundle_dir),
                  kv_bits=row.kv_bits, kv_group_size=row.kv_group_size)


def same_input(engine, tokens: list[int]) -> dict:
    from pdbridge_cache.check import same_input as check
    from pdbridge_cache.layers import CachePath

    result = check(engine.model, CachePath.from_bundle(str(engine.bundle_path)), tokens, BLOCK_TOKENS,
                   SAME_INPUT_STEP, engine.kv_args)
    return asdict(result)


def own_bytes(engine, kind: str) -> int:
    """What the decoder's own caches hold, summed over the layers of `kind`: per token for rows
    (each tensor's per-token row in the decoder's dtype and quantization), per snapshot for a
    recurrent state, as its spec describes them; for pooled layers, what they hold after one block
    (the window and the block's groups, in the decoder's dtype: `LayerCache.nbytes`)."""
    from pdbridge_cache.kinds import POOLED, codec_for, decoder_caches

    if kind == POOLED:
        import mlx.core as mx

        caches = decoder_caches(engine.model, None, 64)
        engine.model(mx.zeros((1, BLOCK_TOKENS), mx.int32), cache=caches)
        return sum(c.nbytes for c in caches if codec_for(c).kind == POOLED)
    from pdbridge_cache.format import safetensors_dtype
    from pdbridge_cache.safetensors_io import DTYPE_NAMES

    size = {name: dtype.size for dtype, name in DTYPE_NAMES.items()}
    return sum(math.prod(t["shape"]) * size[safetensors_dtype(t["dtype"])]
               for layer in engine.spec["layers"] if layer["kind"] == kind for t in layer["tensors"])


def store_blocks(store: Path) -> dict[tuple[str, tuple[int, ...]], str]:
    """Every block file of a run's store by (parent key, token ids), from the files' metadata."""
    from pdbridge_cache import blockfile
    from safetensors import safe_open

    out = {}
    for path in (store / "blocks").rglob("*.safetensors"):
        with safe_open(str(path), "numpy") as f:
            block = blockfile.read(f.metadata())
        out[(block.parent, tuple(block.token_ids))] = str(path)
    return out


def chain(blocks: dict, tokens: list[int], per_block: bool) -> list[str]:
    """The store files covering the prompt's whole blocks, in order, as far as they go (with a
    recurrent state or pools, the blocks of all but the last token, as the store keeps them)."""
    parent, paths = "00" * 32, []
    for i in range((len(tokens) - per_block) // BLOCK_TOKENS):
        ids = tuple(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
        path = blocks.get((parent, ids))
        if path is None:
            break
        paths.append(path)
        parent = Path(path).stem
    return paths


def generation(engine, tokens: list[int], paths: list[str]):
    """First-token log-probabilities and GREEDY greedy tokens, natively (no paths) or from blocks."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from pdbridge_mlx.engine import PREFILL_STEP_SIZE

    cache, cached = engine.restore(paths, None, tokens, None) if paths else (make_prompt_cache(engine.model), 0)
    first, out = None, []
    for token, logprobs in generate_step(mx.array(tokens[cached:]), engine.model, prompt_cache=cache,
                                         max_tokens=GREEDY, prefill_step_size=PREFILL_STEP_SIZE,
                                         **engine.kv_args):
        if first is None:
            first = np.array(logprobs.astype(mx.float32))
        out.append(int(token))
    return first, out


def rounding_flips(engine, tokens: list[int], paths: list[str], export_dir: Path) -> dict:
    """Per pooled field, (values that differ, values) between the bridged blocks at `paths` and the
    decoder's own export of the same blocks, dequantized; and how many blocks are bit-identical."""
    import shutil

    import mlx.core as mx
    from pdbridge_cache.kinds import POOLED, codec_for
    from pdbridge_testkit.decoder import export_blocks

    shutil.rmtree(export_dir, ignore_errors=True)
    own = export_blocks(engine, tokens[:len(paths) * BLOCK_TOKENS], export_dir)
    pooled = [i for i, c in enumerate(engine.templates) if codec_for(c).kind == POOLED]
    counts: dict = {}
    identical = 0
    for theirs, mine in zip(paths, own):
        a, b = mx.load(theirs), mx.load(mine)
        identical += all(mx.array_equal(a[k], b[k]).item() for k in b)
        for layer in pooled:
            codec = codec_for(engine.templates[layer])
            for field, (mode, group) in codec.formats.items():
                if f"{layer}.{field}" not in b:
                    continue
                x, y = (mx.dequantize(t[f"{layer}.{field}"], t[f"{layer}.{field}_scales"], group_size=group,
                                      mode=mode, dtype=mx.float32) for t in (a, b))
                differing, total = counts.get(field, (0, 0))
                counts[field] = (differing + int(mx.sum(x != y).item()), total + x.size)
    return {**counts, "blocks_identical": identical, "blocks": len(paths)}


def kl(p_logprobs, q_logprobs) -> float:
    """KL(p ‖ q) in float64, each side renormalized (fp32 log-softmax sums to 1 only to ~1e-7)."""
    import numpy as np

    def normalized(lp):
        lp = lp.astype(np.float64).ravel()
        top = lp.max()
        return lp - (top + np.log(np.exp(lp - top).sum()))

    p, q = normalized(p_logprobs), normalized(q_logprobs)
    return float(np.sum(np.exp(p) * (p - q)))


def file_tensor_bytes(path: str) -> int:
    """The tensor data of a block file (its size less the safetensors header): what the wire
    carried for it as shard payloads."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return Path(path).stat().st_size - 8 - header
