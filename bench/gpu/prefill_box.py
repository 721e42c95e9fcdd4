#!/usr/bin/env python3
"""The prefill box at real shape: vLLM's own prefill vs the bridged prefill box on the same token ids.

    bridged  with both daemons running (bench/gpu/kit.sh remote start, on bench/gpu/llama8b.py's
             model): per length one cold prompt of real text (bench/bridge.py's corpus and sizing,
             through decoded's tokenizer), bridged with `pdbridge warm --json`: prefilld's Prefill
             RPC, i.e. vLLM's prefill with the capture, the reconstruction on MLX, framing and the
             Push into decoded's store on loopback, until the last block is committed. Writes
             OUT/prompts.json (the token ids) and OUT/bridged.json (seconds, bytes, stage ms).
    native   with the daemons stopped: vLLM alone (its defaults: CUDA graphs, compile, no plugin),
             the same token ids, max_tokens 1, prefix caching off, after a warm-up. OUT/native.json.

Both on one GPU one after the other; ratio = native s / bridged s, the share of vLLM's prefill
throughput the bridged box keeps.

Usage: PYTHONPATH=bench .venv/bin/python bench/gpu/prefill_box.py bridged --lengths 8192,32768,131072 --out DIR
       PYTHONPATH=bench .venv/bin/python bench/gpu/prefill_box.py native --prompts DIR/prompts.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path

from bridge import Client, Prompts, corpus  # bench/bridge.py (PYTHONPATH=bench)

ROOT = Path(__file__).resolve().parents[2]
WARM_UP_TOKENS = 2048


def warm(content: str, scratch: Path, front: str) -> dict:
    """One `pdbridge warm --json` of a chat whose user message is `content`."""
    doc = scratch / "prompt.txt"
    doc.write_text(content)
    certs = ROOT / "var/certs"
    command = [str(ROOT / "target/release/pdbridge"), "warm", "--json", f"--file={doc}", f"--front={front}",
               "--prefilld=https://127.0.0.1:7071", f"--ca={certs / 'ca.pem'}", f"--cert={certs / 'mac-1.pem'}",
               f"--key={certs / 'mac-1.key'}", "--prefilld-name=prefill-1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"pdbridge warm failed: {done.stdout}{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bridged(args: argparse.Namespace) -> None:
    lengths = [int(n) for n in args.lengths.split(",")]
    client = Client(args.front)
    text = corpus()
    text *= math.ceil(max(lengths) * 6 / len(text)) + 1  # room for the longest prompt's window
    prompts = Prompts(client, text, time.strftime("%Y%m%dT%H%M%S"))
    rows, ids = [], {}
    for target in [WARM_UP_TOKENS, *lengths]:  # the first pays the engines' first-request costs
        prompt = prompts.make(target)
        with client.post("/pd/v1/tokenize", {"messages": prompt["messages"]}) as r:
            tokens = json.load(r)["tokens"]
        row = {"target": target, **warm(prompt["messages"][0]["content"], args.out, args.front)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        ids[str(target)] = tokens
    rows, ids = rows[1:], dict(list(ids.items())[1:])
    (args.out / "prompts.json").write_text(json.dumps(ids))
    (args.out / "bridged.json").write_text(json.dumps(rows, indent=2))


def native(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = json.loads(args.prompts.read_text())
    longest = max(len(t) for t in ids.values())
    llm = LLM(model=str(args.model), dtype="bfloat16", max_model_len=longest + 16, enable_prefix_caching=False,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.eager)
    once = SamplingParams(max_tokens=1, temperature=0, detokenize=False)  # ids past the tokenizer's: no text

    def prefill(tokens: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], once, use_tqdm=False)
        return time.perf_counter() - start

    prefill(next(iter(ids.values()))[:WARM_UP_TOKENS])
    rows = []
    for target, tokens in ids.items():
        seconds = sorted(prefill(tokens) for _ in range(args.repeats))
        rows.append({"target": int(target), "tokens": len(tokens), "seconds": seconds,
                     "median_s": seconds[len(seconds) // 2], "eager": args.eager})
        print(json.dumps(rows[-1]), flush=True)
    name = "native-eager.json" if args.eager else "native.json"
    (args.out / name).write_text(json.dumps(rows, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="phase", required=True)
    b = sub.add_parser("bridged")
    b.add_argument("--lengths", default="8192,32768,131072")
    b.add_argument("--front", default="http://127.0.0.1:8080")
    n = sub.add_parser("native")
    n.add_argument("--model", type=Path, default=Path("models/llama8b-hf"))
    n.add_argument("--prompts", type=Path, required=True, help="a bridged run's prompts.json")
    n.add_argument("--repeats", type=int, default=3)
    n.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    n.add_argument("--eager", action="store_true", help="--enforce-eager, as the capture route runs")
    for s in (b, n):
        s.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    {"bridged": bridged, "native": native}[args.phase](args)


if __name__ == "__main__":
    main()
