"""The cache codec on the real mlx-lm (MLX only, no vLLM, no daemons): for each cache kind and dtype
the decoder runs, the cache path rebuilt from the decoder's bundle reproduces the decoder's own
cache bit for bit from the decoder's own layer inputs, and a cache restored from the decoder's rows
generates exactly what the decoder generates natively."""

from __future__ import annotations

import sys
import tempfile
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "decoded" / "engine"))

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import ArraysCache, make_prompt_cache  # noqa: E402

from pdbridge_cache import kinds  # noqa: E402
from pdbridge_cache.check import native_prefill, same_input  # noqa: E402
from pdbridge_cache.layers import CachePath  # noqa: E402
from pdbridge_mlx.engine import Engine  # noqa: E402

MODEL = REPO / "models" / "tiny-llama3-mlx"
BLOCK = 64
STEP = 96  # native prefill chunks that do not line up with blocks


def prompt(n: int) -> list[int]:
    from tokenizers import Tokenizer

    text = (REPO / "LICENSE").read_text()
    return Tokenizer.from_file(str(MODEL / "tokenizer.json")).encode(text).ids[:n]


class CacheKindsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="pdb-kinds-")
        cls.tokens = prompt(5 * BLOCK + 17)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def engine(self, dtype, kv_bits=None, kv_group_size=64) -> Engine:
        return Engine(str(MODEL), block_tokens=BLOCK, dtype=dtype, bundle_dir=self.tmp.name,
                      kv_bits=kv_bits, kv_group_size=kv_group_size)

    def test_reconstruction_from_the_bundle_is_the_decoders_cache(self):
        cases = [(mx.float32, None, 64, "KVCache"), (mx.bfloat16, None, 64, "KVCache"),
                 (mx.float32, 4, 32, "QuantizedKVCache"), (mx.bfloat16, 8, 64, "QuantizedKVCache")]
        for dtype, bits, group, cls_name in cases:
            with self.subTest(dtype=str(dtype), kv_bits=bits):
                engine = self.engine(dtype, bits, group)
                layer = engine.spec["layers"][0]
                self.assertEqual((layer["cache_class"], layer["kind"], layer["kv_bits"]), (cls_name, kinds.ROWS, bits or 0))
                path = CachePath.from_bundle(str(engine.bundle_path))
                result = same_input(engine.model, path, self.tokens, BLOCK, STEP, engine.kv_args)
                per_block = len(layer["tensors"]) * engine.num_layers
                self.assertEqual(result.tensors_total, 5 * per_block)
                self.assertEqual(result.tensors_exact, result.tensors_total, result)

    def test_a_restored_cache_generates_what_the_decoder_generates(self):
        for dtype, bits in [(mx.float32, None), (mx.bfloat16, 4)]:
            with self.subTest(dtype=str(dtype), kv_bits=bits):
                engine = self.engine(dtype, bits, 32)
                native, _ = native_prefill(engine.model, self.tokens, STEP, engine.kv_args)
                n = 3 * BLOCK
                rows = [{k: a[..., :n, :] for k, a in kinds.codec_for(c).rows(c).items()} for c in native]
                restored = kinds.restore(engine.templates, rows, n)

                def greedy(cache, tokens):
                    steps = generate_step(mx.array(tokens), engine.model, prompt_cache=cache, max_tokens=12,
                                          prefill_step_size=STEP, **engine.kv_args)
                    return [int(t) for t, _ in steps]

                # Native: the model's plain caches, quantized by generate_step as it goes.
                self.assertEqual(greedy(restored, self.tokens[n:]), greedy(make_prompt_cache(engine.model), self.tokens))

    def test_a_cache_without_a_codec_is_described_as_unsupported(self):
        cache = ArraysCache(2)
        layer = kinds.describe(3, cache)
        self.assertEqual((layer["kind"], layer["index"], layer["tensors"]), (kinds.UNSUPPORTED, 3, []))
        self.assertIn("recurrent state", layer["unsupported_reason"])
        with self.assertRaises(kinds.UnsupportedCache):
            kinds.codec_for(cache)


if __name__ == "__main__":
    unittest.main(verbosity=2)
