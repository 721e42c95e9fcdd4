#!/usr/bin/env python3
"""The prefill box at real shape: vLLM's own prefill vs the bridged prefill box on the same token ids.

    bridged  with both daemons running (bench/gpu/kit.sh remote start, on bench/gpu/llama8b.py's
             model): per length --repeats cold prompts of real text (bench/corpora.py's corpus, bench/front_door.py's sizing,
             through decoded's tokenizer), bridged with `pdbridge warm --json`: prefilld's Prefill
             RPC, i.e. vLLM's prefill with the capture, the reconstruction on MLX, framing and the
             Push into decoded's store on loopback, until the last block is committed. Writes
             OUT/prompts.json (the first prompt's token ids) and OUT/bridged.json (per length the
             median run's seconds, bytes and stage ms, and every run's seconds).
    native   with the daemons stopped: vLLM alone (its defaults: CUDA graphs, compile, no plugin),
             the same token ids, max_tokens 1, prefix caching off, after a warm-up. OUT/native.json;
             with --offload-gib N, vLLM storing every block through its own OffloadingConnector
             (the peer a K/V route must match), OUT/native-offload.json.

Both on one GPU one after the other. Per length two ratios: one cold prompt alone (native s /
bridged s: the transfer's tail after vLLM's answer counts in full), and the box's throughput
(--stream-tokens: about that many tokens of prompts submitted at once, tokens/s bridged over tokens/s
native: a prompt's transfer overlaps the next one's prefill, as on a busy box), the share of vLLM's
prefill throughput the bridged box keeps.

Usage: PYTHONPATH=bench .venv/bin/python bench/gpu/prefill_box.py bridged --lengths 8192,32768,131072 --out DIR
       PYTHONPATH=bench .venv/bin/python bench/gpu/prefill_box.py native --prompts DIR/prompts.json|--lengths N,.. \
                                                                 --out DIR
       PYTHONPATH=bench .venv/bin/python bench/gpu/prefill_box.py plot   (bench/results/gpu_e2e.json -> PNG)
       PYTHONPATH=bench .venv/bin/python bench/gpu/prefill_box.py plot-kept   (its kv_route rows -> PNG)
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path

from corpora import corpus  # bench/corpora.py (PYTHONPATH=bench)
from front_door import Client, Prompts  # bench/front_door.py

ROOT = Path(__file__).resolve().parents[2]
WARM_UP_TOKENS = 2048


def warm_command(content: str, doc: Path, front: str) -> list[str]:
    """`pdbridge warm --json` of a chat whose user message is `content` (written to `doc`)."""
    doc.write_text(content)
    certs = ROOT / "var/certs"
    return [str(ROOT / "target/release/pdbridge"), "warm", "--json", f"--file={doc}", f"--front={front}",
            "--prefilld=https://127.0.0.1:7071", f"--ca={certs / 'ca.pem'}", f"--cert={certs / 'mac-1.pem'}",
            f"--key={certs / 'mac-1.key'}", "--prefilld-name=prefill-1"]


def warm(content: str, scratch: Path, front: str) -> dict:
    """One `pdbridge warm --json` of a chat whose user message is `content`."""
    done = subprocess.run(warm_command(content, scratch / "prompt.txt", front), capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"pdbridge warm failed: {done.stdout}{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def stream_count(target: int, stream_tokens: int) -> int:
    """How many prompts of `target` tokens a throughput run takes: about `stream_tokens` in all."""
    return max(2, stream_tokens // target)


def warm_together(contents: list[str], scratch: Path, front: str, in_flight: int) -> dict:
    """The prompts bridged `in_flight` at a time (one `pdbridge warm` each; each holds
    stream.connections Push streams of the decoder's max_push_streams): the box's throughput, from
    the first submission until the last prompt's last block is committed."""
    start = time.perf_counter()
    waiting = list(enumerate(contents))
    running: list[subprocess.Popen] = []
    runs = []
    while waiting or running:
        while waiting and len(running) < in_flight:
            i, content = waiting.pop(0)
            running.append(subprocess.Popen(warm_command(content, scratch / f"stream-{i}.txt", front),
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        proc = running.pop(0)
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"pdbridge warm failed: {out}{err}")
        runs.append(json.loads(out.strip().splitlines()[-1]))
    seconds = time.perf_counter() - start
    tokens = sum(run["tokens"] for run in runs)
    return {"prompts": len(runs), "in_flight": in_flight, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "bridged": sum(run["outcome"] == "bridged" for run in runs)}


def bridged(args: argparse.Namespace) -> None:
    lengths = [int(n) for n in args.lengths.split(",")]
    client = Client(args.front)
    text = corpus()
    # Room for the longest prompt's window: Prompts asks for 1.6x its chars per token (~5 for
    # license text; a GPU box's few packages give a corpus of ~150K chars, too small for 128K tokens).
    text *= math.ceil(max(lengths) * 16 / len(text)) + 1
    prompts = Prompts(client, text, time.strftime("%Y%m%dT%H%M%S"))
    # The first bridge pays the engines' first-request costs: not a row.
    warm(prompts.make(WARM_UP_TOKENS)["messages"][0]["content"], args.out, args.front)
    rows, ids = [], {}
    for target in lengths:
        runs = []
        for _ in range(args.repeats):  # a new cold prompt each time: nothing of it is stored yet
            prompt = prompts.make(target)
            if not runs:
                with client.post("/pd/v1/tokenize", {"messages": prompt["messages"]}) as r:
                    ids[str(target)] = json.load(r)["tokens"]
            runs.append(warm(prompt["messages"][0]["content"], args.out, args.front))
        runs.sort(key=lambda run: run["seconds"])
        rows.append({"target": target, "runs_s": [run["seconds"] for run in runs], **runs[len(runs) // 2]})
        # After every part of a row: a run cut short (the device's time limit) keeps what it measured.
        (args.out / "prompts.json").write_text(json.dumps(ids))
        (args.out / "bridged.json").write_text(json.dumps(rows, indent=2))
        if args.stream_tokens:
            contents = [prompts.make(target)["messages"][0]["content"]
                        for _ in range(stream_count(target, args.stream_tokens))]
            rows[-1]["stream"] = warm_together(contents, args.out, args.front, args.in_flight)
            (args.out / "bridged.json").write_text(json.dumps(rows, indent=2))
        print(json.dumps(rows[-1]), flush=True)


def corpus_ids(model: Path, lengths: str) -> dict[str, list[int]]:
    """Per length, that many token ids of the corpus through the model's tokenizer (no chat template):
    vLLM alone, before any bridged run has made prompts."""
    from tokenizers import Tokenizer

    targets = [int(n) for n in lengths.split(",")]
    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(corpus()).ids
    ids *= math.ceil(max(targets) / len(ids))
    return {str(n): ids[:n] for n in targets}


def native(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = json.loads(args.prompts.read_text()) if args.prompts else corpus_ids(args.model, args.lengths)
    longest = max(len(t) for t in ids.values())
    # --offload-gib: vLLM's own OffloadingConnector stores every block to pinned host memory as it
    # prefills (the peer to beat); it keys blocks by prefix hashes, so prefix caching is on and
    # both caches are emptied before each prompt (no hit, every block stored again).
    offload = dict(kv_offloading_size=args.offload_gib, enable_prefix_caching=True) if args.offload_gib else \
        dict(enable_prefix_caching=False)
    llm = LLM(model=str(args.model), dtype="bfloat16", max_model_len=longest + 16,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.eager,
              tokenizer_mode=args.tokenizer_mode, **offload | json.loads(args.engine_args))
    once = SamplingParams(max_tokens=1, temperature=0, detokenize=False)  # ids past the tokenizer's: no text

    def prefill(tokens: list[int]) -> float:
        if args.offload_gib:
            llm.reset_prefix_cache(reset_connector=True)
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], once, use_tqdm=False)
        return time.perf_counter() - start

    def prefill_together(tokens: list[int], count: int) -> dict:
        # The same ids `count` times (prefix caching off, or both caches emptied: each computed).
        if args.offload_gib:
            llm.reset_prefix_cache(reset_connector=True)
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=tokens)] * count, once, use_tqdm=False)
        seconds = time.perf_counter() - start
        return {"prompts": count, "tokens": count * len(tokens), "seconds": seconds,
                "tokens_per_s": count * len(tokens) / seconds}

    prefill(next(iter(ids.values()))[:WARM_UP_TOKENS])
    rows = []
    for target, tokens in ids.items():
        seconds = sorted(prefill(tokens) for _ in range(args.repeats))
        rows.append({"target": int(target), "tokens": len(tokens), "seconds": seconds,
                     "median_s": seconds[len(seconds) // 2], "eager": args.eager, "offload_gib": args.offload_gib})
        if args.stream_tokens:
            rows[-1]["stream"] = prefill_together(tokens, stream_count(int(target), args.stream_tokens))
        print(json.dumps(rows[-1]), flush=True)
        name = "native" + ("-eager" if args.eager else "") + ("-offload" if args.offload_gib else "")
        (args.out / f"{name}.json").write_text(json.dumps(rows, indent=2))


# The bars of a length's group: vLLM alone, then each bridged setting of the results (by its prefix).
BARS = (("vLLM alone (eager)", None, (200, 50, 40)),
        ("bridged, before part 4", "before", (150, 150, 150)),
        ("bridged, host handoff", "decoder 4-bit; handoff host", (230, 150, 40)),
        ("bridged, device handoff", "decoder 4-bit (group 64)", (40, 90, 200)),
        ("bridged, device, dense decoder", "decoder dense", (30, 150, 60)))


def plot(args: argparse.Namespace) -> None:
    """Per length, vLLM alone and the bridged box's total time per setting, log scale, each
    bridged bar labelled with the share of vLLM's throughput it keeps."""
    from PIL import Image, ImageDraw, ImageFont

    box = json.loads(args.results.read_text())["prefill_box"]
    native = {r["prompt_tokens"]: r["native_vllm_s"] for r in box["rows"]}
    seconds: dict[tuple[int, str], float] = {}
    for name, prefix, _ in BARS[1:]:
        for r in box["before"] if prefix == "before" else box["rows"]:
            if prefix == "before" or r["setting"].startswith(prefix):
                seconds[r["prompt_tokens"], name] = r["bridged_prefill_box_s"]
    lengths = sorted(native)
    width, height, left, top, bottom = 980, 540, 80, 60, 120
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=13)
    low, high = 0.1, 10 ** math.ceil(math.log10(max(seconds.values()) * 1.5))

    def y(t: float) -> float:
        share = (math.log10(max(t, low)) - math.log10(low)) / (math.log10(high) - math.log10(low))
        return height - bottom - (height - top - bottom) * share

    decade = low
    while decade <= high:
        d.line([(left, y(decade)), (width - 20, y(decade))], fill=(220, 220, 220))
        d.text((left - 8, y(decade)), f"{decade:g} s", fill="black", font=font, anchor="rm")
        decade *= 10
    slot, bar = (width - left - 20) / len(lengths), 44
    for i, n in enumerate(lengths):
        x = left + slot * i + 20
        for k, (name, _, color) in enumerate(BARS):
            t = native[n] if k == 0 else seconds.get((n, name))
            if t is None:
                continue
            bx = x + k * (bar + 6)
            d.rectangle([bx, y(t), bx + bar, y(low)], fill=color)
            label = f"{t:.2f} s" if k == 0 else f"{native[n] / t:.0%}"
            d.text((bx + bar / 2, y(t) - 4), label, fill="black", font=font, anchor="mb")
        d.text((x + 2.5 * (bar + 6), height - bottom + 12), f"{n:,} tokens", fill="black", font=font, anchor="ma")
    legend(d, font, BARS, (left, height - 62), per_row=3, column=300)
    d.text((width / 2, 20), args.title, fill="black", font=font, anchor="ma")
    img.save(args.png)


def legend(d, font, entries, at: tuple[float, float], per_row: int, column: float) -> None:
    """A swatch and a name per (name, _, color) entry, `per_row` to a row of `column` px each."""
    for k, (name, _, color) in enumerate(entries):
        lx, ly = at[0] + (k % per_row) * column, at[1] + (k // per_row) * 22
        d.rectangle([lx, ly, lx + 14, ly + 14], fill=color)
        d.text((lx + 20, ly), name, fill="black", font=font)


# The kv route's bars: the share of vLLM alone's throughput each box keeps (gpu_e2e.json `kv_route`).
KEPT = (("vLLM + its OffloadingConnector", "offloading_connector_kept", (120, 120, 120)),
        ("kv route, kv_bits 4, stream", "bridged_kv4_stream_kept", (40, 90, 200)),
        ("kv route, kv_bits 8, stream", "bridged_kv8_stream_kept", (30, 150, 60)),
        ("kv route, kv_bits 4, one prompt", "bridged_kv4_kept", (150, 180, 230)),
        ("kv4, fused quantizer + async scheduling, stream", "bridged_kv4_fused_async_stream_kept", (230, 140, 20)))


def plot_kept(args: argparse.Namespace) -> None:
    """Per length, the share of vLLM alone's throughput vLLM's own OffloadingConnector and the kv
    route's bridged box keep (a stream of prompts, and one prompt alone; the later lease's fused
    quantizer under async scheduling), beside the 95 % and 98 % bars."""
    from PIL import Image, ImageDraw, ImageFont

    kv_route = json.loads(args.results.read_text())["kv_route"]
    later = {row["prompt_tokens"]: row for row in kv_route.get("fused_check", {}).get("rows", [])}
    rows = [{**later.get(row["prompt_tokens"], {}), **row} for row in kv_route["prefill_box"]["rows"]]
    width, height, left, top, bottom = 960, 490, 70, 60, 130
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=13)

    def y(share: float) -> float:
        return height - bottom - (height - top - bottom) * share

    for share in (0.0, 0.25, 0.5, 0.75, 1.0):
        d.line([(left, y(share)), (width - 20, y(share))], fill=(220, 220, 220))
        d.text((left - 8, y(share)), f"{share:.0%}", fill="black", font=font, anchor="rm")
    for share in (0.95, 0.98):  # the bars
        d.line([(left, y(share)), (width - 20, y(share))], fill=(200, 60, 60))
    slot, bar = (width - left - 20) / len(rows), 44
    for i, row in enumerate(rows):
        x = left + slot * i + 20
        for k, (_, key, color) in enumerate(KEPT):
            if key not in row:  # not measured
                continue
            bx = x + k * (bar + 6)
            d.rectangle([bx, y(row[key]), bx + bar, y(0)], fill=color)
            d.text((bx + bar / 2, y(row[key]) - 4), f"{row[key]:.0%}", fill="black", font=font, anchor="mb")
        d.text((x + len(KEPT) / 2 * (bar + 6), height - bottom + 12), f"{row['prompt_tokens']:,} tokens", fill="black", font=font,
               anchor="ma")
    legend(d, font, KEPT, (left, height - 76), per_row=2, column=400)
    d.text((width / 2, 20), args.title, fill="black", font=font, anchor="ma")
    img.save(args.png)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="phase", required=True)
    b = sub.add_parser("bridged")
    b.add_argument("--lengths", default="8192,32768,131072")
    b.add_argument("--front", default="http://127.0.0.1:8080")
    b.add_argument("--repeats", type=int, default=3, help="cold prompts per length; the row is their median")
    b.add_argument("--in-flight", type=int, default=4,
                   help="prompts bridged at once in the throughput run (each holds stream.connections of the "
                        "decoder's 32 Push streams)")
    n = sub.add_parser("native")
    n.add_argument("--model", type=Path, default=Path("models/llama8b-hf"))
    source = n.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", type=Path, help="a bridged run's prompts.json")
    source.add_argument("--lengths", help="or token counts of the corpus, e.g. 16384,65536")
    n.add_argument("--repeats", type=int, default=3)
    n.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    n.add_argument("--eager", action="store_true", help="--enforce-eager, as the capture route runs")
    n.add_argument("--offload-gib", type=float, default=None,
                   help="with vLLM's own OffloadingConnector storing every block to this much pinned host memory")
    n.add_argument("--tokenizer-mode", default="auto", help="hf: a model's own prompt encoder left out (ids only)")
    n.add_argument("--engine-args", default="{}", help="more of vLLM's LLM() arguments as JSON (kit.sh's V4.1 flags)")
    for s in (b, n):
        s.add_argument("--out", type=Path, required=True)
        s.add_argument("--stream-tokens", type=int, default=262144,
                       help="per length, also about this many tokens of prompts submitted at once: the box's "
                            "throughput (0: off)")
    g = sub.add_parser("plot", help="the results file's prefill_box rows as a PNG")
    g.add_argument("--results", type=Path, default=Path("bench/results/gpu_e2e.json"))
    g.add_argument("--png", type=Path, default=Path("bench/results/gpu_prefill_box.png"))
    g.add_argument("--title", default="Prefill box at Llama-3.1-8B shape on one H200: vLLM alone vs the bridged box "
                                      "(labels: share of vLLM's throughput kept)")
    k = sub.add_parser("plot-kept", help="the results file's kv_route rows (share of vLLM alone kept) as a PNG")
    k.add_argument("--results", type=Path, default=Path("bench/results/gpu_e2e.json"))
    k.add_argument("--png", type=Path, default=Path("bench/results/gpu_kv_route.png"))
    k.add_argument("--title", default="8B shape on one H100: share of vLLM alone's prefill throughput kept "
                                      "(red lines: 95 % and 98 %)")
    args = p.parse_args()
    if args.phase not in ("plot", "plot-kept"):
        args.out.mkdir(parents=True, exist_ok=True)
    {"bridged": bridged, "native": native, "plot": plot, "plot-kept": plot_kept}[args.phase](args)


if __name__ == "__main__":
    main()
