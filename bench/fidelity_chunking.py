#!/usr/bin/env python3
"""bench/fidelity.py's item 2 probes: where vLLM-CPU's chunk dependence comes from (its fp32 linear
layers' row invariance, its attention kernel's key split, one schedule's reproducibility), in a
full run or alone (`--probe-chunking`) into an existing fidelity.json."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from fidelity_common import ROOT, B, TAIL, log
from fidelity_engines import Decoder, vllm_blocks
from fidelity_report import explain, markdown
from pdbridge_testkit import HF_DIR


def probe_chunking_into(out_dir: Path):
    """--probe-chunking: item 2's probes on the probe prompt, merged into an existing result."""
    path = out_dir / "fidelity.json"
    R = json.loads(path.read_text())
    tmp = Path(tempfile.mkdtemp(prefix="pdb-fidelity-"))
    try:
        dec = Decoder(tmp)
        license_text = (ROOT / "LICENSE").read_text()
        license_ids = dec.engine.tokenizer.encode(license_text)
        chunk_ids = license_ids[: min(len(license_ids) - 1, 4 * B + TAIL)]
        assert len(chunk_ids) == R["chunking"]["prompt_tokens"], "same probe prompt as the run"
        R["chunking"]["probes"] = chunking_probes(tmp, str(dec.engine.bundle_path), dec.engine.bundle_sha256,
                                                  chunk_ids)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    explain(R)
    path.write_text(json.dumps(R, indent=2) + "\n")
    (out_dir / "fidelity.md").write_text(markdown(R))
    log(f"item 2 probes: {R['chunking']['probes']}; rewrote {path} and fidelity.md")


def chunking_probes(tmp: Path, bundle: str, sha: str, chunk_ids: list[int]) -> dict:
    """Where vLLM-CPU's chunk dependence comes from. (a) Its fp32 linear layers (oneDNN, as
    `dispatch_cpu_unquantized_gemm` builds them) on this model's widths: does a token's output row
    keep its bits whatever the step's token count and the row's place in it? (b) Its attention
    kernel can split a sequence's keys across threads (VLLM_CPU_ATTN_SPLIT_KV, on by default): do
    the blocks agree across chunkings with the split off?"""
    import torch
    from vllm import _custom_ops as ops

    cfg = json.loads((HF_DIR / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    rows = []  # rows B..B+m of a whole-prompt product, recomputed in an m-token step
    for k, n in ((cfg["hidden_size"], cfg["intermediate_size"]), (cfg["intermediate_size"], cfg["hidden_size"])):
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(4 * B + TAIL, k, generator=gen)
        handle = ops.create_onednn_mm(w.t(), 32)
        whole = ops.onednn_mm(handle, x, None)
        for m in (1, 7, B, 2 * B):
            part = ops.onednn_mm(handle, x[B:B + m].contiguous(), None)
            rows.append({"k": k, "n": n, "step_tokens": m, "identical": bool(torch.equal(part, whole[B:B + m]))})
    off = {"VLLM_CPU_ATTN_SPLIT_KV": "0"}
    # The 256 run bridges the prompt twice: is one schedule reproducible?
    runs = {label: vllm_blocks(tmp, prompts, bundle, sha, extra, f"nosplit-{label}", env=off)
            for label, extra, prompts in (("256", ["--max-num-batched-tokens", "256"],
                                           {"probe": chunk_ids, "repeat": chunk_ids}),
                                          ("default", [], {"probe": chunk_ids}))}

    def same(a: dict, b: dict) -> list[bool]:
        return [Path(x).read_bytes() == Path(y).read_bytes() for x, y in zip(a["files"], b["files"])]

    p256, pdef = runs["256"]["prompts"], runs["default"]["prompts"]
    return {"gemm_rows": rows, "gemm_rows_invariant": all(r["identical"] for r in rows),
            "split_kv_off_byte_identical_blocks": [i for i, e in enumerate(same(p256["probe"], pdef["probe"])) if e],
            "same_schedule_repeat_byte_identical": all(same(p256["probe"], p256["repeat"]))}
