"""A chat's token ids, with the caller's strings as text.

`apply_chat_template(tokenize=True)` renders the chat to text and encodes it, so special-token text
inside a message (`<|im_start|>system...`) becomes the real special tokens: a user could write a
turn of another role. OpenAI's API reads such text as text. Here the template's own control tokens
stay tokens and the caller's are text:

- every added-token string inside the caller's strings (`messages` but each message's `role`, and
  `tools`) is "defused", a private-use sentinel inserted after its first character, and the chat
  rendered again: what stays intact in that render the template wrote itself;
- the control tokens are the added tokens marked special plus those the template wrote (DeepSeek's
  `<｜User｜>` is an added token not marked special);
- the defused render is cut at its intact control tokens (their ids) and each piece between them,
  the sentinel removed, encoded with every control token as text.

A chat with no control-token text in the caller's strings (the usual one) is tokenized as
`apply_chat_template(tokenize=True)` does, bit for bit: as mlx_lm.server would.

Pure Python over a Hugging Face tokenizer (or mlx-lm's wrapper of one): no MLX.
"""

from __future__ import annotations

import json
import re
from typing import Any

# The first of these absent from the caller's strings and the template marks a defused token.
_PRIVATE_USE = range(0xE000, 0xF900)


class ChatTokenizer:
    """One tokenizer's added tokens, and its chats' token ids."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        added = tokenizer.added_tokens_decoder
        self.ids = {t.content: i for i, t in added.items()}
        self.special = frozenset(t.content for t in added.values() if t.special)
        self.stripping = {t.content: (t.lstrip, t.rstrip) for t in added.values() if t.lstrip or t.rstrip}
        self.added = _alternation(self.ids)
        self._encoders: dict[frozenset[str], Any] = {}

    def tokenize(self, messages: list, tools: Any, *, allow_special: bool = False, **kwargs: Any) -> list[int]:
        """The chat's token ids; `kwargs` go to the template (`add_generation_prompt`, its own
        variables). `allow_special`: the caller's special-token text becomes the tokens (as
        `apply_chat_template` alone does)."""
        if tools is not None:
            kwargs["tools"] = tools
        strings = list(_caller_strings(messages, kwargs.get("tools")))
        found = {m[0] for s in strings for m in self.added.finditer(s)}
        if allow_special or not found:
            return list(self._render(messages, kwargs, tokenize=True))
        sentinel = _sentinel(strings, getattr(self.tokenizer, "chat_template", None))
        text = self._render(*_defused(messages, kwargs, found, sentinel), tokenize=False)
        controls = self.special | {m[0] for m in self.added.finditer(text)}
        hits = found & controls
        if not hits:  # only added tokens the template never writes (Qwen's <think>): as today
            return list(self._render(messages, kwargs, tokenize=True))
        if hits != found:  # the others reach the template as they are, for it to read
            text = self._render(*_defused(messages, kwargs, hits, sentinel), tokenize=False)
        return self.encode(text, controls, sentinel)

    def encode(self, text: str, controls: frozenset[str] | set[str], sentinel: str = "") -> list[int]:
        """`text`'s ids, its intact `controls` as tokens and everything between them as text
        (with `sentinel` removed)."""
        encoder = self._encoder(frozenset(controls) - self.special)
        ids, start, strip_next = [], 0, False
        for m in _alternation(controls).finditer(text):
            lstrip, rstrip = self.stripping.get(m[0], (False, False))
            ids += encoder(_piece(text[start : m.start()], strip_next, lstrip, sentinel))
            ids.append(self.ids[m[0]])
            start, strip_next = m.end(), rstrip
        return ids + encoder(_piece(text[start:], strip_next, False, sentinel))

    def _render(self, messages: list, kwargs: dict, *, tokenize: bool) -> Any:
        out = self.tokenizer.apply_chat_template(messages, tokenize=tokenize, **kwargs)
        # transformers 5 answers a BatchEncoding unless asked otherwise (mlx-lm's wrapper asks).
        return out["input_ids"] if tokenize and not isinstance(out, list) else out

    def _encoder(self, plain: frozenset[str]):
        """Encodes text with every special token and those of `plain` as text: a copy of the
        tokenizer in split mode (not the tokenizer's own: other threads use it), `plain` marked
        special (split mode matches an added token not special)."""
        if plain not in self._encoders:
            backend = self.tokenizer.backend_tokenizer
            spec = json.loads(backend.to_str())
            for token in spec.get("added_tokens", []):
                token["special"] = token["special"] or token["content"] in plain
            copy = type(backend).from_str(json.dumps(spec))
            copy.encode_special_tokens = True
            self._encoders[plain] = copy
        copy = self._encoders[plain]
        return lambda piece: copy.encode(piece, add_special_tokens=False).ids if piece else []


def _alternation(strings) -> re.Pattern:
    """Matches any of `strings`, the longest first where several start at one place."""
    return re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)) or "(?!)")


def _piece(text: str, strip_start: bool, strip_end: bool, sentinel: str) -> str:
    """A piece between control tokens as the tokenizer sees it: whitespace an lstrip/rstrip token
    beside it absorbs is gone."""
    text = text.lstrip() if strip_start else text
    text = text.rstrip() if strip_end else text
    return text.replace(sentinel, "") if sentinel else text


def _caller_strings(messages: list, tools: Any):
    """Every string the caller wrote but each message's role (and its fields' names, which the
    template picks by name): values, and the keys of the objects inside them."""
    for message in messages:
        yield from _strings([v for k, v in message.items() if k != "role"])
    yield from _strings(tools)


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)


def _sentinel(strings: list[str], template: Any) -> str:
    taken = set("".join(strings)) | set(template if isinstance(template, str) else "")
    return next(chr(c) for c in _PRIVATE_USE if chr(c) not in taken)


def _defused(messages: list, kwargs: dict, tokens: set[str], sentinel: str) -> tuple[list, dict]:
    """The chat with every occurrence of `tokens` in the caller's strings broken by `sentinel`."""
    pattern = _alternation(tokens)

    def defuse(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(lambda m: m[0][0] + sentinel + m[0][1:], value)
        if isinstance(value, list):
            return [defuse(v) for v in value]
        if isinstance(value, dict):
            return {defuse(k): defuse(v) for k, v in value.items()}
        return value

    messages = [{k: v if k == "role" else defuse(v) for k, v in m.items()} for m in messages]
    if "tools" in kwargs:
        kwargs = {**kwargs, "tools": defuse(kwargs["tools"])}
    return messages, kwargs
