#!/usr/bin/env python3
"""A bench's client of decoded's front door: `Client` (POST, tokenize), `Prompts` (cold prompts
sized with decoded's own tokenizer to a target length), `timed` (one streamed request: TTFT,
decode rate, the `X-PD-Bridge` verdict, and the decode engine's own stages from decoded's log via
`EngineLog`), and `check` (why a row's verdict must be rejected)."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from corpora import QUESTION

TOLERANCE = 0.05


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
