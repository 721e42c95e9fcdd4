#!/usr/bin/env python3
"""The bridge benchmark (issue 5, item 4): time to first token, bridged vs native, by prompt length.

Talks to a running `decoded` front door (and, through it, `prefilld`); `bench/run.sh` starts both
from deploy/examples/ with a fresh store and runs this. Standard library plus Pillow (for the PNG).

    .venv/bin/python bench/bridge.py [--lengths 512,1024,2048,4096] [--out bench/results]

For each target length it builds a cold prompt from real text (license texts found in the
environment's dist-info folders and this repo's LICENSE; every prompt starts with a unique tag and
a different slice of the text, so no block of it can already be in the store), sized with decoded's
own tokenizer (`POST /pd/v1/tokenize`, chat template included) to the target ±5 % — aimed at the
smallest size >= the target, so the whole-block part is the target and the decoder's own tail
prefill is a few tokens. Then, on that one prompt:

  bridged  `X-PD-Bridge-Mode: auto`, streaming, temperature 0, max_tokens 32. Must say `bridged`.
  native   `X-PD-Bridge-Mode: native` (never reads the store, so the same prompt is still cold for
           the decoder). Must say `native` / `requested`.

and, with `--midblock` (default on), one more bridged request on a fresh prompt of target + B/2
tokens: the average case for the decoder's tail prefill (up to B-1 tokens the decoder computes
itself after restoring the bridged blocks).

Per row it keeps the whole `X-PD-Bridge` verdict, TTFT (request sent -> first streamed content
chunk), decode tokens/s ((chunks - 1) / (last chunk - first chunk)), the stage breakdown (the
verdict's stages; the decode engine's own `restore`/`prefill`/`first_token`/`decode` read from
decoded's log, since a streamed verdict is sent before the engine has run), and the load average.
A row whose outcome is not the expected one is rejected: listed with its reason, never averaged.

Derived per length: prefill-engine time = the verdict's `prefill_prefill` (vLLM with the capture
hook on, same token ids); bridge overhead = bridged TTFT - prefill-engine time; floor =
max(prefill-engine time, payload bytes / link rate) for 10 GbE (1.25e9 B/s); payload bytes/token =
bytes / (blocks x block_tokens + the verdict's tail_tokens: the prompt's tail after its last whole
block, bridged for the request), next to the decoder's own cache bytes/token.

Writes OUT/bridge.json and OUT/bridge_ttft.png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTION = (
    "Summarize the text above in detail: which licenses appear, what each one allows, "
    "and what each one requires when the software is redistributed."
)
# What a chat prompt asks of each kind of text (`corpora`).
QUESTIONS = {
    "licenses": QUESTION,
    "changelogs": "Summarize the changes above release by release: what was added, what was fixed, "
                  "and what could break a program that upgrades.",
    "code": "Explain what the code above does, function by function, and point out anything that looks "
            "like a bug.",
}
LINK_RATE_10GBE = 1.25e9  # bytes/s: 10 Gbit/s
TOLERANCE = 0.05


# ---------------------------------------------------------------------------
# Machine, corpus, prompts.
# ---------------------------------------------------------------------------

def machine_info() -> dict:
    cpu_model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu_model = platform.processor() or "unknown"
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout)
    except OSError:
        commit, dirty = "", None
    return {
        "cpu_model": cpu_model,
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "mem_gib": mem_gib,
        "loadavg_at_start": list(os.getloadavg()),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "note": "both engines (vLLM-CPU prefill, mlx-lm decode) and both daemons share these cores, "
                "with other processes on the machine (see the load averages)",
    }


def log(msg: str) -> None:
    print(f"[{dt.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def run_rows(benchmark: str, names: list[str], run_row, setup: dict, out: str) -> list[dict]:
    """Runs `run_row(name, corpus text)` for each row in turn and writes the result file `out`: the
    benchmark, when and how long, the machine (load averages before and after), `setup`, the rows."""
    started, started_utc = time.monotonic(), dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    info = machine_info()
    text = corpus()
    rows = []
    for name in names:
        log(f"row {name}")
        rows.append(run_row(name, text))
    info["loadavg_at_end"] = list(os.getloadavg())
    result = {"benchmark": benchmark, "started_utc": started_utc, "duration_s": round(time.monotonic() - started, 1),
              "machine": info, "setup": setup, "rows": rows}
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return rows


def corpus() -> str:
    """Real prose: this repo's LICENSE and every distinct license text in the venv's dist-info."""
    files = [ROOT / "LICENSE"]
    site = sorted((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
    for sp in site:
        for info in sorted(sp.glob("*.dist-info")):
            for f in sorted(info.rglob("*")):
                if f.is_file() and re.match(r"(?i)(licen[cs]e|copying|notice|authors)", f.name):
                    files.append(f)
    seen, parts = set(), []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text = re.sub(r"[ \t]+\n", "\n", text).strip()
        digest = hashlib.sha256(text.encode()).digest()
        if len(text) < 200 or digest in seen:
            continue
        seen.add(digest)
        parts.append(text)
    if not parts:
        raise SystemExit("no license texts found for the corpus")
    return "\n\n----\n\n".join(parts)


def changelogs() -> str:
    """Real release notes: the changelog sections of the venv's package descriptions (METADATA)."""
    heading = re.compile(r"(?im)^#*\s*(changelog|change log|release notes|history|changes)\b.*$")
    parts = []
    for meta in sorted((ROOT / ".venv" / "lib").glob("python3*/site-packages/*.dist-info/METADATA")):
        description = meta.read_text(encoding="utf-8", errors="replace").partition("\n\n")[2]
        found = heading.search(description)
        if found and len(description) - found.start() >= 2000:
            parts.append(description[found.start():].strip())
    if not parts:
        raise SystemExit("no changelogs found in the venv's package descriptions")
    return "\n\n----\n\n".join(parts)


def source_code() -> str:
    """Real source: mlx-lm's model files and vLLM's engine core, as pinned in the venv."""
    site = sorted((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
    files = [f for sp in site for pattern in ("mlx_lm/models/*.py", "vllm/v1/core/*.py", "vllm/v1/core/sched/*.py")
             for f in sorted(sp.glob(pattern))]
    parts = [f"# file: {f.relative_to(f.parents[2])}\n{f.read_text(encoding='utf-8')}" for f in files
             if f.stat().st_size >= 2000]
    if not parts:
        raise SystemExit("no mlx-lm or vLLM sources found for the code corpus")
    return "\n\n".join(parts)


def corpora() -> dict[str, str]:
    """Three kinds of real text, each asked about with its own question (QUESTIONS)."""
    return {"licenses": corpus(), "changelogs": changelogs(), "code": source_code()}


class Client:
    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def post(self, path: str, body: dict, headers: dict | None = None, timeout: float = 60):
        request = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(),
            headers={"content-type": "application/json", **(headers or {})},
        )
        return urllib.request.urlopen(request, timeout=timeout)

    def tokenize(self, request: list | str) -> tuple[int, int]:
        """Token count of a chat (`messages`) or a plain prompt, and the block size."""
        body = {"prompt": request} if isinstance(request, str) else {"messages": request}
        with self.post("/pd/v1/tokenize", body) as r:
            reply = json.load(r)
        return len(reply["tokens"]), reply["block_tokens"]


def messages_for(tag: str, text: str, question: str = QUESTION) -> list:
    return [{"role": "user", "content": f"[{tag}]\n{text}\n\n{question}"}]


def request_for(tag: str, text: str, question: str | None) -> list | str:
    """A chat asking `question` about the text, or (None: a base model) the text to continue."""
    return f"[{tag}]\n{text}" if question is None else messages_for(tag, text, question)


class Prompts:
    """Cold prompts: a unique tag, then a slice of the corpus starting somewhere new each time."""

    def __init__(self, client: Client, text: str, run_id: str, question: str | None = QUESTION):
        """`question`: what each chat prompt asks of its text; None: plain prompts (a base model
        continues the text through /v1/completions)."""
        self.client, self.text, self.run_id, self.question = client, text, run_id, question
        self.n = 0
        self.cursor = 0
        self.chars_per_token = 3.5

    def make(self, target: int) -> dict:
        self.n += 1
        tag = f"bench {self.run_id} prompt {self.n}"
        need = int(target * self.chars_per_token * 1.6) + 2000
        if need > len(self.text):
            raise SystemExit(f"corpus of {len(self.text)} chars is too small for {target} tokens")
        # A new start for every prompt, at a line boundary, wrapping around the corpus.
        start = self.cursor % (len(self.text) - need)
        nl = self.text.find("\n", start)
        start = nl + 1 if 0 <= nl < start + 500 else start
        self.cursor = start + 7919 * 13 + self.n * 4099
        window = self.text[start:start + need]

        def count(chars: int) -> int:
            return self.client.tokenize(request_for(tag, window[:chars], self.question))[0]

        # Smallest slice with >= target tokens (token count is monotone enough in the slice length).
        lo, hi = 0, len(window)
        if count(hi) < target:
            raise SystemExit(f"window too small for {target} tokens")
        guess = max(1, min(hi - 1, int(target * self.chars_per_token)))
        calls = 1
        # Bracket around the guess first, then bisect.
        g = count(guess); calls += 1
        if g >= target:
            hi = guess
        else:
            lo = guess
        while hi - lo > 1:
            mid = (lo + hi) // 2
            c = count(mid); calls += 1
            if c >= target:
                hi = mid
            else:
                lo = mid
        tokens = count(hi); calls += 1
        if tokens >= 1024:  # a short prompt is mostly template and tag: it would misjudge the text's rate
            self.chars_per_token = hi / max(tokens, 1)
        if abs(tokens - target) > TOLERANCE * target:
            raise SystemExit(f"could not size a prompt to {target}±5 % tokens (got {tokens})")
        request = request_for(tag, window[:hi], self.question)
        return {"tag": tag, "messages" if self.question else "prompt": request, "prompt_tokens": tokens,
                "corpus_start": start, "chars": hi, "tokenize_calls": calls}


# ---------------------------------------------------------------------------
# One timed request.
# ---------------------------------------------------------------------------

class EngineLog:
    """The decode engine's per-request line in decoded's log (`op=generate ok ... restore_ms=...`)."""

    PATTERN = re.compile(r"op=generate ok (.*)$")

    def __init__(self, path: Path | None):
        self.path = path

    def mark(self) -> int:
        try:
            return self.path.stat().st_size if self.path else 0
        except OSError:
            return 0

    def since(self, offset: int, prompt_tokens: int, wait_s: float = 3.0) -> dict | None:
        if not self.path:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with open(self.path, "rb") as f:
                    f.seek(offset)
                    lines = f.read().decode(errors="replace").splitlines()
            except OSError:
                return None
            for line in reversed(lines):
                m = self.PATTERN.search(line)
                if not m:
                    continue
                fields = dict(kv.split("=", 1) for kv in m.group(1).split() if "=" in kv)
                if int(fields.get("prompt", -1)) != prompt_tokens:
                    continue
                out = {"cached": int(fields["cached"]), "completion": int(fields["completion"]),
                       "finish": fields.get("finish")}
                for key in ("queue", "restore", "prefill", "first_token", "decode"):
                    value = fields.get(f"{key}_ms")
                    out[f"engine_{key}"] = None if value in (None, "None") else float(value)
                out["engine_total"] = float(fields["ms"]) if "ms" in fields else None
                return out
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)


def timed(client: Client, log: EngineLog, prompt: dict, mode: str, max_tokens: int,
          headers: dict | None = None) -> dict:
    # A chat prompt or (a base model's) plain one, each through its own OpenAI route.
    chat = "messages" in prompt
    key = "messages" if chat else "prompt"
    body = {key: prompt[key], "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    offset = log.mark()
    load = list(os.getloadavg())
    started = time.monotonic()
    first = last = None
    chunks, pieces, usage, finish, error, verdict, status = 0, [], {}, None, None, None, None
    try:
        sent = {"x-pd-bridge-mode": mode, **(headers or {})}
        with client.post("/v1/chat/completions" if chat else "/v1/completions", body, sent, timeout=3600) as response:
            status = response.status
            verdict = json.loads(response.headers.get("x-pd-bridge") or "null")
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    error = chunk["error"].get("message", str(chunk["error"]))
                    break
                usage = chunk.get("usage") or usage
                if not chunk["choices"]:  # the usage chunk that ends the stream
                    continue
                choice = chunk["choices"][0]
                piece = choice.get("delta", {}).get("content") if chat else choice.get("text") or None
                if piece is not None:
                    now = time.monotonic()
                    first = first or now
                    last = now
                    chunks += 1
                    pieces.append(piece)
                finish = choice.get("finish_reason") or finish
    except urllib.error.HTTPError as e:
        status = e.code
        verdict = json.loads(e.headers.get("x-pd-bridge") or "null")
        error = e.read().decode(errors="replace")[:500]
    except (urllib.error.URLError, OSError) as e:
        error = f"{type(e).__name__}: {e}"
    ended = time.monotonic()
    engine = log.since(offset, prompt["prompt_tokens"]) if error is None else None
    ttft = None if first is None else first - started
    decode_tps = (chunks - 1) / (last - first) if chunks > 1 and last > first else None
    return {
        "mode": mode,
        "prompt_tag": prompt["tag"],
        "prompt_tokens": prompt["prompt_tokens"],
        "http_status": status,
        "error": error,
        "verdict": verdict,
        "ttft_s": ttft,
        "last_chunk_s": None if last is None else last - started,
        "started_monotonic": started,
        "total_s": ended - started,
        "completion_chunks": chunks,
        "completion_tokens": usage.get("completion_tokens"),
        "finish_reason": finish,
        "decode_tok_s": decode_tps,
        "text": "".join(pieces),
        "engine_log": engine,
        "loadavg_at_start": load,
    }


# ---------------------------------------------------------------------------
# Rows, acceptance, derived numbers.
# ---------------------------------------------------------------------------

def check(row: dict, expected: str) -> str | None:
    """Why a row must be rejected, or None."""
    v = row["verdict"] or {}
    if row["error"]:
        return f"error: {row['error']}"
    if row["ttft_s"] is None:
        return "no content chunk was streamed"
    if expected == "native":
        if v.get("outcome") != "native" or v.get("reason") != "requested":
            return f"expected native/requested, got {v.get('outcome')}/{v.get('reason')}"
        if (row["engine_log"] or {}).get("cached", 0) != 0:
            return "the engine restored cached tokens on a native request"
    else:
        if v.get("outcome") != "bridged":
            return f"expected bridged, got {v.get('outcome')}/{v.get('reason')}"
        whole = v["prompt_tokens"] // v["block_tokens"]
        if v.get("blocks") != whole:
            return f"expected {whole} blocks pushed by this request (cold prompt), got {v.get('blocks')}"
    return None


def stages(row: dict) -> dict:
    """The stage breakdown, in seconds: the verdict's stages, the engine's, and the client's."""
    out = {k: round(ms / 1e3, 4) for k, ms in sorted(((row["verdict"] or {}).get("timings_ms") or {}).items())}
    for k, ms in sorted((row["engine_log"] or {}).items()):
        if k.startswith("engine_") and ms is not None:
            out[k] = round(ms / 1e3, 4)
    if row["ttft_s"] is not None:
        out["client_ttft"] = round(row["ttft_s"], 4)
        if "generate_start" in out:
            # Everything between the front door calling the engine and the first chunk reaching the
            # client: engine restore + tail prefill + first token + SSE.
            out["client_after_generate_start"] = round(row["ttft_s"] - out["generate_start"], 4)
    return out


def derive(row: dict, link_rate: float, cache_bpt: int) -> None:
    v = row["verdict"] or {}
    row["stages_s"] = stages(row)
    b = v.get("block_tokens") or 0
    row["tail_tokens"] = (v.get("prompt_tokens", 0) - v.get("cached_tokens", 0)) if v else None
    if row["mode"] == "native":
        return
    prefill_s = (v.get("timings_ms") or {}).get("prefill_prefill")
    prefill_s = None if prefill_s is None else prefill_s / 1e3
    blocks, nbytes = v.get("blocks") or 0, v.get("bytes") or 0
    wire_s = nbytes / link_rate
    row["prefill_engine_s"] = prefill_s
    row["prefill_engine_tok_s"] = (blocks * b / prefill_s) if prefill_s else None
    row["bridge_overhead_s"] = (row["ttft_s"] - prefill_s) if (prefill_s is not None and row["ttft_s"]) else None
    bridged_tokens = blocks * b + (v.get("tail_tokens") or 0)
    row["payload_bytes_per_token"] = nbytes / bridged_tokens if blocks and b else None
    row["payload_vs_cache"] = row["payload_bytes_per_token"] / cache_bpt if row["payload_bytes_per_token"] else None
    row["link_time_10gbe_s"] = wire_s
    row["floor_s"] = max(prefill_s or 0.0, wire_s)
    # Where the overhead goes: the bridge call beyond the prefill engine (reconstruction not hidden
    # behind the forward, the push's commit), and the decoder's part (restore, tail prefill, first
    # token, SSE); the rest is tokenize + planning.
    st = row["stages_s"]
    if prefill_s is not None and row["ttft_s"] and "bridge" in st and "generate_start" in st:
        row["overhead_split_s"] = {
            "bridge_beyond_prefill_engine": st["bridge"] - prefill_s,
            "decoder_restore_tail_first_token": row["ttft_s"] - st["generate_start"],
            "front_door_other": st["generate_start"] - st["bridge"],
        }


def cache_bytes_per_token(log_path: Path | None, default: int) -> tuple[int, str]:
    if log_path and log_path.exists():
        m = re.findall(r"bytes_per_token\S*?=\S*?(\d+)", re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text(errors="replace")))
        if m:
            return int(m[-1]), "decoded log (decode engine ready: bytes_per_token)"
    return default, "--cache-bytes-per-token"


# ---------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------

def fmt(x, nd=1):
    return "—" if x is None else f"{x:,.{nd}f}"


def table(lengths: list[dict]) -> str:
    head = ("| target | prompt tok | native TTFT s | bridged TTFT s | speedup | prefill engine s (tok/s) "
            "| bridge overhead s | floor 10 GbE s | tail tok (s) | mid-block bridged TTFT s (tail tok) "
            "| decode tok/s native / bridged | payload B/tok |")
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for L in lengths:
        n, b, m = L.get("native"), L.get("bridged"), L.get("midblock")
        tail = None
        if b:
            tail_s = b["stages_s"].get("engine_prefill")
            tail = f"{b['tail_tokens']} ({fmt(tail_s, 2)})"
        mid = f"{fmt(m['ttft_s'])} ({m['tail_tokens']})" if m else "—"
        pe = f"{fmt(b['prefill_engine_s'], 2)} ({fmt(b['prefill_engine_tok_s'], 0)})" if b else "—"
        lines.append(
            f"| {L['target']:,} | {fmt(L.get('prompt_tokens'), 0)} | {fmt(n and n['ttft_s'])} | {fmt(b and b['ttft_s'], 2)} "
            f"| {fmt(L.get('speedup'))}× | {pe} | {fmt(b and b['bridge_overhead_s'], 2)} | {fmt(b and b['floor_s'], 2)} "
            f"| {tail or '—'} | {mid} | {fmt(n and n['decode_tok_s'])} / {fmt(b and b['decode_tok_s'])} "
            f"| {fmt(b and b['payload_bytes_per_token'], 0)} |"
        )
    return "\n".join(lines)


def plot(lengths: list[dict], path: Path, title: str) -> bool:
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        print("Pillow is not available: no PNG", file=sys.stderr)
        return False
    series = [
        ("native (decoder prefills itself)", (200, 50, 40), "native", "ttft_s", False),
        ("bridged (blocks aligned, tail ~1 token)", (40, 90, 200), "bridged", "ttft_s", False),
        ("bridged, mid-block prompt (+B/2 tail)", (120, 170, 240), "midblock", "ttft_s", False),
        ("floor: max(prefill engine, bytes / 10 GbE)", (30, 150, 60), "bridged", "floor_s", True),
    ]
    pts = {}
    for name, color, kind, field, dashed in series:
        p = [(r["prompt_tokens"], r[field]) for L in lengths if (r := L.get(kind)) and r.get(field) is not None]
        if p:
            pts[name] = (color, dashed, p)
    if not pts:
        return False
    W, H = 1000, 660
    ml, mr, mt, mb = 90, 30, 60, 130
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=15)
        small = ImageFont.load_default(size=13)
    except TypeError:
        font = small = ImageFont.load_default()
    import math
    xmax = max(x for _, _, p in pts.values() for x, _ in p) * 1.08
    ys_all = [y for _, _, p in pts.values() for _, y in p if y > 0]
    # Log scale in y: the ratio between two curves (the speedup) is the vertical gap between them.
    lo = 10 ** math.floor(math.log10(min(ys_all) / 1.3))
    hi = 10 ** math.ceil(math.log10(max(ys_all) * 1.3))
    step = 512 if xmax <= 6000 else 1024 * math.ceil(xmax / 8192)
    X = lambda x: ml + (W - ml - mr) * x / xmax
    Y = lambda y: H - mb - (H - mt - mb) * (math.log10(max(y, lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    for gx in range(0, int(xmax) + 1, step):
        d.line([(X(gx), mt), (X(gx), H - mb)], fill=(230, 230, 230))
        d.text((X(gx), H - mb + 8), f"{gx:,}", fill="black", font=small, anchor="ma")
    decade = lo
    while decade <= hi:
        for k in (1, 2, 5):
            gy = decade * k
            if lo <= gy <= hi:
                d.line([(ml, Y(gy)), (W - mr, Y(gy))], fill=(215, 215, 215) if k == 1 else (238, 238, 238))
                d.text((ml - 8, Y(gy)), f"{gy:g}", fill="black", font=small, anchor="rm")
        decade *= 10
    d.rectangle([ml, mt, W - mr, H - mb], outline="black")
    d.text((W / 2, 20), title, fill="black", font=font, anchor="ma")
    d.text(((ml + W - mr) / 2, H - mb + 32), "prompt tokens", fill="black", font=font, anchor="ma")
    d.text((20, mt - 30), "time to first token, s (log scale)", fill="black", font=font)
    for name, (color, dashed, p) in pts.items():
        p = sorted(p)
        for (x0, y0), (x1, y1) in zip(p, p[1:]):
            if dashed:
                n = 24
                for i in range(0, n, 2):
                    a, b = i / n, (i + 1) / n
                    d.line([(X(x0 + (x1 - x0) * a), Y(y0 + (y1 - y0) * a)),
                            (X(x0 + (x1 - x0) * b), Y(y0 + (y1 - y0) * b))], fill=color, width=3)
            else:
                d.line([(X(x0), Y(y0)), (X(x1), Y(y1))], fill=color, width=3)
        for x, y in p:
            d.ellipse([X(x) - 5, Y(y) - 5, X(x) + 5, Y(y) + 5], fill=color)
            if not dashed:
                d.text((X(x) + 8, Y(y) - 6), f"{y:.1f}", fill=color, font=small, anchor="ld")
            else:
                d.text((X(x) + 8, Y(y) + 6), f"{y:.1f}", fill=color, font=small, anchor="la")
    # The legend, in two columns under the plot.
    for i, (name, (color, dashed, _)) in enumerate(pts.items()):
        lx, ly = ml + (i % 2) * 440, H - mb + 62 + (i // 2) * 22
        d.line([(lx, ly + 7), (lx + 35, ly + 7)], fill=color, width=3)
        d.text((lx + 43, ly), name, fill="black", font=small)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return True


# ---------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="decoded's front door")
    p.add_argument("--lengths", default="512,1024,2048,4096", help="target prompt lengths, tokens")
    p.add_argument("--out", default="bench/results", help="folder for bridge.json and bridge_ttft.png")
    p.add_argument("--decoded-log", default=None, help="decoded's log, for the engine's per-request stages")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--link-rate", type=float, default=LINK_RATE_10GBE, help="bytes/s for the floor (10 GbE)")
    p.add_argument("--cache-bytes-per-token", type=int, default=46080,
                   help="the decoder's own cache bytes/token, if decoded's log does not say")
    p.add_argument("--midblock", action=argparse.BooleanOptionalAction, default=True,
                   help="also a bridged row at target + B/2 tokens (average decoder tail)")
    p.add_argument("--budget-s", type=float, default=0,
                   help="skip a length whose native run would not fit in what is left (0: no limit)")
    args = p.parse_args()

    started_wall, t0 = dt.datetime.now(dt.timezone.utc), time.monotonic()
    client = Client(args.url)
    out = Path(args.out)
    log_path = Path(args.decoded_log) if args.decoded_log else None
    log = EngineLog(log_path)
    targets = [int(x) for x in args.lengths.split(",") if x.strip()]
    machine = machine_info()
    cache_bpt, cache_bpt_source = cache_bytes_per_token(log_path, args.cache_bytes_per_token)
    text = corpus()
    run_id = started_wall.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
    prompts = Prompts(client, text, run_id)
    _, block_tokens = client.tokenize([{"role": "user", "content": "x"}])
    print(f"== corpus {len(text):,} chars; block {block_tokens} tokens; decoder cache {cache_bpt} B/token; "
          f"load {machine['loadavg_at_start']}", file=sys.stderr)

    def say(msg):
        print(f"[{time.monotonic() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)

    # Warm both paths (first MLX/vLLM calls compile and allocate); not timed, not kept as rows.
    warm = []
    overhead = client.tokenize(messages_for(f"bench {run_id} prompt 0", ""))[0]  # tag, question, template
    for target, mode in ((block_tokens + 8, "auto"), (overhead + 24, "native")):
        pr = prompts.make(target)
        r = timed(client, log, pr, mode, 8)
        say(f"warm-up {mode} {pr['prompt_tokens']} tok: {r['verdict'] and r['verdict'].get('outcome')} "
            f"ttft {fmt(r['ttft_s'], 2)} s {r['error'] or ''}")
        warm.append({k: r[k] for k in ("mode", "prompt_tokens", "verdict", "ttft_s", "error")})

    rows, rejected, skipped, per_length = [], [], [], []
    native_rate = None  # s per token^1 of the last native row, for the budget check
    for target in targets:
        if args.budget_s and native_rate:
            estimate = native_rate * target * (1.0 + target / 16384) + 60
            left = args.budget_s - (time.monotonic() - t0)
            if estimate > left:
                say(f"skip {target}: native alone would take ~{estimate:.0f} s, {left:.0f} s left")
                skipped.append({"target": target, "reason": f"native estimated {estimate:.0f} s > {left:.0f} s left"})
                continue
        L = {"target": target}
        pr = prompts.make(target)
        L["prompt_tokens"] = pr["prompt_tokens"]
        plan = [("bridged", "auto", "bridged", pr), ("native", "native", "native", pr)]
        if args.midblock:
            plan.append(("midblock", "auto", "bridged", None))
        for kind, mode, expected, prompt in plan:
            for attempt in (1, 2):
                if prompt is None or attempt == 2:
                    if kind == "native":
                        break  # minutes per native row: no retry
                    prompt = prompts.make(target + (block_tokens // 2 if kind == "midblock" else 0))
                say(f"{target}: {kind} ({mode}) {prompt['prompt_tokens']} tok ...")
                r = timed(client, log, prompt, mode, args.max_tokens)
                r.update(kind=kind, target=target, expected=expected, attempt=attempt,
                         corpus_start=prompt["corpus_start"])
                derive(r, args.link_rate, cache_bpt)
                why = check(r, expected)
                v = r["verdict"] or {}
                say(f"{target}: {kind} -> {v.get('outcome')}/{v.get('reason')} ttft {fmt(r['ttft_s'], 2)} s "
                    f"decode {fmt(r['decode_tok_s'])} tok/s" + (f"  REJECTED: {why}" if why else ""))
                if why:
                    r["rejected"] = why
                    rejected.append({"target": target, "kind": kind, "attempt": attempt, "reason": why,
                                     "verdict": r["verdict"], "prompt_tokens": r["prompt_tokens"]})
                    rows.append(r)
                    continue
                r["rejected"] = None
                rows.append(r)
                L[kind] = r
                if kind == "native":
                    native_rate = r["ttft_s"] / r["prompt_tokens"] / (1.0 + r["prompt_tokens"] / 16384)
                break
        n, b = L.get("native"), L.get("bridged")
        if n and b:
            L["speedup"] = n["ttft_s"] / b["ttft_s"]
            L["same_text"] = n["text"] == b["text"]
            L["same_first_chunk"] = n["text"][:1] == b["text"][:1] and bool(n["text"])
        per_length.append(L)

    summary = []
    for L in per_length:
        n, b, m = L.get("native"), L.get("bridged"), L.get("midblock")
        summary.append({
            "target": L["target"],
            "prompt_tokens": L["prompt_tokens"],
            "native_ttft_s": n and n["ttft_s"],
            "bridged_ttft_s": b and b["ttft_s"],
            "native_over_bridged_ttft": L.get("speedup"),
            "prefill_engine_s": b and b["prefill_engine_s"],
            "prefill_engine_tok_s": b and b["prefill_engine_tok_s"],
            "bridge_overhead_s": b and b["bridge_overhead_s"],
            "bridge_overhead_split_s": b and b.get("overhead_split_s"),
            "bridged_stages_s": b and b["stages_s"],
            "floor_10gbe_s": b and b["floor_s"],
            "bridged_over_floor": (b["ttft_s"] / b["floor_s"]) if b and b["floor_s"] else None,
            "native_over_floor": (n["ttft_s"] / b["floor_s"]) if n and b and b["floor_s"] else None,
            "bridged_tail_tokens": b and b["tail_tokens"],
            "midblock_prompt_tokens": m and m["prompt_tokens"],
            "midblock_tail_tokens": m and m["tail_tokens"],
            "midblock_ttft_s": m and m["ttft_s"],
            "midblock_bridge_overhead_s": m and m["bridge_overhead_s"],
            "native_over_midblock_ttft_est": (n["ttft_s"] / n["prompt_tokens"] * m["prompt_tokens"] / m["ttft_s"])
            if n and m else None,
            "decode_tok_s_native": n and n["decode_tok_s"],
            "decode_tok_s_bridged": b and b["decode_tok_s"],
            "payload_bytes_per_token": b and b["payload_bytes_per_token"],
            "payload_vs_decoder_cache": b and b["payload_vs_cache"],
            "same_text_native_bridged": L.get("same_text"),
        })

    finished = time.monotonic() - t0
    result = {
        "benchmark": "pd-bridge bridge TTFT (bench/bridge.py)",
        "started_utc": started_wall.isoformat(timespec="seconds"),
        "duration_s": round(finished, 1),
        "machine": {**machine, "loadavg_at_end": list(os.getloadavg())},
        "setup": {
            "front_door": args.url,
            "lengths": targets,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "block_tokens": block_tokens,
            "link_rate_bytes_per_s": args.link_rate,
            "decoder_cache_bytes_per_token": cache_bpt,
            "decoder_cache_bytes_per_token_source": cache_bpt_source,
            "corpus_chars": len(text),
            "question": QUESTION,
            "definitions": {
                "ttft_s": "request sent -> first streamed chunk carrying delta.content, at the client",
                "decode_tok_s": "(content chunks - 1) / (last chunk time - first chunk time); one chunk per token",
                "prefill_engine_s": "verdict timings_ms.prefill_prefill: vLLM's prefill of the whole-block tokens "
                                    "with the capture hook on, as timed by prefilld",
                "bridge_overhead_s": "bridged ttft_s - prefill_engine_s",
                "floor_s": "max(prefill_engine_s, payload bytes / link rate)",
                "payload_bytes_per_token": "verdict bytes / (blocks * block_tokens + verdict tail_tokens)",
                "tail_tokens": "prompt tokens the decoder prefills itself after restoring the bridged blocks",
                "stages_s": "verdict timings (tokenize, bridge, prefill_*, generate_start), the decode engine's "
                            "own timings from decoded's log (engine_*), and client-side ttft",
            },
            "acceptance": "native rows must say native/requested; bridged and midblock rows must say bridged "
                          "with every whole block pushed by that request; anything else is rejected and "
                          "listed, never summarized",
        },
        "summary": summary,
        "rejected": rejected,
        "skipped": skipped,
        "warmup": warm,
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "bridge.json").write_text(json.dumps(result, indent=2) + "\n")
    title = f"pd-bridge TTFT on {machine['cpu_cores']} CPU cores ({machine['cpu_model'][:40]}), both engines on CPU"
    png = plot(per_length, out / "bridge_ttft.png", title)
    md = table(per_length)
    print(md)
    if rejected:
        print("\nRejected rows:")
        for r in rejected:
            print(f"- {r['target']} {r['kind']} (attempt {r['attempt']}): {r['reason']}")
    if skipped:
        print("\nSkipped: " + "; ".join(f"{s['target']}: {s['reason']}" for s in skipped))
    print(f"\nwrote {out / 'bridge.json'}" + (f" and {out / 'bridge_ttft.png'}" if png else "") +
          f" in {finished:.0f} s", file=sys.stderr)
    return 0 if per_length and all(L.get("native") and L.get("bridged") for L in per_length) else 1


if __name__ == "__main__":
    sys.exit(main())
