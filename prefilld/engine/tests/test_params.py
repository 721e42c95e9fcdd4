"""The plugin's request parameters (`kv_transfer_params["pdbridge"]`) read as the schema says:
proto/golden/PluginParams.json, what prefilld sends, parses; whatever the schema does not name, or
the plugin cannot serve, is refused before any work. No engine needed."""

from __future__ import annotations

import json
import unittest
from pathlib import Path

from pdbridge_vllm.streamer import CACHE, LAYER_INPUTS, BridgeParams

GOLDEN = json.loads((Path(__file__).resolve().parents[3] / "proto" / "golden" / "PluginParams.json").read_text())


class ParamsTest(unittest.TestCase):
    def test_the_golden_parameters_parse(self):
        p = BridgeParams.parse(GOLDEN)
        self.assertEqual((p.block_tokens, p.first_block, p.num_blocks, p.end_block), (256, 2, 3, 5))
        self.assertEqual((p.from_block, p.tail_tokens, p.payload), (0, 17, LAYER_INPUTS))
        self.assertEqual(p.traceparent, GOLDEN["traceparent"])

    def test_defaults_are_the_schemas(self):
        unset = ("from_block", "payload", "tail_tokens", "traceparent")
        p = BridgeParams.parse({k: v for k, v in GOLDEN.items() if k not in unset})
        self.assertEqual((p.from_block, p.tail_tokens, p.payload, p.traceparent), (p.first_block, 0, CACHE, ""))

    def test_what_the_schema_does_not_name_is_refused(self):
        without_socket = {k: v for k, v in GOLDEN.items() if k != "socket"}
        for bad, why in [({**GOLDEN, "spec_fingerprint": "00"}, "no field named"),
                         ({**GOLDEN, "payload": "layer_inputs"}, "enum"),
                         ({**GOLDEN, "first_block": -1}, "first_block"),
                         (without_socket, "required"),
                         ({**GOLDEN, "block_tokens": 0}, "block_tokens"),
                         ({**GOLDEN, "from_block": 3}, "from_block"),
                         ({**GOLDEN, "tail_tokens": 256}, "tail_tokens"),
                         ([GOLDEN], "object")]:
            with self.subTest(why), self.assertRaisesRegex(ValueError, why):
                BridgeParams.parse(bad)


if __name__ == "__main__":
    unittest.main()
