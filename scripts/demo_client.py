"""The demo's client: one long prompt through decoded's front door, bridged
then forced native, timed to the first streamed token. Standard library only.

Prints both answers to stderr and one JSON line of results to stdout.
"""

import argparse
import json
import sys
import time
import urllib.request

QUESTION = "In two sentences: what does this license let me do, and what must I keep when I redistribute?"
# For a base model (no chat template), asked through /v1/completions: the text to continue.
CONTINUE = "In short, this license lets anyone"


def ask(url: str, document: str, mode: str, api: str) -> dict:
    body = {"max_tokens": 48, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": f"{document}\n\n{QUESTION}"}]
    else:
        body["prompt"] = f"{document}\n\n{CONTINUE}"
    request = urllib.request.Request(
        f"{url}/v1/{'chat/completions' if api == 'chat' else 'completions'}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-pd-bridge-mode": mode},
    )
    started = time.monotonic()
    ttft = None
    pieces, usage = [], {}
    with urllib.request.urlopen(request, timeout=3600) as response:
        verdict = json.loads(response.headers["x-pd-bridge"])
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise SystemExit(f"{mode} request failed: {chunk['error']}")
            usage = chunk.get("usage") or usage
            # The last chunk carries only the usage (no choices).
            choice = chunk["choices"][0] if chunk["choices"] else {}
            content = choice["delta"].get("content") if "delta" in choice else choice.get("text")
            if content:
                ttft = ttft or time.monotonic() - started
                pieces.append(content)
    return {"verdict": verdict, "ttft": ttft, "text": "".join(pieces), "first": pieces[0] if pieces else "", "usage": usage}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--document", required=True)
    parser.add_argument("--api", choices=("chat", "completions"), default="chat")
    args = parser.parse_args()
    document = open(args.document, encoding="utf-8").read()

    bridged = ask(args.url, document, "bridge", args.api)
    print(f"== bridged ({bridged['ttft']:.2f} s to first token): {bridged['text']!r}", file=sys.stderr)
    print(f"   X-PD-Bridge: {json.dumps(bridged['verdict'])}", file=sys.stderr)
    native = ask(args.url, document, "native", args.api)
    print(f"== native  ({native['ttft']:.2f} s to first token): {native['text']!r}", file=sys.stderr)
    print(f"   X-PD-Bridge: {json.dumps(native['verdict'])}", file=sys.stderr)

    v = bridged["verdict"]
    covered = v["cached_tokens"]
    print(json.dumps({
        "outcome": v["outcome"],
        "prompt_tokens": v["prompt_tokens"],
        "cached_tokens": bridged["usage"].get("prompt_tokens_details", {}).get("cached_tokens", covered),
        "ttft_native_s": round(native["ttft"], 3),
        "ttft_bridged_s": round(bridged["ttft"], 3),
        # Bridged tokens: the whole blocks and the prompt's tail after them.
        "payload_bytes_per_token": (round(v["bytes"] / (v["blocks"] * v["block_tokens"] + v.get("tail_tokens", 0)))
                                    if v["blocks"] else 0),
        "same_first_token": bridged["first"] == native["first"],
    }))


if __name__ == "__main__":
    main()
