#!/usr/bin/env python3
"""The plugin's reconstruction on a GPU with the code that ships, and exactness across backends
(issue 17). Runs where MLX has its CUDA backend (`mlx[cuda13]`) beside torch; `kit.sh`
says how it travels to a lent H200.

throughput  `pdbridge_cache.layers.CachePath` — the class the vLLM plugin reconstructs with — on
            `mx.gpu`, at real model shapes with random 4-bit weights (what a Mac decoder loads),
            per family, dtype, chunk of tokens per call and variant:
              shipped  the decoder's modules as they are (MLX's quantized matmul on 4-bit weights);
              dense    the same modules after mlx-lm's `dequantize_model`: each weight dequantized
                       once to the compute dtype, dense GEMMs.
            `layers_measured` of a family's layers are built; tok/s is scaled to its full depth.
            Beside it, torch's prefill of a Llama-3-8B shape (`llama_prefill.py`, bf16,
            FlashAttention, chunks of 8192) at 8K-128K tokens: the reconstruction's share of the
            prefill, serial, and overlapped (MLX on its own thread reconstructing each chunk while
            torch prefills the next, as the plugin's streamer thread does beside vLLM's step loop).
            Also what moving captured states from torch to MLX costs (DLPack vs through the host).
fidelity    SmolLM2-135M, 4-bit (the test model's weights, embedding quantized too so it travels):
            its native prefill on MLX's CPU backend gives every layer's input — in a bridge, the
            prefill engine's output. The cache path rebuilds the cache from those inputs on the CPU
            and on CUDA, block by block as the plugin does; per backend pair, elements exact and
            max ulp. Then the decoder on backend B continues from the cache built on A and from the
            one built on B (its own kernels — what an exact mode gives): first-token agreement, KL
            of the first-token distributions, agreement of 32 greedy tokens, per prompt length.

    python bench/gpu/mlx_cuda.py throughput --out DIR [--quick]
    python bench/gpu/mlx_cuda.py fidelity --model DIR --out DIR [--prompts 8]

The measurements live in `mlx_cuda_throughput.py` and `mlx_cuda_fidelity.py`, what they share in
`mlx_cuda_device.py`; this is their command line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx

from mlx_cuda_device import log
from mlx_cuda_fidelity import fidelity
from mlx_cuda_throughput import throughput


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--layers", type=int, default=8, help="layers built per family (tok/s scaled to full depth)")
    t.add_argument("--quick", action="store_true")
    f = sub.add_parser("fidelity")
    f.add_argument("--model", required=True)
    f.add_argument("--prompts", type=int, default=8)
    f.add_argument("--lengths", default="512,2048,6144")
    f.add_argument("--dtypes", default="float32,bfloat16")
    f.add_argument("--steps", type=int, default=32)
    for s in (t, f):
        s.add_argument("--out", required=True)
        s.add_argument("--smoke", action="store_true", help="MLX's CPU backend standing in for CUDA")
    args = p.parse_args()
    started = time.time()
    result = throughput(args) if args.what == "throughput" else fidelity(args)
    import mlx_lm

    result.update({"complete": True, "what": args.what, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                   "device": mx.device_info() if hasattr(mx, "device_info") else str(mx.default_device()),
                   "python": platform.python_version(), "duration_s": round(time.time() - started, 1)})
    out = Path(args.out) / f"{args.what}.json"
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
