#!/usr/bin/env python3
"""The cost model's bridge policy (`front.policy = "cost"`) against always-native and always-bridge.

Every row starts fresh daemons on the generated Llama 3: one prefilld and two decoders sharing it.
Decoder `policy` runs the cost policy and learns only from its own answers, after a calibration
(one native and one bridged prompt per length, as an operator's warm-up would send). Decoder
`reference` runs the threshold policy and answers every measured prompt natively and bridged
(`X-PD-Bridge-Mode`), one after the other, so the three ways see the same box.

  idle       nothing else runs.
  loaded     --load bridges of long prompts stay in flight through the policy decoder (its own
             traffic: its front door counts them) while every prompt is measured.
  slow_link  prefilld's link to the decoders emulated at --slow-gbps.

Per length (--lengths) and repeat (--repeats): three cold prompts of real text (a unique tag each,
so neither store nor vLLM's prefix cache holds them): TTFT native and bridged on `reference`, then
TTFT, choice and prediction of `policy`. Per row: the share the policy bridged, its mean TTFT
against the better of always-native and always-bridge (goal when loaded or slow: at most 10 %
worse; idle: it bridges what the threshold bridges), the same for its choices as `reference`
measured them (under load the policy decoder also answers the load), and the prediction error, |predicted -
measured| / measured from the decision (TTFT less tokenizing), for the way it chose and the way it
did not (measured on `reference`; goal: p50 <= 20 %).

    bench/policy.sh [--lengths 512,1024,2048,4096] [--repeats 3] [--load 2] [--slow-gbps 0.01]

Writes bench/results/policy.json; prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import zlib

# bench/'s own modules: Python puts a script's folder first on its path.
from daemons import ROOT, Topology
from front_door import Client, EngineLog, Prompts, messages_for, timed
from runs import log, run_rows

MODEL = "tiny-llama3"
MAX_TOKENS = 8
MAX_LEN = 8192
LOAD_CHARS = 14000
POLICY = 'policy = "cost"\ncost_margin = 0.1'


class Load:
    """`width` threads, each bridging one fresh long prompt after another through `client` until
    stopped (X-PD-Bridge-Mode: bridge, one token each)."""

    def __init__(self, client: Client, text: str, tag: str, width: int):
        self.client, self.text, self.tag, self.stopped = client, text, tag, threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(width)]
        self.sent = 0

    def _run(self, thread: int) -> None:
        n = 0
        while not self.stopped.is_set():
            n += 1
            timed(self.client, EngineLog(None), load_prompt(self.text, f"{self.tag} {thread} {n}"), "bridge", 1)
            self.sent += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        for t in self.threads:
            t.join()


def load_prompt(text: str, tag: str) -> dict:
    """A cold prompt of about LOAD_CHARS characters of real text (not sized in tokens: it only
    keeps the prefill box busy)."""
    start = zlib.crc32(tag.encode()) % (len(text) - LOAD_CHARS)
    return {"tag": tag, "messages": messages_for(f"load {tag}", text[start:start + LOAD_CHARS]), "prompt_tokens": 0}


def calibrate(client: Client, prompts: Prompts, lengths: list[int]) -> None:
    for length in lengths:
        for mode in ("native", "bridge"):
            row = timed(client, EngineLog(None), prompts.make(length), mode, MAX_TOKENS)
            if row["error"]:
                raise SystemExit(f"calibration failed: {row['error']}")


def from_decision_ms(row: dict) -> float:
    tokenize = ((row["verdict"] or {}).get("timings_ms") or {}).get("tokenize", 0.0)
    return row["ttft_s"] * 1e3 - tokenize


def measure(clients: dict, prompts: dict, length: int) -> dict:
    native = timed(clients["reference"], EngineLog(None), prompts["reference"].make(length), "native", MAX_TOKENS)
    bridged = timed(clients["reference"], EngineLog(None), prompts["reference"].make(length), "bridge", MAX_TOKENS)
    chosen = timed(clients["policy"], EngineLog(None), prompts["policy"].make(length), "auto", MAX_TOKENS)
    verdict = chosen["verdict"] or {}
    prediction = verdict.get("prediction_ms")
    way = "bridge" if verdict.get("outcome") == "bridged" else "here"
    record = {
        "prompt_tokens": chosen["prompt_tokens"], "outcome": verdict.get("outcome"), "reason": verdict.get("reason"),
        "native_ttft_s": native["ttft_s"], "bridge_ttft_s": bridged["ttft_s"], "policy_ttft_s": chosen["ttft_s"],
        "prediction_ms": prediction,
        "errors": [r["error"] for r in (native, bridged, chosen) if r["error"]],
    }
    if prediction:
        other = bridged if way == "here" else native
        record["error_chosen"] = abs(prediction[f"{way}_ms"] - from_decision_ms(chosen)) / from_decision_ms(chosen)
        other_way = "bridge" if way == "here" else "here"
        record["error_other"] = abs(prediction[f"{other_way}_ms"] - from_decision_ms(other)) / from_decision_ms(other)
    return record


def run_row(name: str, args, text: str) -> dict:
    stream = f"link_gbps = {args.slow_gbps}" if name == "slow_link" else ""
    topology = Topology(MODEL, f"var/bench-policy/{name}", MAX_LEN, decoders=(256, 256), fronts=(POLICY, ""),
                        stream=stream)
    with topology:
        clients = {"policy": Client(topology.front_url(0)), "reference": Client(topology.front_url(1))}
        prompts = {role: Prompts(client, text, f"policy {name} {role}") for role, client in clients.items()}
        calibrate(clients["policy"], prompts["policy"], args.lengths)
        load = None
        if name == "loaded":
            load = Load(clients["policy"], text, name, args.load)
        records = []
        with load or contextlib.nullcontext():
            for repeat in range(args.repeats):
                for length in args.lengths:
                    records.append(measure(clients, prompts, length))
                    r = records[-1]
                    log(f"  {name} {length}: native {r['native_ttft_s']:.2f} s, bridge {r['bridge_ttft_s']:.2f} s, "
                        f"policy {r['policy_ttft_s']:.2f} s ({r['outcome']}, {r['reason']}), "
                        f"predicted {r['prediction_ms']}")
    return summary(name, records, load.sent if load else 0)


def summary(name: str, records: list[dict], load_sent: int) -> dict:
    mean = lambda key: statistics.mean(r[key] for r in records)  # noqa: E731
    native, bridge, policy = mean("native_ttft_s"), mean("bridge_ttft_s"), mean("policy_ttft_s")
    chosen = [r["error_chosen"] for r in records if "error_chosen" in r]
    other = [r["error_other"] for r in records if "error_other" in r]
    return {
        "row": name,
        "prompts": len(records),
        "errors": sum(len(r["errors"]) for r in records),
        "load_bridges_sent": load_sent,
        "bridged_share": round(sum(r["outcome"] == "bridged" for r in records) / len(records), 3),
        "mean_ttft_s": {"always_native": round(native, 3), "always_bridge": round(bridge, 3),
                        "policy": round(policy, 3)},
        "policy_over_better": round(policy / min(native, bridge), 3),
        # The policy decoder also serves the load's answers; its choices as the reference decoder
        # measured them tell the decisions apart from that.
        "choices_on_reference_over_better": round(
            statistics.mean(r["bridge_ttft_s" if r["outcome"] == "bridged" else "native_ttft_s"] for r in records)
            / min(native, bridge), 3),
        "prediction_error_p50": {"chosen": round(statistics.median(chosen), 3) if chosen else None,
                                 "other": round(statistics.median(other), 3) if other else None},
        "records": records,
    }


def table(rows: list[dict]) -> str:
    out = ["| row | bridged share | mean TTFT native / bridge / policy | policy over the better | "
           "its choices on the reference | prediction error p50 (chosen / other) |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        t, e = r["mean_ttft_s"], r["prediction_error_p50"]
        pct = lambda x: "-" if x is None else f"{100 * x:.0f} %"  # noqa: E731
        out.append(f"| {r['row']} | {r['bridged_share']:.2f} | {t['always_native']:.2f} / {t['always_bridge']:.2f} / "
                   f"{t['policy']:.2f} s | {r['policy_over_better']:.2f} | {r['choices_on_reference_over_better']:.2f} | "
                   f"{pct(e['chosen'])} / {pct(e['other'])} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--load", type=int, default=2)
    p.add_argument("--slow-gbps", type=float, default=0.01)
    p.add_argument("--rows", default="idle,loaded,slow_link")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "policy.json"))
    args = p.parse_args()
    setup = {"model": MODEL, "lengths": args.lengths, "repeats": args.repeats, "load": args.load,
             "load_prompt_chars": LOAD_CHARS, "slow_link_gbps": args.slow_gbps, "max_tokens": MAX_TOKENS,
             "policy_config": POLICY, "block_tokens": 256, "min_bridge_tokens": 256}
    rows = run_rows("pd-bridge's cost policy against always-native and always-bridge (bench/policy.py)",
                    args.rows.split(","), lambda name, text: run_row(name, args, text), setup, args.out)
    print(table(rows))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
