"""Framing of the plugin → prefilld unix-socket stream (the contract with prefilld's Rust side).

Every message is::

    u32 little-endian   length of the header
    header              UTF-8 JSON object, always with "type" and "request_id"
    payload             exactly header["payload_bytes"] raw bytes (0 when the key is absent)

Message types, in stream order for one request (one connection per request; under pipeline
parallelism one per stage and request, and every message of a stage carries ``stage`` (its index)
and ``stages`` (their count): a stage's ``block`` holds only its layers, prefilld assembles a block
from every stage's, and the request ends with every stage's ``done``):

* ``block`` — one finished block: the decoder's cache, or (a request whose ``payload`` is
  ``layer_inputs``) each layer's input for the decoder to compute it. ``payload_bytes`` bytes follow;
  each entry of ``tensors`` (layers in ascending order, a layer's tensors in its codec's order)
  names a contiguous little-endian slice ``[offset, offset + nbytes)`` of the payload.
* ``done`` — end of the request's prefill: ``num_tokens`` captured, ``blocks_emitted``,
  ``timings_ms``. Last message of a successful stream.
* ``error`` — ``reason`` (machine-readable) and ``message``. Last message of a failed stream;
  blocks sent before it stay valid (each block is self-contained).

This module is pure Python (no vLLM, no MLX) so tests and tools can reuse it.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Sequence
from typing import Any, BinaryIO

_LEN = struct.Struct("<I")

# Machine-readable error reasons (the `reason` field of an `error` message).
BAD_PARAMS = "bad_params"  # the request's pdbridge params are malformed
PROMPT_TOO_SHORT = "prompt_too_short"  # requested blocks reach past the prompt
BUNDLE_UNREADABLE = "bundle_unreadable"  # the bundle file is missing or not a valid bundle
BUNDLE_MISMATCH = "bundle_mismatch"  # sha256 differs, or the bundle does not fit this engine
CAPTURE_MISSING = "capture_missing"  # a step computed tokens whose hidden states were not captured
LENGTH_MISMATCH = "length_mismatch"  # captured length != prompt length at the end of prefill
RECONSTRUCT_FAILED = "reconstruct_failed"  # MLX raised while computing a block
ABORTED = "aborted"  # the engine finished the request before its prefill completed
INTERNAL = "internal"  # anything else; the message says what


def encode_header(header: dict[str, Any]) -> bytes:
    """Length prefix + compact JSON header (no payload)."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _LEN.pack(len(raw)) + raw


def send_message(sock: socket.socket, header: dict[str, Any],
                 payload: Sequence[memoryview] = ()) -> None:
    """Send one message; `payload` parts are written back to back without joining them."""
    sock.sendall(encode_header(header))
    for part in payload:
        sock.sendall(part)


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            raise EOFError(f"stream ended after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_message(stream: BinaryIO) -> tuple[dict[str, Any], bytes] | None:
    """Read one message from a binary stream (e.g. ``sock.makefile("rb")``); None at a clean EOF."""
    first = stream.read(_LEN.size)
    if not first:
        return None
    if len(first) < _LEN.size:
        first += _read_exact(stream, _LEN.size - len(first))
    (hlen,) = _LEN.unpack(first)
    header = json.loads(_read_exact(stream, hlen))
    payload = _read_exact(stream, int(header.get("payload_bytes", 0)))
    return header, payload
