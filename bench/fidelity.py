#!/usr/bin/env python3
"""Fidelity of the bridge (issue 4): is the bridged cache the decoder's own cache?

In-process, real engines, no daemons: the vLLM server with the plugin and a socket receiver
(`pdbridge_testkit.prefill`), mlx-lm for the decoder (decoded's adapter `Engine`), HF
transformers for the plain-transfer baseline. One command:

    bench/fidelity.sh [--n 20] [--lengths 1024,2048,...] [--budget-s 1500]

Writes bench/results/fidelity.json and bench/results/fidelity.md.

1. same-input exactness: the decoder's own per-layer attention inputs (captured from an mlx-lm
   prefill) → the plugin's cache path (`pdbridge_vllm.reconstruct.load`), block by block at each block's offset → compared
   with the decoder's native cache: bit-exact tensors, exact-element fraction, max ulp, max abs/rel.
2. chunk independence: one prompt bridged by vLLM at `--max-num-batched-tokens 256` and at the
   default (4096 on CPU): are the reconstructed blocks byte-identical?
3. store round trip: the adapter's `export` of the decoder's native cache → block files → the
   adapter's `restore` → generation; first-token log-probabilities and 32 greedy tokens compared
   bit for bit with generating from the in-memory native cache.
4. end to end over real texts (license texts from the environment's dist-info folders and the
   repo's LICENSE): native (decoder prefills the prompt itself) vs bridged (whole blocks from the
   plugin, the decoder prefills the tail) vs baseline (whole blocks = the prefill side's own K/V,
   recomputed with HF transformers fp32 torch math on the prefill engine's weights, plain layout
   copy, no reconstruction): first token, 32 greedy tokens, KL(native ‖ x) of the first next-token
   distribution.

The decoder's native prefill (4-bit MLX on x86, scalar qmm, ~14 tok/s) bounds how many and how
long the texts can be: prompts run shortest first and stop when `--budget-s` is spent; the JSON
says exactly which ran.
The engines are in `fidelity_engines.py`, what the items share in `fidelity_common.py`, item 2's
probes in `fidelity_chunking.py`, the summary, explanations and fidelity.md in `fidelity_report.py`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fidelity_chunking import chunking_probes, probe_chunking_into
from fidelity_common import (ROOT, B, GREEDY, T0, TAIL, blocks_to_kv, cache_np, compare, kl, load_blocks,
                             load_blocks_safetensors, log, real_texts, summarize)
from fidelity_engines import Decoder, TorchPrefill, vllm_blocks
from fidelity_report import explain, markdown, summarize_e2e
from pdbridge_testkit import NUM_LAYERS


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20, help="texts for the end-to-end comparison")
    ap.add_argument("--min-tokens", type=int, default=1024, help="shortest text admitted")
    ap.add_argument("--lengths", default="1024,2048,3072,4096,5120,6144",
                    help="prompt i gets lengths[i %% len] tokens rounded up to whole blocks, "
                         f"+ {TAIL} tail tokens (fewer blocks if its text is shorter)")
    ap.add_argument("--probe-tokens", type=int, default=2 * B + TAIL,
                    help="prompt of items 1-3 (and the dense check)")
    ap.add_argument("--budget-s", type=float, default=3600,
                    help="stop starting end-to-end prompts once this much time has passed")
    ap.add_argument("--no-vllm", action="store_true", help="items 1 and 3 only (smoke test)")
    ap.add_argument("--probe-chunking", action="store_true",
                    help="rerun only item 2's probes (where chunk dependence comes from) into an existing "
                         "fidelity.json and rewrite its explanations")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    if args.probe_chunking:
        return probe_chunking_into(Path(args.out))
    # SIGTERM (a timeout, Ctrl-C's cousin) unwinds normally: vLLM is stopped, results written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="pdb-fidelity-"))
    result: dict = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "block_tokens": B, "notes": []}
    ok = False
    try:
        run_all(args, tmp, result)
        ok = True
    finally:
        result["wall_s"] = round(time.perf_counter() - T0, 1)
        result.pop("_files", None)
        try:
            explain(result)
        except Exception as e:  # never lose the measurements over a note
            result["notes"].append(f"explain failed: {e!r}")
        (out_dir / "fidelity.json").write_text(json.dumps(result, indent=2) + "\n")
        (out_dir / "fidelity.md").write_text(markdown(result))
        log(f"wrote {out_dir / 'fidelity.json'} and fidelity.md")
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # keep the vLLM logs to debug; drop the bulky payloads
            for f in tmp.glob("*.bin"):
                f.unlink()
            log(f"kept {tmp} (vLLM logs)")


def run_all(args, tmp: Path, R: dict):
    from pdbridge_vllm import reconstruct

    dec = Decoder(tmp)
    tok = dec.engine.tokenizer
    texts = real_texts()
    encoded = [(name, tok.encode(text)) for name, text in texts]
    log(f"{len(encoded)} distinct texts: tokens {sorted(len(t) for _, t in encoded)}")

    # The probe prompt (items 1-3, chunking, dense check): the repo's LICENSE.
    license_ids = next(ids for name, ids in encoded if name == "LICENSE")
    probe_ids = license_ids[: args.probe_tokens]
    # chunking: a longer prefix of the same text (4 blocks at 256 per step; one step by default)
    chunk_ids = license_ids[: min(len(license_ids) - 1, 4 * B + TAIL)]
    # End-to-end prompts: the longest texts first get the largest lengths; length n*B + TAIL.
    pool = sorted((x for x in encoded if len(x[1]) >= args.min_tokens), key=lambda x: -len(x[1]))
    chosen = pool[: args.n]
    e2e: dict[str, list[int]] = {}
    for i, (name, ids) in enumerate(chosen):
        target = int(args.lengths.split(",")[i % len(args.lengths.split(","))])
        n = min((len(ids) - TAIL) // B, -(-target // B))  # target rounded up to whole blocks
        e2e[f"p{i:02d}"] = ids[: n * B + TAIL]
        R.setdefault("texts", {})[f"p{i:02d}"] = {"source": name, "text_tokens": len(ids),
                                                  "prompt_tokens": n * B + TAIL}
    order = sorted(e2e, key=lambda k: len(e2e[k]))  # shortest first: most prompts per budget

    # ---- items 1 and 3 (+ native reference of the probe): the decoder alone
    log(f"probe: {len(probe_ids)} tokens, native 4-bit prefill with layer-input capture")
    inputs: list = []
    native_probe = dec.run(dec.q4, probe_ids, capture=inputs)
    rate_q4 = len(probe_ids) / native_probe["prefill_s"]
    log(f"native probe prefill {native_probe['prefill_s']:.1f} s ({rate_q4:.1f} tok/s)")
    L = NUM_LAYERS
    calls = len(inputs) // L
    hidden, covered = [], 0
    for c in range(calls):  # prompt calls only (the prefill chunk(s) + the last prompt token)
        if covered >= len(probe_ids):
            break
        per_layer = [np.array(inputs[c * L + l][0]) for l in range(L)]
        hidden.append(np.stack(per_layer, axis=1))
        covered += per_layer[0].shape[0]
    hidden = np.concatenate(hidden, axis=0)  # [T, L, hidden]
    del inputs
    nb = (len(probe_ids) - 1) // B
    native_kv = cache_np(native_probe["cache"], nb * B)
    path = reconstruct.load(str(dec.engine.bundle_path), dec.engine.bundle_sha256)
    stats1 = []
    for b in range(nb):
        for layer, name, arr in path.block(np.ascontiguousarray(hidden[b * B:(b + 1) * B]), offset=b * B):
            ref = native_kv[layer][("keys", "values").index(name)][:, :, b * B:(b + 1) * B, :]
            stats1.append(compare(np.asarray(arr), ref))
    s1 = summarize(stats1)
    R["same_input"] = {"prompt_tokens": len(probe_ids), "blocks": nb, **s1}
    R.update({k: s1[k] for k in ("tensors_exact", "tensors_total", "min_exact_fraction", "max_ulp")})
    log(f"item 1: {s1['tensors_exact']}/{s1['tensors_total']} tensors bit-exact, max ulp {s1['max_ulp']}")

    # item 3: the adapter's export → block files → the adapter's restore → generation
    from pdbridge_testkit.decoder import export_blocks

    exported_files = export_blocks(dec.engine, probe_ids, tmp / "export")
    rt = dec.run(dec.q4, probe_ids, block_files=exported_files)
    same_lp = bool(np.array_equal(rt["logprobs"].view(np.uint32), native_probe["logprobs"].view(np.uint32)))
    exported = load_blocks_safetensors(exported_files)
    files_exact = all(np.array_equal(exported[l][j].view(np.uint32), native_kv[l][j].view(np.uint32))
                      for l in range(L) for j in (0, 1))
    R["roundtrip"] = {"prompt_tokens": len(probe_ids), "blocks": len(exported_files),
                      "restored_tokens": rt["cached"], "block_files_equal_native_cache": files_exact,
                      "first_logprobs_bit_identical": same_lp,
                      "greedy_tokens_identical": rt["tokens"] == native_probe["tokens"],
                      "greedy_tokens": len(rt["tokens"])}
    R["roundtrip_identical"] = bool(same_lp and files_exact and rt["tokens"] == native_probe["tokens"])
    log(f"item 3: roundtrip identical {R['roundtrip_identical']} ({R['roundtrip']})")

    # ---- dense check: is the dequantized fp32 decoder (netlib sgemm) bit-identical to 4-bit?
    try:
        dense_check = dense_probe(dec, probe_ids, native_probe)
    except Exception as e:  # the dense twin is an optimization; the run goes on 4-bit
        dense_check = {"error": repr(e)}
    rate_q4 = len(probe_ids) / native_probe["prefill_s"]
    R["dense_check"] = dense_check
    R["decoder_model"] = dec.model_kind
    log(f"dense check {dense_check}; decoder = {dec.model_kind}")
    if args.no_vllm:
        return
    run_bridge(args, tmp, R, dec, e2e, order, probe_ids, chunk_ids, native_kv, nb, rate_q4)


def dense_probe(dec, probe_ids, native_probe) -> dict:
    dense = dec.dense_twin()
    rate_dense64, rate_q4_64 = dec.forward_rate(dense), dec.forward_rate(dec.q4)
    dense_check = {"rate_q4_tok_s_64": round(rate_q4_64, 1), "rate_dense_tok_s_64": round(rate_dense64, 1)}
    if rate_dense64 > 1.3 * rate_q4_64:
        d = dec.run(dense, probe_ids)
        ident = bool(np.array_equal(d["logprobs"].view(np.uint32), native_probe["logprobs"].view(np.uint32))
                     and d["tokens"] == native_probe["tokens"])
        dense_check.update({"first_logprobs_and_greedy_identical_to_4bit": ident,
                            "max_abs_logprob_diff": float(np.abs(d["logprobs"] - native_probe["logprobs"]).max()),
                            "prefill_tok_s": round(len(probe_ids) / d["prefill_s"], 1)})
        if ident:
            dec.model, dec.model_kind = dense, ("mlx dense fp32 (k-bit weights dequantized by "
                                                "mx.dequantize; bit-identical to 4-bit on the probe)")
    else:
        dense_check["used"] = False
        dense_check["why"] = "dense fp32 (netlib sgemm) not faster than 4-bit qmm here: stayed 4-bit"
        del dense
    return dense_check


def run_bridge(args, tmp, R, dec, e2e, order, probe_ids, chunk_ids, native_kv, nb, rate_q4):
    import mlx.core as mx

    L = NUM_LAYERS
    dense_check = R["dense_check"]
    # ---- vLLM: chunk 256 (probe only), then default chunking (probe + all e2e prompts)
    bundle_path, sha = str(dec.engine.bundle_path), dec.engine.bundle_sha256
    # Only the prompts the budget can take (native decoder prefill dominates): shortest first.
    rate = dense_check.get("prefill_tok_s", rate_q4) if dec.model is not dec.q4 else rate_q4
    left = args.budget_s - (time.perf_counter() - T0) - 240  # two vLLM starts + chunk prompt
    keep = []
    for name in order:
        left -= len(e2e[name]) / rate + 40 + len(e2e[name]) / 150
        if left < 0:
            break
        keep.append(name)
    if len(keep) < len(order):
        R["notes"].append(f"budget: {len(keep)} of {len(order)} selected prompts run (native decoder "
                          f"prefill at {rate:.1f} tok/s); skipped {[len(e2e[k]) for k in order[len(keep):]]} tokens")
    order = keep
    e2e = {k: e2e[k] for k in keep}
    for k in list(R.get("texts", {})):
        if k not in e2e:
            R["texts"].pop(k)
    log(f"end-to-end prompts: {[(k, len(e2e[k])) for k in order]}")
    v256 = vllm_blocks(tmp, {"probe": chunk_ids}, bundle_path, sha,
                       ["--max-num-batched-tokens", "256"], "chunk256")
    vdef = vllm_blocks(tmp, {"probe": chunk_ids, **e2e}, bundle_path, sha, [], "default")
    R["_files"] = {k: v["files"] for k, v in vdef["prompts"].items()}
    R["vllm"] = {"startup_s": [v256["startup_s"], vdef["startup_s"]],
                 "post_to_done_s": {k: v["post_to_done_s"] for k, v in vdef["prompts"].items()}}
    a, b = load_blocks(v256["prompts"]["probe"]["files"]), load_blocks(vdef["prompts"]["probe"]["files"])
    chunk = [compare(x[k], y[k]) for x, y in zip(a, b) for k in x]
    per_block = [{"block": i, "byte_identical": Path(fa).read_bytes() == Path(fb).read_bytes()}
                 for i, (fa, fb) in enumerate(zip(v256["prompts"]["probe"]["files"],
                                                  vdef["prompts"]["probe"]["files"]))]
    sc = summarize(chunk)
    R["chunk_independent"] = bool(sc["tensors_exact"] == sc["tensors_total"])
    R["chunking"] = {"prompt_tokens": len(chunk_ids), "settings": ["--max-num-batched-tokens 256",
                     "default (4096 on CPU: the prompt in one step)"], "blocks": per_block, **sc}
    if not R["chunk_independent"]:
        R["chunking"]["probes"] = chunking_probes(tmp, bundle_path, sha, chunk_ids)
    # the probe's bridged blocks vs the decoder's native cache (vLLM's hidden states)
    bridged_probe = blocks_to_kv(b[:nb])
    sb = summarize([compare(bridged_probe[l][j], native_kv[l][j]) for l in range(L) for j in (0, 1)])
    R["bridged_vs_native_kv_probe"] = sb
    log(f"item 2: chunk independent {R['chunk_independent']} ({sc['max_rel']:.2e} max rel); "
        f"bridged vs native K/V: {sb['tensors_exact']}/{sb['tensors_total']} exact, max rel {sb['max_rel']:.2e}")

    # ---- item 4: end to end
    torch_pf = TorchPrefill()
    rows = []
    deadline = args.budget_s
    for name in order:
        tokens = e2e[name]
        n = (len(tokens) - 1) // B
        est = len(tokens) / rate + 3 * 10 + len(tokens) / 200
        left = deadline - (time.perf_counter() - T0)
        if est > left:
            R["notes"].append(f"{name} ({len(tokens)} tokens) and longer skipped: budget "
                              f"({left:.0f} s left, ~{est:.0f} s needed)")
            log(R["notes"][-1])
            break
        t0 = time.perf_counter()
        try:
            rows.append(e2e_row(dec, torch_pf, R, name, tokens, n))
        except Exception as e:
            R["notes"].append(f"{name}: failed: {e!r}")
            log(R["notes"][-1])
            continue
        row = rows[-1]
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        log(f"{name} {len(tokens)} tok: native {row['native_prefill_s']} s; bridged first "
            f"{row['bridged']['first_token_agrees']} g32 {row['bridged']['greedy_matched_prefix']} "
            f"KL {row['bridged']['kl']:.2e} | baseline first {row['baseline']['first_token_agrees']} "
            f"g32 {row['baseline']['greedy_matched_prefix']} KL {row['baseline']['kl']:.2e}")
        summarize_e2e(R, rows)  # keep the summary current if the run is cut short
        mx.clear_cache()
    summarize_e2e(R, rows)


def e2e_row(dec, torch_pf, R, name, tokens, n) -> dict:
    L = NUM_LAYERS
    nat = dec.run(dec.model, tokens)
    nkv = cache_np(nat["cache"], n * B)
    nat["cache"] = None
    bkv = blocks_to_kv(load_blocks(R["_files"][name]))
    br = dec.run(dec.model, tokens, cache_kv=bkv)
    tkv = torch_pf.kv(tokens[: n * B])
    bl = dec.run(dec.model, tokens, cache_kv=tkv)
    kv_b = summarize([compare(bkv[l][j], nkv[l][j]) for l in range(L) for j in (0, 1)])
    kv_t = summarize([compare(tkv[l][j], nkv[l][j]) for l in range(L) for j in (0, 1)])

    def agree(x):
        m = 0
        while m < GREEDY and x["tokens"][m] == nat["tokens"][m]:
            m += 1
        return m

    row = {"prompt": name, "source": R["texts"][name]["source"], "tokens": len(tokens),
           "bridged_tokens": n * B,
           "native_prefill_s": round(nat["prefill_s"], 1),
           "first_token_native": nat["tokens"][0],
           "bridged": {"first_token_agrees": br["tokens"][0] == nat["tokens"][0],
                       "greedy32_identical": br["tokens"] == nat["tokens"],
                       "greedy_matched_prefix": agree(br),
                       "kl": kl(nat["logprobs"], br["logprobs"]),
                       "logprobs_bit_identical": bool(np.array_equal(br["logprobs"].view(np.uint32),
                                                                     nat["logprobs"].view(np.uint32))),
                       "max_abs_logprob_diff": float(np.abs(br["logprobs"] - nat["logprobs"]).max()),
                       "kv": kv_b},
           "baseline": {"first_token_agrees": bl["tokens"][0] == nat["tokens"][0],
                        "greedy32_identical": bl["tokens"] == nat["tokens"],
                        "greedy_matched_prefix": agree(bl),
                        "kl": kl(nat["logprobs"], bl["logprobs"]),
                        "max_abs_logprob_diff": float(np.abs(bl["logprobs"] - nat["logprobs"]).max()),
                        "kv": kv_t},
           }
    return row


if __name__ == "__main__":
    main()
