#!/usr/bin/env python3
"""`mlx_cuda.py fidelity`: exactness of the plugin's cache path across MLX backends. The test
model's native prefill on MLX's CPU backend gives every layer's input; the cache path rebuilds the
cache from them on the CPU and on CUDA, block by block as the plugin does (elements exact, max ulp
per backend pair); then the decoder on backend B continues from the cache built on A and from its
own: first-token agreement, KL of the first-token distributions, agreement of greedy tokens."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_cuda_device import DTYPES, GPU, checkpoint, log
from pdbridge_cache import kinds
from pdbridge_cache.check import native_prefill
from pdbridge_cache.layers import CachePath

ROOT = Path(__file__).resolve().parents[2]
BLOCK_TOKENS = 256


def corpus() -> str:
    """Real prose: the repo's LICENSE and the license texts of this Python's installed packages."""
    files = [ROOT / "LICENSE"]
    for site in sorted({Path(p) for p in sys.path if p.endswith("site-packages")}):
        files += sorted(f for f in site.glob("*.dist-info/*") if re.match(r"(?i)licen[cs]e", f.name) and f.is_file())
    seen, parts = set(), []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > 500 and text not in seen:
            seen.add(text)
            parts.append(text)
    return "\n\n".join(parts)


def blocks_on(device, path: CachePath, hidden: list, n: int) -> list[dict[str, list]]:
    """Each layer's tensors for tokens [0, n), block by block as the plugin sends them, computed on `device`."""
    parts: list[dict[str, list]] = [dict() for _ in path.layers]
    with mx.stream(mx.default_stream(device)):
        for lo in range(0, n, BLOCK_TOKENS):
            hi = min(lo + BLOCK_TOKENS, n)
            inputs = mx.stack([hidden[layer][lo:hi] for layer in path.layers], axis=1)
            for layer, name, array in path.block(inputs, lo, [mx.default_stream(device)]):
                parts[layer].setdefault(name, []).append(array)
    return parts


def ordered_bits(x: mx.array) -> np.ndarray:
    """A float tensor's bit patterns as integers in the order of the values, so that the distance
    of two is their distance in units in the last place of the tensor's own dtype."""
    width = x.dtype.size * 8
    i = np.array(x.view({16: mx.int16, 32: mx.int32}[width])).astype(np.int64)
    return np.where(i < 0, -(1 << (width - 1)) - i, i)


def compare(a: list[dict[str, list]], b: list[dict[str, list]]) -> tuple[int, int, int, float]:
    """(elements equal, elements, max ulp, max |difference| over the tensor's largest |value|)
    between two reconstructions."""
    equal = total = ulp = 0
    rel = 0.0
    for la, lb in zip(a, b):
        for name in la:
            for x, y in zip(la[name], lb[name]):
                same = np.array(x == y)
                equal, total = equal + int(same.sum()), total + same.size
                ulp = max(ulp, int(np.abs(ordered_bits(x) - ordered_bits(y)).max()))
                xf, yf = np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))
                rel = max(rel, float(np.abs(xf - yf).max() / max(np.abs(yf).max(), 1e-30)))
    return equal, total, ulp, rel


def continue_from(device, model, path: CachePath, parts: list, n: int, last: int, steps: int):
    """The decoder on `device` after a cache restored from `parts` (tokens [0, n)), fed `last`:
    (first-token log-probabilities, greedy tokens)."""
    with mx.stream(mx.default_stream(device)):
        moved = [{k: [mx.array(x) for x in v] for k, v in layer.items()} for layer in parts]
        cache = kinds.restore(path.templates, moved, n, path.dtype)
        y, first, tokens = mx.array([[last]]), None, []
        for _ in range(steps):
            logits = model(y, cache=cache)[:, -1, :].astype(mx.float32)
            if first is None:
                first = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = mx.argmax(logits, axis=-1)
            tokens.append(token.item())
            y = token[None]
        return np.array(first[0]), tokens


def fidelity(args) -> dict:
    from mlx_lm.utils import load_model
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    ids = tokenizer.encode(corpus()).ids
    log(f"corpus: {len(ids)} tokens")
    backends = {"cpu": mx.cpu, "cuda": GPU}
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        model, _ = load_model(Path(args.model))
        model.set_dtype(dtype)
        path = CachePath(model, kinds.decoder_caches(model, None, 64), dtype)
        for length in (int(x) for x in args.lengths.split(",")):
            stats = {pair: {"equal": 0, "total": 0, "ulp": 0, "rel": 0.0, "first_same": 0, "kl": [], "greedy_same": 0}
                     for pair in ("cuda->cpu", "cpu->cuda")}
            for p in range(args.prompts):
                start = (p * 7919 * 3) % max(1, len(ids) - length)
                tokens = ids[start:start + length]
                mx.set_default_device(mx.cpu)
                _, hidden, _ = native_prefill(model, tokens[:-1], 2048, {})  # the prefill engine's layer inputs
                built = {name: blocks_on(device, path, hidden, length - 1) for name, device in backends.items()}
                for pair in stats:
                    src, dst = pair.split("->")
                    s = stats[pair]
                    e, t, u, r = compare(built[src], built[dst])
                    s["equal"], s["total"], s["ulp"], s["rel"] = s["equal"] + e, s["total"] + t, max(s["ulp"], u), max(s["rel"], r)
                    mx.set_default_device(backends[dst])
                    theirs = continue_from(backends[dst], model, path, built[src], length - 1, tokens[-1], args.steps)
                    own = continue_from(backends[dst], model, path, built[dst], length - 1, tokens[-1], args.steps)
                    p_own = np.exp(own[0])
                    s["kl"].append(float(np.sum(p_own * (own[0] - theirs[0]))))
                    s["first_same"] += int(own[1][0] == theirs[1][0])
                    s["greedy_same"] += int(own[1] == theirs[1])
                mx.set_default_device(mx.cpu)
                # After every prompt: a run cut short by its time limit keeps the prompts it finished.
                done = [{"dtype": dtype_name, "prompt_tokens": length, "pair": pair, "prompts": p + 1,
                         "elements_exact_pct": 100 * s["equal"] / s["total"], "max_ulp": s["ulp"],
                         "max_rel_diff": s["rel"],
                         "first_token_agreement": s["first_same"] / (p + 1),
                         f"greedy_{args.steps}_agreement": s["greedy_same"] / (p + 1),
                         "kl_mean": statistics.mean(s["kl"]), "kl_max": max(s["kl"])} for pair, s in stats.items()]
                checkpoint(args, {"model": Path(args.model).name, "rows": rows + done})
            rows += done
            for row in done:
                log(json.dumps(row))
        del model, path
    return {"model": Path(args.model).name, "block_tokens": BLOCK_TOKENS, "rows": rows}
