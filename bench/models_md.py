#!/usr/bin/env python3
"""MODELS.md, the support table bench/models.py writes from its rows: the table, the routes, and
the notes on pooled caches (DeepSeek-V4.1's rounding flips) and on the real checkpoints' prompts."""

from __future__ import annotations

import math

from daemons import BLOCK_TOKENS, ROOT
from models_decoder import SAME_INPUT_STEP


def support_table(rows: list[dict]) -> str:
    def fmt(x, spec):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    def vs_full(r):
        v = r.get("vs_full_precision")
        if not v:
            return "(is the reference)"
        return f"{v['native_first_token_agreement']:.2f} / {v['bridged_first_token_agreement']:.2f}"

    head = ("| family | cache classes | cache dtype | weights | bridged | tensors exact | first token | "
            "greedy 32 | KL mean | payload / own cache | first token vs fp32: native / bridged |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['family']} | {', '.join(r['cache_classes'])}{' ' + str(r['kv_bits']) + '-bit' if r['kv_bits'] else ''} "
        f"| {r['cache_dtype']} | {r['weights']} | {'yes' if r['bridged'] else 'no'} "
        f"| {r['tensors_exact']}/{r['tensors_total']} | {fmt(r['first_token_agreement'], '.2f')} "
        f"| {fmt(r['greedy32_agreement'], '.2f')} | {fmt(r['kl_mean'], '.1e')} | {fmt(r['payload_ratio'], '.3f')} "
        f"| {vs_full(r)} |\n"
        for r in rows
    )
    return head + body


def pooled_note(rows: list[dict]) -> str:
    """For pooled rows (DeepSeek-V4.1), how often the prefill engine's inputs flip a rounding step."""
    out = ""
    for r in rows:
        flips = r.get("rounding_flips")
        if not flips:
            continue
        fields = ", ".join(f"{field} {v['differing']:,} of {v['values']:,}" for field, v in flips.items()
                           if isinstance(v, dict))
        out += (f"\n{r['family']}: its cache is rounded to fp8 (window) and fp4 (pools, index keys) values, so a "
                f"small difference in the prefill engine's layer inputs can flip a whole rounding step. Of the "
                f"bridged blocks' values, differing from the decoder's own export of the same prompts: {fields}; "
                f"{flips['blocks_bit_identical']} of {flips['blocks']} blocks bit-identical. Payload "
                f"{r['payload_bytes_per_token']:.0f} bytes/token against {r['decoder_cache_bytes_per_token']:.0f} "
                f"of the decoder's own (fp32) cache; TTFT native {r['timing_s_mean']['native_ttft']:.2f} s, bridged "
                f"{r['timing_s_mean']['bridged_ttft']:.2f} s.\n")
    return out


def real_note(rows: list[dict]) -> str:
    """For the real checkpoints' rows: what the prompts were, and TTFT native vs bridged by length."""
    out = ""
    for r in rows:
        if r["model"].startswith("tiny-") or "sources" not in r:  # rows measured before sources were kept
            continue
        per = r["per_prompt"]
        by_length: dict[int, list] = {}
        for p in per:
            by_length.setdefault(round(p["prompt_tokens"], -2), []).append(p)
        ttft = "; ".join(
            f"~{length:,}: {sum(p['native_ttft_s'] for p in ps) / len(ps):.1f} s / "
            f"{sum(p['bridged_ttft_s'] for p in ps) / len(ps):.1f} s" for length, ps in sorted(by_length.items()))
        vs = r.get("vs_full_precision")
        against = (f"; first token against the fp32 decoder's: native {vs['native_first_token_agreement']:.2f}, "
                   f"bridged {vs['bridged_first_token_agreement']:.2f} (KL {vs['native_kl_mean']:.1e} / "
                   f"{vs['bridged_kl_mean']:.1e})" if vs else "")
        shortest, longest = min(p["prompt_tokens"] for p in per), max(p["prompt_tokens"] for p in per)
        lengths = f"{shortest:,}" if shortest == longest else f"{shortest:,}-{longest:,}"
        blas = ""
        if r.get("ld_preload") and r["tensors_exact"] < r["tensors_total"]:
            blas = (f" Same-input tensors {r['tensors_exact']}/{r['tensors_total']} exact (max {r['max_ulp']:,} ULP): "
                    "with OpenBLAS preloaded, an fp32 product's rows round differently with the number of rows "
                    f"multiplied, so blocks of {BLOCK_TOKENS} differ from a native prefill in chunks of "
                    f"{SAME_INPUT_STEP}; under the reference BLAS the same check on Gemma 3 270M is exact (BENCHMARKS.md).")
        out += (f"\n{r['family']} ({r['cache_dtype']}): {r['prompts']} prompts of {lengths} tokens "
                f"({', '.join(r['sources'])}; "
                f"{'chat' if r['chat'] else 'plain completions'}); "
                f"first token {r['first_token_agreement']:.2f}, greedy 32 {r['greedy32_agreement']:.2f}, "
                f"front-door text {r['front_door_text_agreement']:.2f}, KL mean {r['kl_mean']:.1e} (max "
                f"{r['kl_max']:.1e}){against}. Payload {r['payload_bytes_per_token']:,.0f} bytes/token. TTFT native / "
                f"bridged by prompt length: {ttft}.{blas}\n")
    return out


ROUTES = """
## Routes: which caches come from vLLM's own K/V

prefilld makes the decoder's cache one of two ways (`engine.route`; the verdict's `route` says
which served a request):
- `kv` (the default on CUDA where it qualifies): vLLM's own paged K/V laid out as the decoder's
  cache; nothing is recomputed and no MLX runs on the prefill box. A layer qualifies when its cache
  holds what vLLM's paged cache holds, post-RoPE keys and values per token from the same weights:
  `KVCache` (smollm2, llama3, qwen3, the global layers of gemma3 and gpt_oss), `RotatingKVCache`
  (sliding windows: gemma3, gpt_oss; a step's rows are read as vLLM writes them, before it frees a
  window's blocks), `QuantizedKVCache` (the same rows quantized on the prefill GPU exactly as
  `mx.quantize` does on the decoder's MLX device). Not: a latent cache (deepseek_v3's MLA: vLLM
  keeps the latent and the rope part in its own layout, fp8 on GPUs), recurrent states
  (qwen3_next), DeepSeek-V4.1's window and pools: those take `reconstruct`, and a prefilld started
  for `kv` refuses them at the first prefill (`unsupported_model`, naming the layer). Not
  bit-exact: vLLM's projections sum in another order than MLX's (within 7.6e-6 relative of the
  decoder's native cache on the test model in fp32).
- `reconstruct`: the decoder's own mlx-lm modules over captured layer inputs; every kind above;
  bit-exact with the decoder on the same backend (the CPU rows of the table).
"""


def write_models_md(results: dict) -> None:
    text = f"""# Supported models

Generated by `bench/models.sh` from [`bench/results/models.json`](bench/results/models.json)
({results['generated']}, {results['wall_s']:.0f} s of runs on this machine's CPUs). Every row ran end to end
through both daemons on real vLLM-CPU and mlx-lm; how each column is measured is in `bench/models.py`.
`smollm2` is the real SmolLM2-135M-Instruct; `gemma3_270m` the real Gemma 3 270M (a base model, given
plain prompts) and `qwen2_5_coder_1_5b` the real Qwen2.5-Coder-1.5B-Instruct, their published GGUF
files dequantized (`scripts/prepare-gguf-model.py`), asked about licenses, changelogs and source code
of 1K-8K tokens (the notes below the table). The other rows are tiny checkpoints with random weights
that `scripts/make-tiny-model.py` generates deterministically, so agreement there measures the
bridge's arithmetic, not answer quality. Agreement and KL compare the bridged answer with the
decoder's native one on the same prompts. The prefill engine runs fp32 (bf16 for deepseek_v3 and
qwen3_next, which vLLM-CPU runs in nothing else; their decoder is fp32; deepseek_v41 on the
plugin's own torch class, vLLM-CPU having none), so a decoder in bf16 (or
with a quantized KV cache) caches values computed from more precise activations than its own native
prefill's; the last column compares both with the same weights in fp32 (native, KV not quantized):
where the two columns agree, the decoder's own rounding, not the bridge, is what flips a token.

{support_table(results['rows'])}
A model whose cache the decoder cannot hand over (a layer class without a codec in
`common/engine/pdbridge_cache/kinds.py`) is refused at the handshake: verdict `native`, reason
`unsupported_model`, naming the layer and why. Not bridged yet: DeepSeek-V4 (not V4.1: mlx-lm has
no model for it), and the families whose rows are missing above.
{ROUTES}{pooled_note(results['rows'])}{real_note(results['rows'])}"""
    (ROOT / "MODELS.md").write_text(text)
