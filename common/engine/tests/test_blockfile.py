"""Block file metadata (pdbridge_cache.blockfile) is proto/engine.proto's `BlockMetadata`, as
decoded's store writes and reads it (decoded/src/store.rs holds the same golden file)."""

from __future__ import annotations

import unittest
from pathlib import Path

import mlx.core as mx
from google.protobuf import json_format
from pdbridge_cache import blockfile
from pdbridge_cache.proto import engine_pb2

GOLDEN = Path(__file__).resolve().parents[3] / "proto" / "golden" / "BlockMetadata.json"


class BlockFileTest(unittest.TestCase):
    def test_the_golden_metadata_survives_a_file(self):
        golden = json_format.Parse(GOLDEN.read_text(), engine_pb2.BlockMetadata())
        meta = blockfile.metadata(golden)
        self.assertEqual(set(meta), {"format", blockfile.KEY})
        self.assertEqual(blockfile.read(meta), golden)

    def test_another_format_or_a_damaged_record_is_refused_by_name(self):
        golden = blockfile.metadata(json_format.Parse(GOLDEN.read_text(), engine_pb2.BlockMetadata()))
        for meta, needle in [
            (None, "format=None"),
            ({"format": "pdbridge-block-v1", "pdb_block": "0"}, "format='pdbridge-block-v1'"),
            ({**golden, blockfile.KEY: "{not json"}, "no BlockMetadata"),
            ({**golden, blockfile.KEY: '{"index": 1, "no_such_field": 2}'}, "no BlockMetadata"),
        ]:
            with self.subTest(needle), self.assertRaisesRegex(ValueError, needle):
                blockfile.read(meta)

    def test_the_digest_covers_every_byte_in_name_order(self):
        a = {"0.keys": mx.arange(4, dtype=mx.float32), "1.keys": mx.ones((2,), dtype=mx.bfloat16)}
        flipped = {**a, "1.keys": mx.array([1.0, 1.0078125], dtype=mx.bfloat16)}
        self.assertNotEqual(blockfile.data_sha256(a), blockfile.data_sha256(flipped))
        self.assertEqual(blockfile.data_sha256(a), blockfile.data_sha256(dict(reversed(a.items()))))


if __name__ == "__main__":
    unittest.main()
