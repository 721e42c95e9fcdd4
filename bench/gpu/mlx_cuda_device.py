#!/usr/bin/env python3
"""What bench/gpu/mlx_cuda.py's measurements share: the MLX device standing for the GPU (`--smoke`
anywhere on the command line: MLX's CPU backend, so the same code runs on a CPU at tiny sizes), the
dtypes by name, the log, and the partial result a run cut short still leaves."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx

# `--smoke` (anywhere, CPU only): the same code on MLX's CPU backend standing in for CUDA, tiny sizes.
SMOKE = "--smoke" in sys.argv
GPU = mx.cpu if SMOKE else mx.gpu
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def checkpoint(args, result: dict) -> None:
    """What is measured so far, so a run cut short by its time limit still leaves it."""
    Path(args.out, f"{args.what}.json").write_text(json.dumps({**result, "complete": False}, indent=1, default=str))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
