"""A block file's metadata: proto/engine.proto's `BlockMetadata`, which decoded's store writes and
reads in Rust, written and read here for the adapter's export and restore and for tools.

A block file is safetensors, tensors named "{layer}.{tensor}", its metadata
``{"format": FORMAT, "pdbridge": <the BlockMetadata's proto3 JSON>}``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import mlx.core as mx
from google.protobuf import json_format

from .proto import engine_pb2
from .safetensors_io import tensor_bytes

FORMAT = "pdbridge-block-v2"
KEY = "pdbridge"


def metadata(block: engine_pb2.BlockMetadata) -> dict[str, str]:
    """The safetensors metadata of a block file."""
    text = json_format.MessageToJson(block, preserving_proto_field_name=True, indent=None)
    return {"format": FORMAT, KEY: text}


def read(meta: Mapping[str, str] | None) -> engine_pb2.BlockMetadata:
    """A block file's `BlockMetadata`; ValueError naming what is wrong for another file."""
    meta = meta or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"metadata format={meta.get('format')!r}, expected {FORMAT!r}")
    try:
        return json_format.Parse(meta.get(KEY, ""), engine_pb2.BlockMetadata())
    except json_format.ParseError as e:
        raise ValueError(f"metadata {KEY} is no BlockMetadata: {e}") from None


def data_sha256(arrays: Mapping[str, mx.array]) -> str:
    """`BlockMetadata.data_sha256`: SHA-256 of the tensors' bytes, tensor by tensor in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(tensor_bytes(arrays[name]))
    return digest.hexdigest()
