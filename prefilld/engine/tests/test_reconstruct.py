"""Bundle loading (MLX only, no vLLM): the plugin builds the decoder's cache path from the decoder's
bundle, and refuses, with its `PluginFailure`, a bundle it cannot use."""

from __future__ import annotations

import json
import shutil
import tempfile
import unittest
from pathlib import Path

import mlx.core as mx
import numpy as np

from pdbridge_cache.safetensors_io import serialize
from pdbridge_testkit import NUM_LAYERS
from pdbridge_testkit.decoder import decoder_bundle
from pdbridge_vllm import protocol, reconstruct


class BundleLoadTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="pdb-bundle-")
        cls.path, cls.sha = decoder_bundle(Path(cls.tmp.name))
        cls.arrays, cls.meta = mx.load(cls.path, return_metadata=True)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def variant(self, arrays=None, **meta) -> str:
        path = Path(self.tmp.name) / f"variant-{len(list(Path(self.tmp.name).iterdir()))}.safetensors"
        tensors = arrays if arrays is not None else self.arrays
        path.write_bytes(serialize(sorted(tensors.items()), {**self.meta, **meta}))
        return str(path)

    def refused(self, path: str, failure: int, needle: str, sha: str | None = None):
        with self.assertRaises(reconstruct.BundleError) as ctx:
            reconstruct.load(path, sha)
        self.assertEqual(ctx.exception.failure, failure, str(ctx.exception))
        self.assertIn(needle, str(ctx.exception))

    def test_the_decoders_bundle_loads_as_its_cache_path(self):
        path = reconstruct.load(self.path, self.sha)
        self.assertEqual(path.layers, list(range(NUM_LAYERS)))
        self.assertEqual((path.hidden_size, path.dtype), (576, mx.float32))
        self.assertEqual({type(t).__name__ for t in path.templates}, {"KVCache"})
        # Only the cache path's parameters travel: norms and k/v projections, no q/o, MLP or embedding.
        kinds = {name.split(".")[-2] for name in self.arrays}
        self.assertEqual(kinds, {"input_layernorm", "k_proj", "v_proj"})

    def test_dense_weights_trade_the_decoders_bits_for_dense_matmuls(self):
        """For a GPU: the weights dequantized once, the same cache to within rounding, no longer
        bit for bit the decoder's."""
        import mlx.nn as nn
        import numpy as np

        exact = reconstruct.load(self.path, self.sha)
        dense = reconstruct.load(self.path, self.sha, dense_weights=True)
        self.assertIsInstance(exact.module(0).k_proj, nn.QuantizedLinear)
        self.assertIsInstance(dense.module(0).k_proj, nn.Linear)
        hidden = np.random.default_rng(0).standard_normal((64, NUM_LAYERS, 576), dtype=np.float32)
        for (_, name, want), (_, _, got) in zip(exact.block(hidden, 100), dense.block(hidden, 100)):
            want, got = np.array(want), np.array(got)
            self.assertLess(np.abs(got - want).max(), 1e-3 * np.abs(want).max(), name)

    def test_refuses_what_it_cannot_use(self):
        self.refused(self.path, protocol.BUNDLE_MISMATCH, "sha256", sha="00" * 32)
        self.refused(self.variant(format="pdbridge-bundle-v1"), protocol.BUNDLE_MISMATCH, "format")
        self.refused(self.variant(mlx_lm="0.0.1"), protocol.BUNDLE_MISMATCH, "same mlx and mlx-lm")
        config = json.loads(self.meta["config"])
        self.refused(self.variant(config=json.dumps({**config, "model_type": "no_such_model"})),
                     protocol.BUNDLE_MISMATCH, "no_such_model")

    def test_unreadable_bundles(self):
        self.refused(self.variant(dtype="F8"), protocol.BUNDLE_UNREADABLE, "metadata")
        self.refused(self.variant(config="{not json"), protocol.BUNDLE_UNREADABLE, "metadata")
        foreign = {**self.arrays, "model.layers.0.self_attn.not_a_parameter": mx.zeros((4,))}
        self.refused(self.variant(arrays=foreign), protocol.BUNDLE_UNREADABLE, "not_a_parameter")
        self.refused("/nonexistent/bundle.safetensors", protocol.BUNDLE_UNREADABLE, "No such file")
        torn = Path(self.tmp.name) / "torn.safetensors"
        shutil.copyfile(self.path, torn)
        with open(torn, "r+b") as f:
            f.truncate(1000)
        self.refused(str(torn), protocol.BUNDLE_UNREADABLE, "torn")


class CapturedStatesTest(unittest.TestCase):
    """The states reach MLX with the values the engine captured, whatever its dtype, in the
    decoder's layer order."""

    def test_bf16_travels_as_its_bits_with_the_values_float32_has(self):
        import torch

        captured = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        states = reconstruct.captured_states(captured, [0, 1, 2], [0, 1, 2])
        self.assertEqual(states.dtype, mx.bfloat16)
        self.assertEqual(np.array(states.astype(mx.float32)).tobytes(), captured.float().numpy().tobytes())

    def test_the_decoders_layers_are_taken_in_its_order(self):
        import torch

        captured = torch.arange(2 * 4 * 3, dtype=torch.float16).reshape(2, 4, 3)
        states = reconstruct.captured_states(captured, [3, 5, 7, 9], [9, 5])
        np.testing.assert_array_equal(np.array(states), captured.float().numpy()[:, [3, 1], :])
        plain = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
        np.testing.assert_array_equal(np.array(reconstruct.captured_states(plain, [3, 5, 7, 9], [3, 5, 7, 9])), plain)


if __name__ == "__main__":
    unittest.main(verbosity=2)
