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

On prefilld's own box a block's payload may stay in the plugin's shared ring (`ring.py`): a `ring`
frame names it, the block's frame says where its payload is, and prefilld answers each such block
with a `PluginRelease` (framed the same way) once it is done with its bytes.

No vLLM, no MLX here, so tests and tools reuse it.
"""

from __future__ import annotations

import os
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
    """Reads one frame and the payload that follows it (none for a block in the ring) from a binary
    stream (e.g. ``sock.makefile("rb")``); None at a clean EOF."""
    frame = read_header(stream, engine_pb2.PluginFrame)
    if frame is None:
        return None
    inline = frame.WhichOneof("frame") == "block" and not frame.block.HasField("ring_offset")
    return frame, _read_exact(stream, frame.block.payload_bytes if inline else 0)


def read_releases(sock: socket.socket):
    """prefilld's `PluginRelease` answers on a connection, as ring offsets, until it ends the
    connection. The socket's timeout only bounds each wait: prefilld answers as the link to the
    decoder drains, which may take longer."""
    buf = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            continue
        if not chunk:
            if buf:
                raise ValueError(f"the connection ended inside an answer ({len(buf)} bytes)")
            return
        buf += chunk
        while len(buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(buf)
            if len(buf) < _LEN.size + n:
                break
            yield engine_pb2.PluginRelease.FromString(buf[_LEN.size:_LEN.size + n]).ring_offset
            buf = buf[_LEN.size + n:]


def read_frames(conn: socket.socket):
    """prefilld's reading of one plugin connection, for tests and tools: every frame and its
    payload to the connection's end. A block in the plugin's ring is copied out of it (through the
    connected process's descriptor, as prefilld maps it) and released at once; the `ring` frame
    that names the ring is not yielded."""
    pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    ring = None
    try:
        with conn.makefile("rb") as stream:
            while (msg := read_frame(stream)) is not None:
                frame, payload = msg
                if frame.WhichOneof("frame") == "ring":
                    ring = os.open(f"/proc/{pid}/fd/{frame.ring.fd}", os.O_RDONLY)
                    continue
                if frame.WhichOneof("frame") == "block" and frame.block.HasField("ring_offset"):
                    payload = os.pread(ring, frame.block.payload_bytes, frame.block.ring_offset)
                    release = engine_pb2.PluginRelease(ring_offset=frame.block.ring_offset).SerializeToString()
                    conn.sendall(_LEN.pack(len(release)) + release)
                yield frame, payload
    finally:
        if ring is not None:
            os.close(ring)
