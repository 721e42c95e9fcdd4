#!/usr/bin/env python3
"""The captured states' trip into MLX on the prefill box's host, side by side in one run:

    float32  what the plugin did before: torch bf16 -> float32 copy -> numpy -> a reordering copy
             -> each layer's slice into MLX, cast to the decoder's bf16;
    bits     `reconstruct.captured_states`: bf16 handed to MLX as its bits, each layer's slice cast.

Both end with the same per-layer MLX arrays (checked). Median of --repeats after a warm-up; the
ratio is the result (absolute times depend on the host's cores and memory bandwidth).

Usage: .venv/bin/python bench/host_trip.py [--tokens 2048] [--layers 32] [--hidden 4096] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch

from pdbridge_vllm import reconstruct


def layers_in_mlx(states, layers: int) -> list[mx.array]:
    arrays = [mx.array(states[None, :, j, :]).astype(mx.bfloat16) for j in range(layers)]
    mx.eval(arrays)
    return arrays


def via_float32(hidden: torch.Tensor, ids: list[int]) -> list[mx.array]:
    return layers_in_mlx(hidden.float().numpy()[:, ids, :], len(ids))


def via_bits(hidden: torch.Tensor, ids: list[int]) -> list[mx.array]:
    return layers_in_mlx(reconstruct.captured_states(hidden, ids, ids), len(ids))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    hidden = torch.randn(args.tokens, args.layers, args.hidden,
                         generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids = list(range(args.layers))
    a, b = via_float32(hidden, ids), via_bits(hidden, ids)  # warm-up, and the same arrays
    assert all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True)), "the two trips differ"
    seconds = {"float32": [], "bits": []}
    for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits both
        for name, trip in (("float32", via_float32), ("bits", via_bits)):
            start = time.perf_counter()
            trip(hidden, ids)
            seconds[name].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in seconds.items()}
    result = {"benchmark": "captured states into MLX on the host (bench/host_trip.py)",
              "shape": {"tokens": args.tokens, "layers": args.layers, "hidden": args.hidden, "dtype": "bfloat16"},
              "cpus": os.cpu_count(), "seconds": seconds, "median_s": medians,
              "ratio_float32_over_bits": medians["float32"] / medians["bits"]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_trip.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
