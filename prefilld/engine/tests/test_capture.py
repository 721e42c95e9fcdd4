"""The capture keeps each layer's input as it entered the layer, whatever the layers do to their
tensors afterwards. On CUDA vLLM's fused add-norm (its `vllm_c` kernel) updates the residual in
place, and the first layer's residual is the embedding tensor itself; vLLM's CPU build adds out of
place, so the engine tests cannot see this. Here layers of Llama's calling convention add in place
as the CUDA kernel does, under the plugin's `Recorder` over vLLM's own EAGLE-3 capture mixin."""

from __future__ import annotations

import importlib.util
import os
import unittest
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from vllm.model_executor.models.interfaces import EagleModelMixin

from pdbridge_vllm import models
from pdbridge_vllm.models import Recorder


class InPlaceLayer(nn.Module):
    """Llama's residual handling with CUDA's in-place fused add: (hidden, residual) -> (hidden, residual)."""

    def forward(self, _positions, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            residual = hidden  # the first layer's residual is its input tensor
        else:
            residual.add_(hidden)  # input add-norm
        attention = hidden * 2 + 1
        residual.add_(attention)  # post-attention add-norm
        return attention * 3, residual


class Model(nn.Module, EagleModelMixin):
    """An inner model (the module holding `layers`) calling its capture as vLLM's Llama does."""

    start_layer = 0

    def __init__(self, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(InPlaceLayer() for _ in range(layers))
        self.end_layer = layers

    def forward(self, embedding: torch.Tensor):
        captured: list[torch.Tensor] = []
        hidden, residual = embedding, None
        self._maybe_add_hidden_state(captured, 0, hidden, residual)
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(None, hidden, residual)
            self._maybe_add_hidden_state(captured, i + 1, hidden, residual)
        return hidden, captured


def layer_inputs(embedding: torch.Tensor, layers: int) -> list[torch.Tensor]:
    """Each layer's input computed out of place: what the capture must give."""
    inputs, hidden, residual = [], embedding.clone(), None
    for _ in range(layers):
        inputs.append(hidden if residual is None else hidden + residual)
        residual = inputs[-1] + hidden * 2 + 1
        hidden = (hidden * 2 + 1) * 3
    return inputs


class CaptureTest(unittest.TestCase):
    LAYERS = 3

    def recording(self) -> Recorder:
        model = Model(self.LAYERS)
        model.__class__ = type("ModelRecording", (Recorder, Model), {})
        return model

    def test_the_models_own_capture_keeps_the_first_layers_input(self):
        model = self.recording()
        model._set_aux_hidden_state_layers(tuple(range(self.LAYERS)))
        embedding = torch.arange(8.0).reshape(2, 4)
        _, captured = model(embedding.clone())
        for got, want in zip(captured, layer_inputs(embedding, self.LAYERS), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)

    def test_the_hooks_keep_the_first_layers_input(self):
        model = self.recording()
        model.record_layer_inputs(range(self.LAYERS))
        embedding = torch.arange(8.0).reshape(2, 4)
        (_, _), captured = model(embedding.clone())
        for got, want in zip(captured, layer_inputs(embedding, self.LAYERS), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


class DecoderArithmeticTest(unittest.TestCase):
    """Where vLLM's class computes a layer's input otherwise than the decoder, the capture class
    takes the decoder's arithmetic: held here to mlx-lm's own model."""

    def test_gemma3_embeddings_are_scaled_as_the_decoder_scales_them(self):
        import mlx.core as mx
        import mlx.nn
        from mlx_lm.models import gemma3_text

        hidden = 640  # Gemma 3 270M's, whose √ is not a bf16 value
        args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=hidden, num_hidden_layers=1,
                                     intermediate_size=8, num_attention_heads=1, num_key_value_heads=1,
                                     head_dim=8, vocab_size=4, sliding_window_pattern=1)
        decoder = gemma3_text.Model(args)
        first_layer_inputs = []

        class FirstLayer(mlx.nn.Module):
            def __call__(self, h, mask=None, cache=None):
                first_layer_inputs.append(h)
                return h

        decoder.model.layers = [FirstLayer()]
        decoder.model.embed_tokens.weight = mx.ones((4, hidden))
        decoder(mx.array([[1]]))
        decoders_scale = first_layer_inputs[0][0, 0, 0].item()

        inner = nn.Module()  # vLLM's Gemma3Model's: its config and its fp32 `normalizer` buffer
        inner.config = mock.Mock(hidden_size=hidden)
        inner.register_buffer("normalizer", torch.tensor(hidden**0.5), persistent=False)
        self.assertNotEqual(inner.normalizer.item(), decoders_scale)
        models.DECODER_ARITHMETIC["Gemma3ForCausalLM"](inner)
        self.assertEqual((inner.normalizer.item(), inner.normalizer.dtype), (decoders_scale, torch.float32))


class RegistrationTest(unittest.TestCase):
    """The plugin's classes replace vLLM's own only in an engine the bridge captures from: another
    vLLM of the environment (on CUDA, in its default CUDA-graph mode) keeps vLLM's classes."""

    def test_vllms_own_classes_stay_unless_the_bridge_captures(self):
        from vllm import ModelRegistry

        saved = dict(ModelRegistry.models)
        module = lambda arch: ModelRegistry.models[arch].module_name  # noqa: E731
        try:
            with mock.patch.dict(os.environ, {models.CAPTURE_ENV: ""}):
                models.register()
            self.assertEqual(module("LlamaForCausalLM"), "vllm.model_executor.models.llama")
            with mock.patch.dict(os.environ, {models.CAPTURE_ENV: "1"}):
                models.register()
            self.assertEqual(module("LlamaForCausalLM"), models.__name__)
            self.assertEqual(module("Gemma3ForCausalLM"), models.__name__)
            self.assertEqual(module("DeepseekV41ForCausalLM"), "pdbridge_vllm.deepseek_v41")
        finally:
            ModelRegistry.models.clear()
            ModelRegistry.models.update(saved)

    def test_every_own_class_is_defined_where_its_declaration_says(self):
        """`own_classes.json` (which prefilld embeds too) names modules that define the class, read
        as source: the CUDA module imports vLLM's CUDA build."""
        for architecture, own in models.OWN_CLASSES.items():
            for key in ("cpu_module", "cuda_module"):
                source = Path(importlib.util.find_spec(own[key]).origin).read_text()
                self.assertIn(f"class {architecture}(", source, f"{key} {own[key]}")
            self.assertIn("{max_model_len}", own["cpu_vllm_args"])


if __name__ == "__main__":
    unittest.main()
