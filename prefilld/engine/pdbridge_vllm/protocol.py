"""Framing of the plugin → prefilld stream (the contract with prefilld's Rust side,
`prefilld/src/capture.rs`), on its unix socket or, from another box, its stage listener over TLS
(`link`); proto/engine.proto's `PluginFrame` documents every field.

Every frame is::

    u32 little-endian   length of the header
    header              a `PluginFrame`, protobuf's binary encoding
    payload             a block's `payload_bytes` raw bytes (none for `done` and `error`)

A request's stream (one connection per request; under pipeline parallelism one per stage and
request, each frame naming its `stage` and the `stages`): a `block` frame per finished block, then
one `done`, or one `error` (blocks sent before it stay valid: each is self-contained).

No vLLM, no MLX here, so tests and tools reuse it.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import BinaryIO

from pdbridge_cache.proto import engine_pb2

_LEN = struct.Struct("<I")

# Why the plugin failed a request (`PluginError.failure`).
BAD_PARAMS = engine_pb2.PLUGIN_FAILURE_BAD_PARAMS
PROMPT_TOO_SHORT = engine_pb2.PLUGIN_FAILURE_PROMPT_TOO_SHORT
BUNDLE_UNREADABLE = engine_pb2.PLUGIN_FAILURE_BUNDLE_UNREADABLE
BUNDLE_MISMATCH = engine_pb2.PLUGIN_FAILURE_BUNDLE_MISMATCH
CAPTURE_MISSING = engine_pb2.PLUGIN_FAILURE_CAPTURE_MISSING
LENGTH_MISMATCH = engine_pb2.PLUGIN_FAILURE_LENGTH_MISMATCH
RECONSTRUCT_FAILED = engine_pb2.PLUGIN_FAILURE_RECONSTRUCT_FAILED
ABORTED = engine_pb2.PLUGIN_FAILURE_ABORTED
INTERNAL = engine_pb2.PLUGIN_FAILURE_INTERNAL


def encode_header(frame: engine_pb2.PluginFrame) -> bytes:
    """Length prefix + the frame (no payload)."""
    raw = frame.SerializeToString()
    return _LEN.pack(len(raw)) + raw


def send_frame(sock: socket.socket, frame: engine_pb2.PluginFrame,
               payload: Sequence[memoryview] = ()) -> None:
    """Sends one frame; `payload` parts are written back to back without joining them."""
    sock.sendall(encode_header(frame))
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


def read_header(stream: BinaryIO, message_class):
    """Reads one length-prefixed message of `message_class` (a `PluginFrame`, or prefilld's
    `BundleReply`); None at a clean EOF."""
    first = stream.read(_LEN.size)
    if not first:
        return None
    if len(first) < _LEN.size:
        first += _read_exact(stream, _LEN.size - len(first))
    (hlen,) = _LEN.unpack(first)
    return message_class.FromString(_read_exact(stream, hlen))


def read_frame(stream: BinaryIO) -> tuple[engine_pb2.PluginFrame, bytes] | None:
    """Reads one frame and its payload from a binary stream (e.g. ``sock.makefile("rb")``); None at
    a clean EOF."""
    frame = read_header(stream, engine_pb2.PluginFrame)
    if frame is None:
        return None
    size = frame.block.payload_bytes if frame.WhichOneof("frame") == "block" else 0
    return frame, _read_exact(stream, size)
