"""The front door as the official SDKs use it: OpenAI's `openai` (chat, completions, responses)
and Anthropic's `anthropic` (messages), both of which vLLM installs.

    .venv/bin/python tests/sdk/clients.py --url http://127.0.0.1:8080 --model smollm2 --api-key KEY \
        [--checks chat,responses,messages,tool-calls]

Run by the end-to-end tests against a real decoded: `load::the_official_sdks_are_answered_as_their_apis_answer`
(chat, responses and messages, on a generated checkpoint) and
`load::tool_calls_the_model_makes_reach_the_sdks_parsed` (tool-calls, on SmolLM2). Exits non-zero with
the failed check's message; prints one line per check that passed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

import anthropic
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


def chat_checks(client: openai.OpenAI, model: str, url: str, check: Check) -> str:
    """Chat and completions as the front door answers them whatever the model: shapes, streaming,
    parameters, errors. Returns the chat's greedy answer to CHAT (12 tokens)."""
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
    return answer


def responses_checks(client: openai.OpenAI, model: str, answer: str, check: Check) -> None:
    """OpenAI's Responses API: the chat's answer, whole and as typed events; a conversation with a
    function call's output; what a stateless server refuses."""
    text = CHAT[0]["content"]
    whole = client.responses.create(model=model, input=text, max_output_tokens=12, temperature=0)
    check("responses", whole.output_text == answer and whole.status in ("completed", "incomplete")
          and whole.usage.output_tokens > 0, whole)
    deltas, kinds, final = [], [], None
    # `response.incomplete` ends the stream when `max_output_tokens` cut the answer, as OpenAI's
    # does (the SDK's helper only finalizes `response.completed`): read the events as they come.
    with client.responses.stream(model=model, input=text, max_output_tokens=12, temperature=0) as events:
        for event in events:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    check("responses stream", "".join(deltas) == answer and final.output_text == answer
          and kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
          and final.usage.output_tokens == whole.usage.output_tokens, (kinds, final))
    conversation = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C."},
    ]
    after_call = client.responses.create(model=model, input=conversation, instructions="Answer in one line.",
                                         max_output_tokens=6, temperature=0)
    check("responses with a call's output", after_call.output_text != "" and after_call.usage.input_tokens > 0,
          after_call)
    try:
        client.responses.create(model=model, input=text, previous_response_id="resp_earlier")
        check("responses previous_response_id", False, "answered")
    except openai.BadRequestError as e:
        check("responses previous_response_id", "previous_response_id" in str(e), e)


def messages_checks(url: str, api_key: str, model: str, answer: str, check: Check) -> None:
    """Anthropic's Messages API through its own SDK (its `x-api-key` header): the chat's answer,
    whole and streamed, a stop sequence, usage and token counts, and errors as its exception types and
    shapes. The SDK no longer
    offers `temperature`; the API's older clients send it, so greedy answers ask for it that way."""
    client = anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=600)
    greedy = {"extra_body": {"temperature": 0}}
    whole = client.messages.create(model=model, messages=CHAT, max_tokens=12, **greedy)
    check("messages", [b.type for b in whole.content] == ["text"] and whole.content[0].text == answer
          and whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens > 0, whole)
    with client.messages.stream(model=model, messages=CHAT, max_tokens=12, **greedy) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    check("messages stream", streamed == answer and final.content[0].text == answer
          and final.usage.output_tokens == whole.usage.output_tokens
          and final.usage.input_tokens == whole.usage.input_tokens, final)
    stop = answer[len(answer) // 2:len(answer) // 2 + 3]
    cut = client.messages.create(model=model, messages=CHAT, max_tokens=12, stop_sequences=[stop], **greedy)
    check("messages stop_sequences", answer.startswith(cut.content[0].text) and stop not in cut.content[0].text
          and (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop), (stop, cut))
    system = client.messages.create(model=model, system="Answer in French.", messages=CHAT, max_tokens=4)
    as_chat = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0).chat.completions.create(
        model=model, messages=[{"role": "system", "content": "Answer in French."}, *CHAT], max_tokens=4)
    check("messages system", system.usage.input_tokens == as_chat.usage.prompt_tokens, (system.usage, as_chat.usage))
    counted = [client.messages.count_tokens(model=model, messages=CHAT, **extra).input_tokens
               for extra in ({}, {"system": "Answer in French."})]
    check("messages count_tokens", counted == [whole.usage.input_tokens, system.usage.input_tokens],
          (counted, whole.usage, system.usage))
    try:
        client.messages.create(model=model, messages=CHAT, max_tokens=4, extra_body={"top_k": 5})
        check("messages top_k refused", False, "answered")
    except anthropic.BadRequestError as e:
        check("messages top_k refused", "top_k" in str(e) and e.body["error"]["type"] == "invalid_request_error", e)
    try:
        anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0).messages.create(
            model=model, messages=CHAT, max_tokens=4)
        check("messages wrong key", False, "answered")
    except anthropic.AuthenticationError as e:
        check("messages wrong key", e.status_code == 401 and e.body["type"] == "error"
              and e.body["error"]["type"] == "authentication_error", e)
    try:
        client.messages.create(model="claude-opus", messages=CHAT, max_tokens=4)
        check("messages unknown model", False, "answered")
    except anthropic.NotFoundError as e:
        check("messages unknown model", e.body["error"]["type"] == "not_found_error", e)


def tool_call_checks(client: openai.OpenAI, model: str, url: str, api_key: str, check: Check) -> None:
    """Tool calls the model makes (decoded serves a chat template that renders tools): parsed,
    never shown as text, in each API: chat streamed, Responses whole, Messages streamed. Needs a model that calls tools when asked as the chat shows it."""
    # Chat's whole answer with calls is what the Responses API's answer below is made from.
    deltas, finish = [], None
    for chunk in client.chat.completions.create(model=model, messages=weather_chat("Oslo"), tools=WEATHER,
                                                max_tokens=40, temperature=0, stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    check("tool call stream", finish == "tool_calls" and [(d.index, d.function.name, json.loads(d.function.arguments))
                                                          for d in deltas] == [(0, "get_weather", {"city": "Oslo"})],
          (deltas, finish))

    # The same conversation in the Responses API's items, and in Anthropic's blocks, streamed.
    items = []
    for turn in weather_chat("Rome")[:-1]:
        for call in turn.get("tool_calls") or []:
            items.append({"type": "function_call", "call_id": call["id"], **call["function"]})
        if turn["role"] == "user":
            items.append(turn)
    items.append({"role": "user", "content": "What is the weather in Lima?"})
    tools = [{"type": "function", **tool["function"]} for tool in WEATHER]
    response = client.responses.create(model=model, input=items, tools=tools, max_output_tokens=40, temperature=0)
    made = [(o.type, o.name, json.loads(o.arguments)) for o in response.output]
    check("responses tool call", made == [("function_call", "get_weather", {"city": "Lima"})], response)

    turns = []
    for turn in weather_chat("Kyiv"):
        if turn["role"] == "assistant":
            turns.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in turn["tool_calls"]]})
        else:
            turns.append(turn)
    claude = anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=600)
    tool = {"name": WEATHER[0]["function"]["name"], "description": WEATHER[0]["function"]["description"],
            "input_schema": WEATHER[0]["function"]["parameters"]}
    with claude.messages.stream(model=model, messages=turns, tools=[tool], max_tokens=40,
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    used = [(b.type, b.name, b.input) for b in final.content if b.type == "tool_use"]
    check("messages tool use stream", used == [("tool_use", "get_weather", {"city": "Kyiv"})]
          and final.stop_reason == "tool_use", final)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", required=True)
    p.add_argument("--checks", default="chat,responses,messages,tool-calls",
                   help="comma-separated: chat, responses, messages (whatever the model says), tool-calls "
                        "(calls the model makes)")
    args = p.parse_args()
    checks = set(args.checks.split(","))
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, max_retries=0, timeout=600)

    def check(name: str, ok: bool, detail: object = "") -> None:
        if not ok:
            sys.exit(f"FAIL {name}: {detail}")
        print(f"ok   {name}")

    if checks & {"chat", "responses", "messages"}:
        answer = chat_checks(client, args.model, args.url, check)
        if "responses" in checks:
            responses_checks(client, args.model, answer, check)
        if "messages" in checks:
            messages_checks(args.url, args.api_key, args.model, answer, check)
    if "tool-calls" in checks:
        tool_call_checks(client, args.model, args.url, args.api_key, check)

if __name__ == "__main__":
    main()
