"""Deterministic safetensors writing for MLX arrays.

`mx.save_safetensors` lays tensors out in hash-map order, so the same arrays
can give different bytes from run to run. The bundle's SHA-256 is part of the
decoder's spec fingerprint and must be stable across restarts, so we write the
(simple) format ourselves: 8-byte little-endian header length, a compact JSON
header with sorted keys padded with spaces to 8 bytes, then each tensor's
C-contiguous little-endian bytes in the order given, with no gaps.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Iterable, Mapping

import mlx.core as mx
import numpy as np

from .format import SAFETENSORS_DTYPES

# MLX's dtypes by their safetensors names (a cache spec's dtypes are pdbridge.v1.Dtype's names for them).
DTYPE_NAMES = dict(zip((mx.float32, mx.float16, mx.bfloat16, mx.uint32, mx.int32, mx.uint8), SAFETENSORS_DTYPES))

if sys.byteorder != "little":  # numpy's native order is what we write
    raise ImportError("pd-bridge writes little-endian files and needs a little-endian host")


def dtype_name(dtype: mx.Dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no pd-bridge wire name") from None


def tensor_bytes(array: mx.array) -> memoryview:
    """The array's elements as C-contiguous little-endian bytes: a view of MLX's buffer when that
    is already contiguous (one copy otherwise), so the hot path never copies a block twice."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)  # numpy has no bfloat16; the bits are what we want
    return memoryview(np.ascontiguousarray(np.asarray(array))).cast("B")


def serialize(tensors: Iterable[tuple[str, mx.array]], metadata: Mapping[str, str]) -> bytes:
    """One safetensors file, byte-for-byte a function of its inputs."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    chunks: list[bytes] = []
    offset = 0
    for name, array in tensors:
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r}")
        data = tensor_bytes(array)
        header[name] = {
            "dtype": dtype_name(array.dtype),
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([len(text).to_bytes(8, "little"), text, *chunks])


def write_atomic(path: str, data: bytes) -> None:
    """Writes `data` to a temp name beside `path`, fsyncs, renames: readers see
    the old file or the whole new one, never a torn write."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
