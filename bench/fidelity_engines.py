#!/usr/bin/env python3
"""The three engines bench/fidelity.py compares, each run in this process: the decoder (decoded's
adapter `Engine`, mlx-lm, with an optional dense fp32 twin), the prefill side (the vLLM server with
the plugin, bridging whole blocks into a socket receiver) and the plain-transfer baseline (HF
transformers' own K/V on the prefill engine's weights)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from fidelity_common import B, GREEDY, log
from pdbridge_testkit import HF_DIR, MLX_DIR
from pdbridge_testkit.decoder import CaptureInput
from pdbridge_testkit.prefill import Receiver, VllmServer


class Decoder:
    """The decoder adapter's Engine (4-bit, float32) plus, optionally, a dense fp32 twin."""

    def __init__(self, tmp: Path):
        import mlx.core as mx
        from pdbridge_mlx.engine import Engine

        self.mx = mx
        self.engine = Engine(str(MLX_DIR), block_tokens=B, dtype=mx.float32,
                             bundle_dir=str(tmp / "bundle"))
        self.q4 = self.engine.model
        self.model = self.q4  # what "the decoder" runs for native/bridged/baseline generation
        self.model_kind = "mlx 4-bit (QuantizedLinear, fp32 activations)"

    def dense_twin(self):
        import mlx.nn as nn
        from mlx.utils import tree_unflatten
        from mlx_lm import load

        mx = self.mx
        model, _ = load(str(MLX_DIR))
        model.set_dtype(mx.float32)
        swaps = []
        for path, child in model.named_modules():
            if isinstance(child, nn.QuantizedLinear):
                w = mx.dequantize(child.weight, child.scales, child.biases, child.group_size,
                                  child.bits)
                lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight = w
                swaps.append((path, lin))
        model.update_modules(tree_unflatten(swaps))
        mx.eval(model.parameters())
        return model

    def forward_rate(self, model, n: int = 64) -> float:
        from mlx_lm.models.cache import make_prompt_cache

        mx = self.mx
        cache = make_prompt_cache(model)
        toks = mx.array([list(range(1000, 1000 + n))])
        t = time.perf_counter()
        model(toks, cache=cache)
        mx.eval([c.state for c in cache])
        return n / (time.perf_counter() - t)

    def run(self, model, tokens: list[int], cache_kv: list[tuple[np.ndarray, np.ndarray]] | None = None,
            block_files: list[str] | None = None, capture: list | None = None) -> dict:
        """Greedy generation as the adapter does it (generate_step, prefill step 2048): from
        nothing (native), from given K/V covering the first whole blocks, or from block files
        through the adapter's own `restore`. Returns first-step log-probs, GREEDY tokens, the
        cache, timings."""
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        mx = self.mx
        cache = make_prompt_cache(model)
        cached = 0
        t0 = time.perf_counter()
        if block_files is not None:
            cache, cached = self.engine.restore(block_files, None, tokens, None)
        elif cache_kv is not None:
            covered = cache_kv[0][0].shape[2]
            for c, (k, v) in zip(cache, cache_kv):
                c.state = (mx.array(k), mx.array(v), covered)
            mx.eval([c.state for c in cache])
            cached = covered
        assert cached < len(tokens)
        layers = None
        if capture is not None:
            layers = model.model.layers
            model.model.layers = [CaptureInput(b, capture) for b in layers]
        out, first = [], None
        try:
            t1 = time.perf_counter()
            for tok, logprobs in generate_step(mx.array(tokens[cached:]), model, prompt_cache=cache,
                                               max_tokens=GREEDY, prefill_step_size=2048):
                if first is None:
                    first = np.array(logprobs.astype(mx.float32))
                    t_first = time.perf_counter()
                out.append(int(tok))
        finally:
            if layers is not None:
                model.model.layers = layers
        return {"logprobs": first, "tokens": out, "cache": cache, "cached": cached,
                "prefill_s": t_first - t1, "total_s": time.perf_counter() - t0}


def vllm_blocks(tmp: Path, prompts: dict[str, list[int]], bundle: str, sha: str, extra_args: list[str],
                label: str, env: dict[str, str] | None = None) -> dict:
    """Starts vLLM with the plugin, bridges every prompt's whole blocks, stops vLLM. Returns per
    prompt the block payload files, the `done` event and the POST→done time."""
    rx = Receiver(tmp / f"plugin-{label}.sock")
    server = VllmServer(tmp / f"vllm-{label}.log", extra_args=extra_args)
    server.env.update(env or {})
    out = {"startup_s": None, "prompts": {}}
    try:
        out["startup_s"] = round(server.start(), 1)
        log(f"vLLM ({label}) up in {out['startup_s']} s")
        for name, tokens in prompts.items():
            rid = f"{label}-{name}"
            n = (len(tokens) - 1) // B
            params = {"pdbridge": {"request_id": rid, "socket": rx.path, "bundle_path": bundle,
                                   "bundle_sha256": sha,
                                   "block_tokens": B, "first_block": 0, "num_blocks": n}}
            t0 = time.perf_counter()
            server.complete(tokens, params)
            msgs = rx.wait_final(rid, timeout=900)
            done = msgs[-1][1]
            if done["type"] != "done":
                raise RuntimeError(f"{rid}: {done}")
            files = []
            for _, h, p in msgs:
                if h["type"] == "block":
                    f = tmp / f"{rid}-{h['block_index']}.bin"
                    f.write_bytes(p)
                    (tmp / f"{rid}-{h['block_index']}.json").write_text(json.dumps(h))
                    files.append(str(f))
            rx.messages.pop(rid, None)
            out["prompts"][name] = {"files": files, "done": done,
                                    "post_to_done_s": round(msgs[-1][0] - t0, 2)}
            log(f"vLLM ({label}) {name}: {len(tokens)} tokens, {len(files)} blocks, "
                f"POST→done {out['prompts'][name]['post_to_done_s']} s")
    finally:
        server.stop()
        rx.close()
    return out


class TorchPrefill:
    """The prefill side's own K/V without reconstruction: HF transformers LlamaForCausalLM, fp32,
    on the prefill engine's weights (models/smollm2-hf), past_key_values copied as they are
    ([1, n_kv, T, head_dim], RoPE already applied: the decoder's layout)."""

    def __init__(self):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        torch.set_num_threads(2)
        self.model = AutoModelForCausalLM.from_pretrained(str(HF_DIR), dtype=torch.float32)
        self.model.eval()

    def kv(self, tokens: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        torch = self.torch
        with torch.no_grad():
            out = self.model(torch.tensor([tokens]), use_cache=True)
        pkv = out.past_key_values
        if hasattr(pkv, "layers"):
            pairs = [(l.keys, l.values) for l in pkv.layers]
        else:
            pairs = [(pkv[i][0], pkv[i][1]) for i in range(len(pkv))]
        return [(k.float().contiguous().numpy(), v.float().contiguous().numpy()) for k, v in pairs]
