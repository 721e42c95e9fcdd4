#!/usr/bin/env python3
"""Several Macs sharing their stores (issue 32): a multi-user, multi-turn chat trace replayed over
two decoders, with and without `[[front.peers]]`.

Every user has a document (real text of about --doc-tokens, a unique tag) and --turns questions;
turn k's chat is the document, every earlier question and answer, and the k-th question. The turns
go out user after user, turn after turn, each to a decoder drawn from a fixed seed (a load balancer
without affinity): the same trace in both runs. Each run starts fresh daemons (one prefilld, two
decoders of one spec, empty stores); in the `peers` run each decoder lists the other.

Per run: the store hit rate (the share of prompt tokens served from blocks a store held before the
request), the requests a peer served, the bytes bridged, and TTFT (streamed, to the first content
chunk) over the follow-up turns and over all.

    bench/peers.sh [--users 4] [--turns 3] [--doc-tokens 1024] [--seed 7]

Writes bench/results/peers.json; prints a markdown table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

# bench/'s own modules: Python puts a script's folder first on its path.
from daemons import ROOT, Topology
from front_door import Client, EngineLog, Prompts, timed
from runs import log, run_rows

MODEL = "tiny-llama3"
MAX_TOKENS = 16
MAX_LEN = 8192
QUESTIONS = [
    "In one sentence: what does the text above grant?",
    "Which condition does it set first?",
    "Does it mention warranties? Answer briefly.",
    "Name one party the text refers to.",
    "Quote its shortest sentence.",
]


def trace(users: int, turns: int, seed: int) -> list[tuple[int, int, int]]:
    """(user, turn, decoder) in the order they are sent."""
    draw = random.Random(seed)
    return [(u, t, draw.randrange(2)) for t in range(turns) for u in range(users)]


def held_tokens(verdict: dict) -> int:
    """Prompt tokens served from blocks the serving store held before this request."""
    pushed = verdict.get("blocks", 0) * verdict.get("block_tokens", 0) + verdict.get("tail_tokens", 0)
    return max(verdict.get("cached_tokens", 0) - pushed, 0)


def replay(name: str, args, text: str) -> dict:
    steps = trace(args.users, args.turns, args.seed)
    topology = Topology(MODEL, f"var/bench-peers/{name}", MAX_LEN, decoders=(256, 256), peers=name == "peers")
    with topology:
        clients = [Client(topology.front_url(i)) for i in range(2)]
        documents = Prompts(clients[0], text, f"peers {name}")
        chats = [documents.make(args.doc_tokens)["messages"] for _ in range(args.users)]
        records = []
        for user, turn, decoder in steps:
            messages = chats[user]
            if turn > 0:
                messages.append({"role": "user", "content": QUESTIONS[(turn - 1) % len(QUESTIONS)]})
            prompt = {"tag": f"user {user} turn {turn}", "messages": messages,
                      "prompt_tokens": clients[decoder].tokenize(messages)[0]}
            row = timed(clients[decoder], EngineLog(None), prompt, "auto", MAX_TOKENS)
            verdict = row["verdict"] or {}
            messages.append({"role": "assistant", "content": row["text"]})
            records.append({
                "user": user, "turn": turn, "sent_to": f"decoded-{decoder}",
                "served_by": verdict.get("served_by", f"decoded-{decoder}"),
                "outcome": verdict.get("outcome"), "prompt_tokens": row["prompt_tokens"],
                "held_tokens": held_tokens(verdict), "bridged_bytes": verdict.get("bytes", 0),
                "ttft_s": row["ttft_s"], "error": row["error"],
            })
            r = records[-1]
            log(f"  {name}: user {user} turn {turn} -> {r['sent_to']}, served by {r['served_by']}, {r['outcome']}, "
                f"{r['held_tokens']}/{r['prompt_tokens']} held, TTFT {r['ttft_s']:.2f} s")
    return summary(name, records)


def summary(name: str, records: list[dict]) -> dict:
    follow_ups = [r for r in records if r["turn"] > 0]
    return {
        "run": name,
        "requests": len(records),
        "errors": sum(r["error"] is not None for r in records),
        "store_hit_rate": round(sum(r["held_tokens"] for r in records) / sum(r["prompt_tokens"] for r in records), 3),
        "follow_up_hit_rate": round(
            sum(r["held_tokens"] for r in follow_ups) / max(sum(r["prompt_tokens"] for r in follow_ups), 1), 3),
        "served_by_peer": sum(r["served_by"] != r["sent_to"] for r in records),
        "bridged_bytes": sum(r["bridged_bytes"] for r in records),
        "follow_up_ttft_s_median": round(statistics.median(r["ttft_s"] for r in follow_ups), 3),
        "follow_up_ttft_s_mean": round(statistics.mean(r["ttft_s"] for r in follow_ups), 3),
        "ttft_s_mean": round(statistics.mean(r["ttft_s"] for r in records), 3),
        "requests_by_turn": records,
    }


def table(runs: list[dict]) -> str:
    out = ["| run | store hit rate | follow-ups' hit rate | served by a peer | bytes bridged | "
           "follow-up TTFT median / mean | TTFT mean |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        out.append(f"| {r['run']} | {r['store_hit_rate']:.2f} | {r['follow_up_hit_rate']:.2f} | "
                   f"{r['served_by_peer']} of {r['requests']} | {r['bridged_bytes'] / 1e6:.1f} MB | "
                   f"{r['follow_up_ttft_s_median']:.2f} / {r['follow_up_ttft_s_mean']:.2f} s | {r['ttft_s_mean']:.2f} s |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "peers.json"))
    args = p.parse_args()
    setup = {"model": MODEL, "users": args.users, "turns": args.turns, "doc_tokens": args.doc_tokens,
             "seed": args.seed, "trace": trace(args.users, args.turns, args.seed), "max_tokens": MAX_TOKENS,
             "temperature": 0, "stream": True, "block_tokens": 256, "min_bridge_tokens": 256}
    rows = run_rows("pd-bridge decoders sharing their stores (bench/peers.py)", ["alone", "peers"],
                    lambda name, text: replay(name, args, text), setup, args.out)
    print(table(rows))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
