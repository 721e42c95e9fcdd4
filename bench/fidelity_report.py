#!/usr/bin/env python3
"""bench/fidelity.py's result: the end-to-end summary over the prompts run, the explanations of
every result that is not bit-exact (from the measured values), and fidelity.md."""

from __future__ import annotations

import numpy as np

from fidelity_common import B, GREEDY, TAIL


def summarize_e2e(R: dict, rows: list[dict]):
    R["rows"] = rows
    R["prompts"] = len(rows)
    if not rows:
        return
    R["prompt_tokens"] = [r["tokens"] for r in rows]
    mean = lambda xs: float(np.mean(xs))  # noqa: E731
    for key, pre in (("bridged", ""), ("baseline", "baseline_")):
        R[f"{pre}first_token_agreement"] = mean([r[key]["first_token_agrees"] for r in rows])
        R[f"{pre}greedy32_agreement"] = mean([r[key]["greedy32_identical"] for r in rows])
        R[f"{pre}greedy32_mean_matched_prefix"] = mean([r[key]["greedy_matched_prefix"] for r in rows])
        R[f"{pre}kl_mean"] = mean([r[key]["kl"] for r in rows])
        R[f"{pre}kl_max"] = max(r[key]["kl"] for r in rows)
        R[f"{pre}kv_max_rel"] = max(r[key]["kv"]["max_rel"] for r in rows)
    R["first_logprobs_bit_identical"] = sum(r["bridged"]["logprobs_bit_identical"] for r in rows)
    R["reconstruction_closer_than_plain_transfer"] = {
        "kl_mean": R["kl_mean"] < R["baseline_kl_mean"],
        "kv_max_rel": R["kv_max_rel"] < R["baseline_kv_max_rel"]}


def explain(R: dict):
    """Explanations of every non-bit-exact result, from the measured values (R["explanations"],
    rewritten each time; R["notes"] holds what happened during the run)."""
    notes = R["explanations"] = []
    if "same_input" in R:
        s = R["same_input"]
        notes.append(
            f"Item 1: the decoder's own layer inputs (captured from mlx-lm's prefill of {s['prompt_tokens']} "
            f"tokens) through the plugin's cache path: {s['tensors_exact']}/{s['tensors_total']} "
            "K/V tensors bit-exact. Same MLX ops (fast.rms_norm, quantized_matmul, fast.rope) on the same "
            "inputs; MLX's CPU kernels are per-token and per-output sequential, so block offset and "
            "chunking do not change the bits.")
    if "bridged_vs_native_kv_probe" in R:
        s = R["bridged_vs_native_kv_probe"]
        notes.append(
            f"From vLLM's captured hidden states the bridged K/V are not bit-exact: {s['tensors_exact']}/"
            f"{s['tensors_total']} tensors exact (layer 0's K and V are: its input is the embedding row, "
            f"identical in both engines), mean exact-element fraction {s['mean_exact_fraction']:.3f}, "
            f"max rel {s['max_rel']:.2e}, max ulp {s['max_ulp']}. The weights are bit-identical (the decoder's "
            "4-bit weights dequantized by MLX's formula, fp32); the residual stream entering layers 1..29 "
            "differs because vLLM-CPU (torch/oneDNN GEMMs, its own attention) sums in another order than "
            "MLX's scalar qmm and SDPA. The reconstruction itself adds no error (item 1).")
    notes.append("max_ulp of a non-bit-exact comparison (chunking, bridged vs native) is dominated by "
                 "elements near zero whose sign differs (the ordering distance crosses zero); max_abs and "
                 "max_rel are the meaningful sizes there.")
    if "chunking" in R and not R.get("chunk_independent", True):
        c = R["chunking"]
        same = [b["block"] for b in c["blocks"] if b["byte_identical"]]
        probes = c.get("probes", {})
        nosplit = probes.get("split_kv_off_byte_identical_blocks", [])
        rows = probes.get("gemm_rows", [])
        differ = [f"{r['k']}x{r['n']} in a {r['step_tokens']}-token step" for r in rows if not r["identical"]]
        chunk_sized = [r for r in rows if r["step_tokens"] >= B]
        gemm = (f"its fp32 linear layers (oneDNN, this model's widths) keep a token's output row "
                f"bit-identical in steps of {B} and {2 * B} tokens at any place in the step"
                if chunk_sized and all(r["identical"] for r in chunk_sized) else
                f"its fp32 linear layers (oneDNN) change a token's output row with the step size")
        gemm += f" (rows that differ: {differ or 'none'}; a 1-token step is decode, not a prefill chunk)"
        notes.append(
            f"Item 2: chunk_independent is false as measured: {c['tensors_exact']}/{c['tensors_total']} "
            f"tensors identical between --max-num-batched-tokens 256 and the default (one step), "
            f"byte-identical blocks {same}, max rel {c['max_rel']:.2e}, max ulp {c['max_ulp']}. The plugin's "
            "MLX math is chunk-independent (item 1 reconstructs at each block's offset bit-exactly); vLLM-CPU's "
            f"fp32 forward is not. Where it comes from: {gemm}, and block 0 (the same queries over the same "
            "keys in both schedules) is identical; with the attention kernel's key split off "
            f"(VLLM_CPU_ATTN_SPLIT_KV=0) the byte-identical blocks are still only {nosplit}. So the difference "
            "is vLLM-CPU's attention: a chunk that starts mid-sequence attends to the earlier keys read back "
            "from the paged cache as context, in another summation order than the same queries inside one "
            "longer step. No public vLLM knob fixes that order. One schedule is reproducible: the same prompt "
            f"bridged twice at 256 tokens per step gave byte-identical blocks: "
            f"{probes.get('same_schedule_repeat_byte_identical')}. The decoder's own "
            "CPU prefill, by contrast, is chunk-independent.")
    if R.get("prompts"):
        notes.append(
            f"Item 4: bridged = the plugin's blocks (vLLM fp32, default chunking) restored into the decoder's "
            f"KVCache, the decoder prefills the last {TAIL} tokens and generates {GREEDY} greedy tokens; native "
            "= the decoder prefills the whole prompt itself (generate_step, prefill step 2048, as the adapter). "
            "Baseline = plain transfer, no reconstruction: K/V recomputed by HF transformers (torch fp32, sdpa) "
            "on the prefill engine's weights (models/smollm2-hf), i.e. the prefill side's own attention "
            "K/V after its own RoPE (inv_freq and cos/sin computed the HF way), copied as-is into the "
            "decoder's [1, n_kv, T, head_dim] layout; NOT read from vLLM's paged cache (the plugin does "
            "not export it). KL = KL(native || x) of the first next-token distribution, nats.")
        notes.append(
            f"Reconstruction closer to native than plain transfer: KL mean {R['kl_mean']:.3e} vs "
            f"{R['baseline_kl_mean']:.3e}; K/V max rel {R['kv_max_rel']:.2e} vs {R['baseline_kv_max_rel']:.2e}. "
            "Here the prefill weights ARE the decoder's weights (dequantized bit-exactly), so plain transfer "
            "differs from native only by arithmetic (summation order, RoPE formula); with the original "
            "checkpoint instead, the gap would be the quantization gap.")


def markdown(R: dict) -> str:
    g = R.get
    lines = [f"# Bridge fidelity ({g('date')})", "",
             f"Decoder: {g('decoder_model')}; block {B} tokens; wall {g('wall_s')} s.", "",
             "| check | result |", "|---|---|",
             f"| 1. same-input reconstruction vs native cache | {g('tensors_exact')}/{g('tensors_total')} "
             f"tensors bit-exact, min exact fraction {g('min_exact_fraction')}, max ulp {g('max_ulp')} |",
             f"| 2. chunk independence (vLLM 256 vs default) | {g('chunk_independent')}"
             + (f" — {R['chunking']['tensors_exact']}/{R['chunking']['tensors_total']} tensors identical, "
                f"max rel {R['chunking']['max_rel']:.2e}, max ulp {R['chunking']['max_ulp']}"
                if 'chunking' in R else "") + " |",
             f"| 3. store round trip (export → restore → generate) | {g('roundtrip_identical')} |",
             f"| 4. prompts (tokens) | {g('prompts')} ({g('prompt_tokens')}) |"]
    if g("prompts"):
        lines += [f"| first-token agreement, bridged / baseline | {g('first_token_agreement'):.3f} / "
                  f"{g('baseline_first_token_agreement'):.3f} |",
                  f"| 32 greedy tokens identical, bridged / baseline | {g('greedy32_agreement'):.3f} / "
                  f"{g('baseline_greedy32_agreement'):.3f} |",
                  f"| KL(native ‖ x) first token, mean, bridged / baseline | {g('kl_mean'):.3e} / "
                  f"{g('baseline_kl_mean'):.3e} |",
                  f"| K/V max rel vs native, bridged / baseline | {g('kv_max_rel'):.2e} / "
                  f"{g('baseline_kv_max_rel'):.2e} |", "",
                  "| prompt | source | tokens | native prefill s | bridged: 1st, g32 prefix, KL | "
                  "baseline: 1st, g32 prefix, KL |", "|---|---|---|---|---|---|"]
        for r in R["rows"]:
            lines.append(f"| {r['prompt']} | {r['source']} | {r['tokens']} | {r['native_prefill_s']} | "
                         f"{r['bridged']['first_token_agrees']}, {r['bridged']['greedy_matched_prefix']}, "
                         f"{r['bridged']['kl']:.2e} | {r['baseline']['first_token_agrees']}, "
                         f"{r['baseline']['greedy_matched_prefix']}, {r['baseline']['kl']:.2e} |")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in R.get("notes", []) + R.get("explanations", [])]
    return "\n".join(lines) + "\n"
