"""Where the kv route's fused quantizer and torch's disagree on a GPU, and which one is off.

`kv_quant_fused.Fused` uses the Triton kernel only where its bytes equal `kv_quant.quantize`'s on
the device; this names the disagreement when there is one. For each dtype, bits and group size it
quantizes cache-shaped random rows on CUDA by both, counts the differing codes, scales and biases,
and judges each side against the same torch code on the CPU (plain IEEE float32): the side that
differs from the CPU is the one to fix. The differing groups' inputs go to --out (JSON, float32
bits), so a CPU session can replay them in Triton's interpreter.

Run on the GPU box: PYTHONPATH=prefilld/engine python bench/gpu/kv_quant_diff.py --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pdbridge_vllm import kv_quant, kv_quant_fused

PARTS = ("codes", "scales", "biases")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def differing_groups(a, b, group_size: int, bits: int) -> set[int]:
    """Indices (over all groups) where any part of `a` and `b` differs."""
    groups = set()
    for name, x, y in zip(PARTS, a, b):
        per = group_size * bits // 8 if name == "codes" else x.element_size()  # bytes per group
        differs = (x.view(torch.uint8) != y.view(torch.uint8)).reshape(-1, per).any(-1)
        groups |= set(differs.nonzero().flatten().tolist())
    return groups


def compare(dtype: torch.dtype, group_size: int, bits: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(8, 4096, 128, generator=gen) * 3).to(dtype)
    torch_gpu = kv_quant.quantize(w.cuda(), group_size, bits, kv_quant.GPU)
    fused = kv_quant_fused.quantize(w.cuda(), group_size, bits)
    cpu = kv_quant.quantize(w, group_size, bits, kv_quant.GPU)
    torch_gpu, fused = [tuple(t.cpu() for t in r) for r in (torch_gpu, fused)]
    row = {"dtype": str(dtype).removeprefix("torch."), "group": group_size, "bits": bits,
           "groups": w.numel() // group_size}
    for label, got in (("fused", fused), ("torch_gpu", torch_gpu)):
        row[f"{label}_vs_cpu"] = {name: int((x.view(torch.uint8) != y.view(torch.uint8)).sum())
                                  for name, x, y in zip(PARTS, got, cpu)}
    bad = sorted(differing_groups(fused, torch_gpu, group_size, bits))
    row["groups_fused_vs_torch_gpu"] = len(bad)
    rows = w.reshape(-1, group_size)
    row["examples"] = [rows[g].float().view(torch.int32).tolist() for g in bad[:8]]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for dtype in DTYPES.values():
        for bits in (4, 8):
            for group_size in (32, 64, 128):
                row = compare(dtype, group_size, bits, seed=len(results))
                results.append(row)
                print({k: v for k, v in row.items() if k != "examples"}, flush=True)
    (args.out / "kv_quant_diff.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
