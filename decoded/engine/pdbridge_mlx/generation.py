"""One generate request, from its validated parameters to the lines it streams.

Shared by both ways a generation runs: alone (`Engine.generate`, mlx-lm's
`stream_generate`) and in the continuous batch (`batch.Batch`, mlx-lm's
`BatchGenerator`). Both hand `Output.step` the same thing per generated token:
its id, its detokenized text, its logprobs and mlx-lm's finish reason ("stop":
the EOS, not output; "length": the last token, output; None: more to come).
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from pdbridge_cache.proto import engine_pb2

from .errors import BadRequest, Cancelled

log = logging.getLogger("pdbridge_mlx")

# OpenAI's bounds on `logprobs` alternatives and on the penalties.
MAX_TOP_LOGPROBS = 20
PENALTY_RANGE = (-2.0, 2.0)


def ms(start: float, end: float | None = None) -> float:
    return round(((end if end is not None else time.perf_counter()) - start) * 1000.0, 3)


@dataclass(frozen=True)
class Params:
    """A generate request, validated (no MLX needed, so any thread may parse it)."""

    tokens: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    # None: no logprobs; n: the sampled token's and the n most likely alternatives.
    top_logprobs: int | None
    blocks: list[str]
    tail: str | None
    spec_fingerprint: str | None
    stops: list[str]
    # The request's tool definitions: tool calls are parsed out of the answer only when present.
    tools: list[dict] | None

    @classmethod
    def parse(cls, req: engine_pb2.GenerateRequest, vocab: int, block_tokens: int) -> "Params":
        """The request's values, held to their ranges (the schema has already held them to their types)."""
        tokens = parse_tokens(req.tokens, vocab)
        sampling = req.sampling
        top_logprobs = sampling.logprobs if sampling.HasField("logprobs") else None
        if top_logprobs is not None and top_logprobs > MAX_TOP_LOGPROBS:
            raise BadRequest(f"logprobs must be unset or the number of alternatives, 0 to {MAX_TOP_LOGPROBS}")
        blocks = list(req.blocks)
        if len(blocks) * block_tokens > len(tokens):
            raise BadRequest(
                f"{len(blocks)} blocks of {block_tokens} tokens cover more than the {len(tokens)}-token prompt"
            )
        stops = list(sampling.stop)
        if not all(stops):
            raise BadRequest("stop must be a list of non-empty strings")
        tools = None
        if req.tools_json:
            try:
                tools = json.loads(req.tools_json)
            except json.JSONDecodeError as e:
                raise BadRequest(f"tools_json is not JSON: {e}") from None
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise BadRequest("tools must be a list of objects")
            tools = tools or None
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 256
        if max_tokens < 1:
            raise BadRequest("max_tokens must be an integer >= 1")
        return cls(
            tokens=tokens,
            max_tokens=max_tokens,
            temperature=_float("temperature", sampling.temperature, lo=0.0),
            top_p=_float("top_p", sampling.top_p if sampling.HasField("top_p") else 1.0, lo=0.0, hi=1.0),
            seed=sampling.seed if sampling.HasField("seed") else None,
            presence_penalty=_float("presence_penalty", sampling.presence_penalty, lo=PENALTY_RANGE[0],
                                    hi=PENALTY_RANGE[1]),
            frequency_penalty=_float("frequency_penalty", sampling.frequency_penalty, lo=PENALTY_RANGE[0],
                                     hi=PENALTY_RANGE[1]),
            top_logprobs=top_logprobs,
            blocks=blocks,
            tail=req.tail if req.HasField("tail") else None,
            spec_fingerprint=req.spec_fingerprint or None,
            stops=stops,
            tools=tools,
        )

    @property
    def seeded_sampling(self) -> bool:
        """Sampling that must be reproducible from its seed: mlx-lm's sampler draws from MLX's one
        global generator, so such a generation runs alone, never in a batch."""
        return self.seed is not None and self.temperature > 0


class Job:
    """A generation in flight. The model thread writes its lines; the connection's thread reads
    them and sends them, so a slow client never holds the model thread."""

    def __init__(self, params: Params, received: float):
        self.params = params
        self.received = received
        self.cancelled = threading.Event()
        self._lines: queue.SimpleQueue = queue.SimpleQueue()

    # model thread
    def put(self, line: engine_pb2.Reply) -> None:
        self._lines.put(line)

    def fail(self, error: BaseException) -> None:
        self._lines.put(error)

    # connection thread
    def lines(self) -> Iterator[engine_pb2.Reply]:
        """Every line up to and including the done line; a failure is raised."""
        while True:
            line = self._lines.get()
            if isinstance(line, BaseException):
                raise line
            yield line
            if line.HasField("done"):
                return


class Output:
    """What a generation has produced so far and how it ends: stop sequences, tool calls,
    logprobs, usage and timings, as lines of the adapter's protocol."""

    def __init__(self, job: Job, tokenizer: Any, *, cached: int, admitted: float, restore_ms: float):
        self.job = job
        self.params = job.params
        self.tokenizer = tokenizer
        self.cached = cached
        self.admitted = admitted
        self.restore_ms = restore_ms
        self.stop_text = StopText(self.params.stops)
        self.tool_calls = (
            ToolCalls(tokenizer, self.params.tools) if self.params.tools and tokenizer.has_tool_calling else None
        )
        # A filter may hold text back; without one every token gets its line.
        self.filtered = bool(self.params.stops) or self.tool_calls is not None
        self.completion = 0
        self.made_tool_call = False
        self.prefill_ms = self.first_token_ms = None
        self.t_decode = time.perf_counter()

    def step(self, token: int, text: str, logprobs: Any, finish_reason: str | None) -> bool:
        """One generated token; True once the generation is over (its done line is sent)."""
        if self.job.cancelled.is_set():
            raise Cancelled("client went away")
        if self.prefill_ms is None:
            self.prefill_ms, self.first_token_ms = ms(self.admitted), ms(self.job.received)
            self.t_decode = time.perf_counter()
        if finish_reason == "stop":  # the EOS: not output; `text` is what the detokenizer held
            held, _ = self.stop_text.push(text)
            self._finish("stop", held)
            return True
        self.completion += 1
        text, stopped = self.stop_text.push(text)
        calls: list[dict] = []
        if self.tool_calls is not None:
            text, calls = self.tool_calls.push(text)
        if text or calls or not self.filtered or self.params.top_logprobs is not None:
            line = engine_pb2.Token(id=int(token), text=text, tool_calls=calls)
            self.made_tool_call |= bool(calls)
            if self.params.top_logprobs is not None:
                line.logprob.CopyFrom(self._logprob(token, logprobs, self.params.top_logprobs))
            self.job.put(engine_pb2.Reply(token=line))
        if stopped or finish_reason == "length":
            self._finish("stop" if stopped else "length", "")
            return True
        return False

    def _finish(self, reason: str, held: str) -> None:
        # Text held back until the end: by the detokenizer (e.g. a partial UTF-8 char), as a
        # possible start of a stop sequence that never completed, or in an unfinished tool call.
        held += self.stop_text.flush()
        calls: list[engine_pb2.ToolCall] = []
        if self.tool_calls is not None:
            text, calls = self.tool_calls.push(held)
            rest, more = self.tool_calls.flush()
            held, calls = text + rest, calls + more
        self.made_tool_call |= bool(calls)
        if reason == "stop" and self.made_tool_call:
            reason = "tool_calls"
        p = self.params
        timings = {
            "queue": ms(self.job.received, self.admitted),
            "restore": self.restore_ms,
            "prefill": self.prefill_ms,
            "first_token": self.first_token_ms,
            "decode": ms(self.t_decode),
            "total": ms(self.job.received),
        }
        done = engine_pb2.GenerateSummary(
            finish_reason=reason, prompt_tokens=len(p.tokens), cached_tokens=self.cached,
            completion_tokens=self.completion, timings_ms={k: v for k, v in timings.items() if v is not None},
            text=held, tool_calls=calls, stop_sequence=self.stop_text.matched if reason == "stop" else "",
        )
        self.job.put(engine_pb2.Reply(done=done))

    def _logprob(self, token: int, logprobs: Any, top: int) -> engine_pb2.Logprob:
        """OpenAI's logprob entry for the sampled `token`: its text, log probability and UTF-8
        bytes, and the `top` most likely tokens at that step."""
        import mlx.core as mx

        def entry(t: int, lp: float) -> engine_pb2.Logprob:
            text = self.tokenizer.decode([t])
            return engine_pb2.Logprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")))

        chosen = entry(int(token), logprobs[int(token)].item())
        if top:
            best = mx.argpartition(-logprobs, kth=top - 1)[:top]
            pairs = sorted(zip(best.tolist(), logprobs[best].tolist()), key=lambda p: -p[1])
            chosen.top_logprobs.extend(entry(t, lp) for t, lp in pairs)
        return chosen


class StopText:
    """Stop sequences over streamed text: `push` returns the text safe to send now and whether a
    stop sequence completed. Text that could still become a stop sequence is held back, and a stop
    sequence itself is never returned, as OpenAI's `stop` behaves."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.matched = ""  # the stop sequence that completed, once one has

    def push(self, piece: str) -> tuple[str, bool]:
        self.pending += piece
        found = [(i, stop) for stop in self.stops if (i := self.pending.find(stop)) >= 0]
        if found:
            at, self.matched = min(found, key=lambda f: f[0])
            out, self.pending = self.pending[:at], ""
            return out, True
        held = max((k for stop in self.stops for k in range(1, len(stop)) if self.pending.endswith(stop[:k])), default=0)
        cut = len(self.pending) - held
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class ToolCalls:
    """Tool calls in streamed text, found as mlx_lm.server finds them: text between the markers
    of the tool parser mlx-lm chose for the chat template is parsed into calls and never shown as
    content. A call that does not parse is given back as text, markers included, so nothing the
    model said is lost."""

    def __init__(self, tokenizer: Any, tools: list[dict]):
        from mlx_lm.generate import TextStateMachine  # MLX: only where a generation runs

        self.machine = TextStateMachine
        self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end
        self.parser = tokenizer.tool_parser
        self.tools = tools
        edges = {"normal": [(self.start, "tool")], "tool": [(self.end, "normal")] if self.end else []}
        self.state = TextStateMachine(edges).make_state("normal")
        self.in_call = False
        self.call_text = ""

    def push(self, text: str) -> tuple[str, list[engine_pb2.ToolCall]]:
        self.state, segments = self.machine.split(self.state, text)
        out, calls = "", []
        for state, piece in segments:
            if state == "tool":
                self.call_text += piece
            elif self.in_call:  # the end marker just closed a call
                text, call = self._parse()
                out += text
                calls += call
            if state != "tool":
                out += piece
            self.in_call = state == "tool"
        return out, calls

    def flush(self) -> tuple[str, list[engine_pb2.ToolCall]]:
        """At the end of the answer: text held as a possible marker, and an unfinished call
        (a parser without an end marker ends its call with the answer)."""
        self.state, held, state = self.machine.flush(self.state)
        if state != "tool":
            return held, []
        self.call_text += held
        self.in_call = False
        return self._parse(closed=False)

    def _parse(self, closed: bool = True) -> tuple[str, list[engine_pb2.ToolCall]]:
        raw, self.call_text = self.call_text, ""
        try:
            parsed = self.parser(raw, self.tools)
            return "", [_openai_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
            log.warning("tool call does not parse (%s: %s); returned as text", type(e).__name__, e)
            return self.start + raw + (self.end if closed and self.end else ""), []


def _openai_call(call: dict) -> engine_pb2.ToolCall:
    arguments = call.get("arguments", {})
    return engine_pb2.ToolCall(
        id=call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
        name=str(call["name"]),
        arguments=arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
    )


def parse_tokens(tokens: Iterable[int], vocab: int) -> list[int]:
    tokens = list(tokens)
    if not tokens:
        raise BadRequest("tokens must be a non-empty list of token ids")
    for t in tokens:
        if not 0 <= t < vocab:
            raise BadRequest(f"token id {t!r} is not in [0, {vocab})")
    return tokens


def _float(key: str, v: float, *, lo: float, hi: float | None = None) -> float:
    if math.isnan(v) or v < lo or (hi is not None and v > hi):
        raise BadRequest(f"{key} must be a number in [{lo}, {hi if hi is not None else 'inf'}]")
    return float(v)
