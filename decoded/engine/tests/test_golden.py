"""proto/golden/: every file (`Message[.example].json`) is one of engine.proto's messages in
proto3 JSON as the adapter prints it, and survives a round trip through the generated class.
decoded's Rust tests hold the same files to its generated types (common/src/proto.rs)."""

from __future__ import annotations

import json
import unittest
from pathlib import Path

from google.protobuf import json_format
from pdbridge_cache.proto import engine_pb2

GOLDEN = Path(__file__).resolve().parents[3] / "proto" / "golden"


class GoldenTest(unittest.TestCase):
    def test_golden_files_round_trip_through_the_engine_schema(self):
        files = sorted(GOLDEN.glob("*.json"))
        messages = {f.name.split(".")[0] for f in files}
        self.assertEqual(messages, set(engine_pb2.DESCRIPTOR.message_types_by_name), "one file per message")
        for path in files:
            with self.subTest(path.name):
                cls = getattr(engine_pb2, path.name.split(".")[0])
                text = path.read_text()
                message = json_format.Parse(text, cls())
                again = json_format.MessageToDict(message, preserving_proto_field_name=True)
                self.assertEqual(again, json.loads(text))

    def test_the_info_reply_is_the_spec_as_decoded_reads_it(self):
        info = json_format.Parse((GOLDEN / "InfoReply.json").read_text(), engine_pb2.InfoReply())
        self.assertEqual(info.spec.num_layers, len(info.spec.layers))
        self.assertTrue(all(layer.kind for layer in info.spec.layers))


if __name__ == "__main__":
    unittest.main()
