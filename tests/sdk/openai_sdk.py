"""The front door as OpenAI's own Python SDK uses it (the `openai` package vLLM installs).

    .venv/bin/python tests/sdk/openai_sdk.py --url http://127.0.0.1:8080 --model smollm2 --api-key KEY [--checks api]

Run by the end-to-end tests against a real decoded: `load::the_openai_sdk_is_answered_as_openai_answers`
(`--checks api`, on a generated checkpoint) and `load::tool_calls_the_model_makes_reach_the_sdk_parsed`
(`--checks tool-calls`, on SmolLM2). Exits non-zero with the failed check's message; prints one line
per check that passed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

import openai

CHAT = [{"role": "user", "content": "Name three colours, then count from one to ten."}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def weather_chat(city: str) -> list[dict]:
    """Two questions the assistant answered with calls, then a new one: the model follows suit."""
    chat = []
    for i, earlier in enumerate(("Berlin", "Rome")):
        chat += [{"role": "user", "content": f"What is the weather in {earlier}?"},
                 {"role": "assistant", "content": None, "tool_calls": [{
                     "id": f"call_{i}", "type": "function",
                     "function": {"name": "get_weather", "arguments": f'{{"city": "{earlier}"}}'}}]}]
    return chat + [{"role": "user", "content": f"What is the weather in {city}?"}]


Check = Callable[..., None]


def api_checks(client: openai.OpenAI, model: str, url: str, check: Check) -> None:
    """What the front door answers whatever the model: shapes, streaming, parameters, errors."""
    check("models", [m.id for m in client.models.list().data] == [model])

    whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    answer = whole.choices[0].message.content
    check("chat", bool(answer) and whole.usage.completion_tokens > 0, whole)

    # With `include_usage`, as OpenAI streams it: the usage comes alone, in a last chunk with no
    # choices; without it, no chunk carries any.
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    pieces = [c.delta.content or "" for chunk in chunks for c in chunk.choices]
    last = chunks[-1]
    check("chat stream", "".join(pieces) == answer and last.choices == [] and last.usage is not None
          and last.usage.completion_tokens == whole.usage.completion_tokens
          and all(chunk.usage is None for chunk in chunks[:-1]), chunks)
    plain = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0, stream=True))
    check("chat stream without usage", all(chunk.usage is None and chunk.choices for chunk in plain), plain)

    text = client.completions.create(model=model, prompt="One, two, three,", max_tokens=6, temperature=0)
    check("completions", bool(text.choices[0].text), text)

    # `stop` ends the answer before the sequence, streamed or not.
    stop = answer[len(answer) // 2:len(answer) // 2 + 3]
    cut = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0, stop=[stop])
    content = cut.choices[0].message.content
    check("stop", stop not in content and answer.startswith(content) and cut.choices[0].finish_reason == "stop",
          (stop, content, answer))
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=12, temperature=0, stop=stop, stream=True) if c.choices)
    check("stop stream", streamed == content, (streamed, content))

    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    listed = client.chat.completions.create(model=model, messages=parts, max_tokens=12, temperature=0)
    check("list content", listed.choices[0].message.content == answer, listed)

    # Log probabilities: one entry per generated token; greedy picks the most likely.
    lp = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0,
                                        logprobs=True, top_logprobs=2)
    entries = lp.choices[0].logprobs.content
    check("logprobs", len(entries) == lp.usage.completion_tokens
          and all(len(e.top_logprobs) == 2 and e.token == e.top_logprobs[0].token
                  and abs(e.logprob - e.top_logprobs[0].logprob) < 1e-5
                  and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries), entries)
    streamed = [e for c in client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, stream=True)
        if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    check("logprobs stream", [e.token for e in streamed] == [e.token for e in entries], streamed)
    legacy = client.completions.create(model=model, prompt="One, two, three,", max_tokens=4, temperature=0,
                                       logprobs=2)
    check("completions logprobs", len(legacy.choices[0].logprobs.tokens) == legacy.usage.completion_tokens
          and all(len(t) <= 2 for t in legacy.choices[0].logprobs.top_logprobs), legacy.choices[0].logprobs)

    # Sampling with a seed is reproducible; penalties are applied (and accepted).
    seeded = [client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=1.0,
                                             seed=7).choices[0].message.content for _ in range(2)]
    check("seed", seeded[0] == seeded[1], seeded)
    penalized = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0,
                                               presence_penalty=2.0, frequency_penalty=2.0)
    check("penalties", bool(penalized.choices[0].message.content), penalized)

    # Errors in OpenAI's shape, as the SDK's own exception types.
    try:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=10**6)
        check("context length", False, "answered")
    except openai.BadRequestError as e:
        check("context length", e.code == "context_length_exceeded", e)
    for name, value in (("echo", True), ("suffix", " and so on.")):
        try:
            client.completions.create(model=model, prompt="One, two, three,", max_tokens=4, **{name: value})
            check(f"{name} refused", False, "answered")
        except openai.BadRequestError as e:
            check(f"{name} refused", f"`{name}` is not supported" in str(e), e)
    try:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)
        check("unknown model", False, "answered")
    except openai.NotFoundError as e:
        check("unknown model", e.code == "model_not_found", e)
    # n answers from one restored prompt: greedy ones are the same answer.
    two = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0, n=2)
    check("n=2", [c.index for c in two.choices] == [0, 1]
          and all(c.message.content == answer for c in two.choices)
          and two.usage.completion_tokens == 2 * whole.usage.completion_tokens, two)
    by_index: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0, n=2,
                                                stream=True):
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + (c.delta.content or "")
    check("n=2 stream", by_index == {0: answer, 1: answer}, by_index)

    try:
        client.chat.completions.create(model=model, messages=CHAT, tools=WEATHER, tool_choice="required")
        check("forced tool call", False, "answered")
    except openai.BadRequestError as e:
        check("forced tool call", "tool_choice" in str(e), e)
    try:
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()
        check("wrong key", False, "answered")
    except openai.AuthenticationError as e:
        check("wrong key", e.code == "invalid_api_key", e)


def tool_call_checks(client: openai.OpenAI, model: str, check: Check) -> None:
    """Tool calls the model makes (decoded serves a chat template that renders tools): parsed,
    never shown as text. Needs a model that calls tools when asked as the chat shows it."""
    called = client.chat.completions.create(model=model, messages=weather_chat("Paris"), tools=WEATHER,
                                            max_tokens=40, temperature=0)
    choice = called.choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    check("tool call", choice.finish_reason == "tool_calls" and calls == [("get_weather", {"city": "Paris"})]
          and not choice.message.content, called)
    deltas, finish = [], None
    for chunk in client.chat.completions.create(model=model, messages=weather_chat("Oslo"), tools=WEATHER,
                                                max_tokens=40, temperature=0, stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    check("tool call stream", finish == "tool_calls" and [(d.index, d.function.name, json.loads(d.function.arguments))
                                                          for d in deltas] == [(0, "get_weather", {"city": "Oslo"})],
          (deltas, finish))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", required=True)
    p.add_argument("--checks", choices=("all", "api", "tool-calls"), default="all",
                   help="api: what the front door answers whatever the model; tool-calls: calls the model makes")
    args = p.parse_args()
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, max_retries=0, timeout=600)

    def check(name: str, ok: bool, detail: object = "") -> None:
        if not ok:
            sys.exit(f"FAIL {name}: {detail}")
        print(f"ok   {name}")

    if args.checks in ("all", "api"):
        api_checks(client, args.model, args.url, check)
    if args.checks in ("all", "tool-calls"):
        tool_call_checks(client, args.model, check)

if __name__ == "__main__":
    main()
