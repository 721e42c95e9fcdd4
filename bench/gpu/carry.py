#!/usr/bin/env python3
"""The test model's decoder folder as the GPU kit carries it: its 4-bit scales and biases in fp16,
as the GGUF's Q4_1 blocks hold them, so a part is a third smaller and fp16 -> fp32 is exact:
`unpack` restores the rig's folder bit for bit (`pack` refuses a folder where it would not).

Usage: .venv/bin/python bench/gpu/carry.py pack|unpack SRC DST
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import mlx.core as mx

WEIGHTS = "model.safetensors"


def _converted(src: Path, dst: Path, dtype) -> dict[str, mx.array]:
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns(WEIGHTS))
    original = mx.load(str(src / WEIGHTS))
    weights = {k: v.astype(dtype) if k.endswith((".scales", ".biases")) else v for k, v in original.items()}
    mx.save_safetensors(str(dst / WEIGHTS), weights, metadata={"format": "mlx"})
    return original


def pack(src: Path, dst: Path) -> None:
    original = _converted(src, dst, mx.float16)
    packed = mx.load(str(dst / WEIGHTS))
    inexact = [k for k, v in original.items() if not mx.array_equal(packed[k].astype(v.dtype), v).item()]
    if inexact:
        raise SystemExit(f"carry: not fp16-exact, the kit cannot carry {src} so: {inexact[:4]}")


def unpack(src: Path, dst: Path) -> None:
    _converted(src, dst, mx.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("pack", "unpack"))
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    args = p.parse_args()
    {"pack": pack, "unpack": unpack}[args.action](args.src, args.dst)


if __name__ == "__main__":
    main()
