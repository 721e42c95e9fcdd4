"""The capture in vLLM's own DeepSeek-V4.1 class (CUDA), on CPU: what it hands out as a layer's
attention input is what the decoder's model defines as one, and vLLM's layer then runs on exactly
that. vLLM's model cannot be built without a GPU, and its two hyper-connection kernels are Triton
and TileLang: here they are replaced by vLLM's own torch references of them (`mhc_post_torch`; the
collapse of `mhc_pre_delayed_torch`), and the inputs come from the plugin's CPU class on the
published-format checkpoint, whose attention inputs are the decoder's (test_deepseek_v41.py). The
class swap is checked on a stand-in for vLLM's layer that records what it is given. The GPU run
(bench/gpu) is where the real kernels meet it."""

from __future__ import annotations

import json
import os
import unittest
from unittest import mock

import torch
from safetensors.torch import load_file
from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

from pdbridge_vllm import deepseek_v41, deepseek_v41_cuda, models
from test_deepseek_v41 import PUBLISHED, vllm_config


def collapse_reference(streams: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
    """`mhc_pre_delayed_torch`'s collapse (vLLM's reference of `hc_collapse_triton`)."""
    return (pre_mix.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


class LayerInputTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        config = json.loads((PUBLISHED / "config.json").read_text())
        model = deepseek_v41.DeepseekV41ForCausalLM(vllm_config=vllm_config(config))
        model.load_weights(iter(load_file(str(PUBLISHED / "model.safetensors")).items()))
        model.set_aux_hidden_state_layers(model.get_eagle3_default_aux_hidden_state_layers())
        # What each layer's FFN hands on: vLLM's layer returns it unexpanded, with its mixes.
        expands, mixers = [], []

        def expand(x, residual, post, comb):
            expands.append((x, residual, post, comb))
            return real_expand(x, residual, post, comb)

        def mixer(self, streams):
            mixers.append(real_mixer(self, streams))
            return mixers[-1]

        real_expand, real_mixer = deepseek_v41._expand, deepseek_v41._HyperConnection.forward
        tokens = torch.arange(40, 240)
        with mock.patch.object(deepseek_v41, "_expand", expand), \
                mock.patch.object(deepseek_v41._HyperConnection, "forward", mixer), torch.no_grad():
            _, cls.inputs = model(tokens, torch.arange(len(tokens)))
        cls.ffn_outputs, cls.ffn_mixes = expands[1::2], mixers[1::2]  # per layer: attention, then FFN
        cls.embedding = model.embed_input_ids(tokens)

    def setUp(self):
        kernels = {"mhc_post_tilelang": mhc_post_torch, "hc_collapse_triton": collapse_reference}
        for name, reference in kernels.items():
            patcher = mock.patch.object(deepseek_v41_cuda, name, reference)
            patcher.start()
            self.addCleanup(patcher.stop)

    def test_each_layers_input_is_the_decoders_attention_input(self):
        streams, first = deepseek_v41_cuda.layer_input(self.embedding, None, None, None, None)
        self.assertIs(streams, self.embedding)
        self.assertTrue(torch.equal(first, self.inputs[0]))
        self.assertNotEqual(first.data_ptr(), self.embedding.data_ptr())
        for layer in range(1, len(self.inputs)):
            x, residual, post, comb = self.ffn_outputs[layer - 1]
            pre = self.ffn_mixes[layer - 1][0]
            with self.subTest(layer=layer):
                streams, got = deepseek_v41_cuda.layer_input(x, pre, post[..., None], comb, residual)
                want = self.inputs[layer]
                self.assertLess(((got - want).abs().max() / want.abs().max()).item(), 1e-6)
                # A pipeline stage's first layer gets the finished streams: the same input.
                _, again = deepseek_v41_cuda.layer_input(streams, pre, None, None, None)
                self.assertTrue(torch.equal(again, got))

    def test_the_layer_runs_on_the_streams_it_hands_out_the_input_of(self):
        class VllmLayer(torch.nn.Module):  # records what vLLM's layer would be given
            def forward(self, x, positions, input_ids, pre_mix=None, post_mix=None, res_mix=None, residual=None,
                        engram_hashes=None, engram_mask=None, *, capture_previous_aux=False,
                        mega_gate_metadata=None):
                self.given = (x, residual, capture_previous_aux)
                return "out", "streams", "post", "comb", "pre", None

        layer = VllmLayer()
        layer.__class__ = type("Capturing", (deepseek_v41_cuda.CapturingLayer, VllmLayer), {})
        x, residual, post, comb = self.ffn_outputs[0]
        pre = self.ffn_mixes[0][0]
        plain = layer(x, None, None, pre, post[..., None], comb, residual)
        self.assertEqual(plain, ("out", "streams", "post", "comb", "pre", None))
        self.assertIs(layer.given[1], residual)
        captured = layer(x, None, None, pre, post[..., None], comb, residual, capture_previous_aux=True)
        streams, want = deepseek_v41_cuda.layer_input(x, pre, post[..., None], comb, residual)
        self.assertEqual(captured[:5], ("out", "streams", "post", "comb", "pre"))
        self.assertTrue(torch.equal(captured[5], want))
        given_streams, given_residual, asked = layer.given
        self.assertTrue(torch.equal(given_streams, streams))
        self.assertEqual((given_residual, asked), (None, False))


class RegistrationTest(unittest.TestCase):
    def test_the_class_follows_the_build_and_a_mismatch_is_refused(self):
        from vllm import ModelRegistry

        with mock.patch.dict(os.environ, {models.CAPTURE_ENV: "1", models.DEVICE_ENV: "cpu"}):
            models.register()
        self.assertEqual(ModelRegistry.models["DeepseekV41ForCausalLM"].module_name, "pdbridge_vllm.deepseek_v41")
        with mock.patch.dict(os.environ, {models.CAPTURE_ENV: "1", models.DEVICE_ENV: "cuda"}), \
                self.assertRaisesRegex(RuntimeError, "engine.device is 'cuda', but this vLLM is its cpu build"):
            models.register()


if __name__ == "__main__":
    unittest.main(verbosity=2)
