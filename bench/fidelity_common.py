#!/usr/bin/env python3
"""What bench/fidelity.py's measurements share: the block and tail sizes and greedy steps, the run's
clock and log, the real texts prompts are cut from, and the arrays compared: bit-level comparison
of float32 tensors, KL of two first-token distributions, the plugin's block files and the
decoder's cache as numpy."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from pdbridge_testkit import NUM_LAYERS

ROOT = Path(__file__).resolve().parent.parent

B = int(os.environ.get("PDB_FIDELITY_BLOCK", "256"))  # block tokens (decoded's default)
TAIL = 8  # prompt tokens past the last whole block: the decoder prefills them itself
GREEDY = 32
T0 = time.perf_counter()


def log(msg: str):
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------ comparison helpers

def ordered(a: np.ndarray) -> np.ndarray:
    i = a.view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def compare(got: np.ndarray, want: np.ndarray) -> dict:
    got, want = np.ascontiguousarray(got, np.float32), np.ascontiguousarray(want, np.float32)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    scale = float(np.abs(want).max())
    return {"exact": bool(np.array_equal(got.view(np.uint32), want.view(np.uint32))),
            "exact_fraction": float(np.mean(got.view(np.uint32) == want.view(np.uint32))),
            "max_ulp": int(np.abs(ordered(got) - ordered(want)).max()),
            "max_abs": float(diff.max()), "max_rel": float(diff.max() / scale) if scale else 0.0}


def summarize(stats: list[dict]) -> dict:
    return {"tensors_exact": sum(s["exact"] for s in stats), "tensors_total": len(stats),
            "min_exact_fraction": min(s["exact_fraction"] for s in stats),
            "mean_exact_fraction": float(np.mean([s["exact_fraction"] for s in stats])),
            "max_ulp": max(s["max_ulp"] for s in stats),
            "max_abs": max(s["max_abs"] for s in stats),
            "max_rel": max(s["max_rel"] for s in stats)}


def kl(p_logprobs: np.ndarray, q_logprobs: np.ndarray) -> float:
    """KL(p ‖ q) in nats, float64, both renormalized."""
    p = p_logprobs.astype(np.float64).ravel()
    q = q_logprobs.astype(np.float64).ravel()
    p -= np.logaddexp.reduce(p)
    q -= np.logaddexp.reduce(q)
    return float(np.sum(np.exp(p) * (p - q)))


def tensors_of(header: dict, payload: bytes) -> dict[tuple[int, str], np.ndarray]:
    out = {}
    for t in header["tensors"]:
        arr = np.frombuffer(payload, dtype="<f4", count=t["nbytes"] // 4, offset=t["offset"])
        out[(t["layer"], t["name"])] = arr.reshape(t["shape"])
    return out

# ------------------------------------------------------------------ texts

def real_texts() -> list[tuple[str, str]]:
    """(name, text): license/README texts of the environment's packages and the repo's LICENSE,
    deduplicated by content."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    files = [ROOT / "LICENSE"]
    for d in sorted(site.glob("*.dist-info")):
        files += sorted(p for p in d.rglob("*") if p.is_file()
                        and (p.name.upper().startswith(("LICENSE", "LICENCE", "COPYING", "NOTICE"))
                             or p.parent.name == "licenses"))
    seen, out = set(), []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        # the first 400 characters, whitespace-normalized: copies of one license (Apache-2.0
        # under another copyright line) count once
        key = hashlib.sha256(" ".join(text.split())[:400].encode()).hexdigest()
        if key in seen or len(text) < 2000:
            continue
        seen.add(key)
        name = str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) and "site-packages" not in str(f) \
            else str(f.relative_to(site))
        out.append((name, text))
    return out


def cache_np(cache, upto: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array(c.keys[..., :upto, :]), np.array(c.values[..., :upto, :])) for c in cache]


def load_blocks(files: list[str]) -> list[dict[tuple[int, str], np.ndarray]]:
    return [tensors_of(json.loads(Path(f[:-4] + ".json").read_text()), Path(f).read_bytes())
            for f in files]


def blocks_to_kv(blocks: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.concatenate([b[(l, "keys")] for b in blocks], axis=2),
             np.concatenate([b[(l, "values")] for b in blocks], axis=2))
            for l in range(NUM_LAYERS)]


def load_blocks_safetensors(files: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    import mlx.core as mx

    arrays = [mx.load(f) for f in files]
    return [(np.concatenate([np.array(a[f"{l}.keys"]) for a in arrays], axis=2),
             np.concatenate([np.array(a[f"{l}.values"]) for a in arrays], axis=2))
            for l in range(NUM_LAYERS)]
