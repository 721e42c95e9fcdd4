"""Bundle validation (MLX only, no vLLM): the plugin refuses what it would not reproduce exactly."""

from __future__ import annotations

import tempfile
import unittest
from pathlib import Path

import support  # noqa: F401  (puts prefilld/engine on sys.path)

import mlx.core as mx  # noqa: E402

from pdbridge_vllm import protocol  # noqa: E402
from pdbridge_vllm.reconstruct import Bundle, BundleError  # noqa: E402


class BundleValidationTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="pdb-bundle-")
        path, _ = support.decoder_bundle(Path(cls.tmp.name))
        cls.arrays, cls.meta = mx.load(path, return_metadata=True)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def refused(self, arrays=None, reason=protocol.BUNDLE_MISMATCH, **meta):
        md = {**self.meta, **meta}
        with self.assertRaises(BundleError) as ctx:
            Bundle(arrays if arrays is not None else self.arrays, md, "00")
        self.assertEqual(ctx.exception.reason, reason, str(ctx.exception))

    def test_the_decoders_bundle_loads(self):
        b = Bundle(self.arrays, self.meta, "00")
        self.assertEqual(b.layers, list(range(support.NUM_LAYERS)))
        self.assertEqual((b.num_kv_heads, b.head_dim, b.hidden_size, b.group_size, b.bits),
                         (3, 64, 576, 32, 4))
        self.assertEqual((b.eps, b.rope_theta, b.rope_traditional), (1e-5, 1e5, False))

    def test_refuses_what_it_cannot_reproduce(self):
        self.refused(quant_mode="mxfp4")
        self.refused(quant_mode="none", bits="0", group_size="0")
        self.refused(dtype="F16")
        self.refused(format="something-else")
        knorm = {**self.arrays, "model.layers.0.self_attn.k_norm.weight": mx.ones((64,))}
        self.refused(arrays=knorm)

    def test_unreadable_bundles(self):
        self.refused(reason=protocol.BUNDLE_UNREADABLE, num_layers="31")
        meta = dict(self.meta)
        del meta["rope_theta"]
        with self.assertRaises(BundleError) as ctx:
            Bundle(self.arrays, meta, "00")
        self.assertEqual(ctx.exception.reason, protocol.BUNDLE_UNREADABLE)
        partial = {k: v for k, v in self.arrays.items() if "layers.3.self_attn.v_proj" not in k}
        self.refused(arrays=partial, reason=protocol.BUNDLE_UNREADABLE)
        with self.assertRaises(BundleError) as ctx:
            Bundle.load("/nonexistent/bundle.safetensors", None)
        self.assertEqual(ctx.exception.reason, protocol.BUNDLE_UNREADABLE)


if __name__ == "__main__":
    unittest.main(verbosity=2)
