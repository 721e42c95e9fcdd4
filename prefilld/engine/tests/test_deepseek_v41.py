"""The plugin's DeepSeek-V4.1 class (torch, no vLLM server) against the decoder's own mlx-lm model on
the tiny checkpoint: the attention inputs it hands out are the decoder's up to float rounding,
requests sharing a step do not see each other, prompts too short to close a group run, and a step
that is not whole prompts is refused."""

from __future__ import annotations

import json
import unittest
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import torch

from pdbridge_vllm import deepseek_v41

REPO = Path(__file__).resolve().parents[3]

MODEL = REPO / "models" / "tiny-deepseek_v41-mlx"


class DeepseekV41Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import mlx_lm

        config = json.loads((MODEL / "config.json").read_text())
        cls.torch_model = deepseek_v41._TextModel(deepseek_v41.model_args(config))
        params = dict(cls.torch_model.named_parameters())
        weights = mx.load(str(MODEL / "model.safetensors"))
        for name, array in weights.items():
            if name.startswith("model."):
                params[name.removeprefix("model.")].data.copy_(torch.from_numpy(np.array(array)))
        cls.lm_head = torch.from_numpy(np.array(weights["lm_head.weight"]))
        cls.torch_model.aux_hidden_state_layers = tuple(range(len(cls.torch_model.layers)))
        cls.mlx_model, tokenizer = mlx_lm.load(str(MODEL))
        cls.tokens = tokenizer.encode((REPO / "LICENSE").read_text())[:300]

    def run_torch(self, tokens: list[int], positions: list[int]):
        with torch.no_grad():
            out, inputs = self.torch_model(torch.tensor(tokens), torch.tensor(positions))
        return out, inputs

    def test_attention_inputs_are_the_decoders(self):
        from pdbridge_cache.check import native_prefill

        _, native, _ = native_prefill(self.mlx_model, self.tokens, 2048, {})
        out, inputs = self.run_torch(self.tokens, list(range(len(self.tokens))))
        self.assertEqual(len(inputs), 4)
        for layer, (got, want) in enumerate(zip(inputs, native)):
            want = np.array(want)
            rel = np.abs(got.numpy() - want).max() / np.abs(want).max()
            self.assertLess(rel, 1e-4, f"layer {layer}")
        logits = (out[-1] @ self.lm_head.T).numpy()
        native_logits = np.array(self.mlx_model(mx.array([self.tokens]))[0, -1])
        self.assertEqual(int(logits.argmax()), int(native_logits.argmax()))
        self.assertLess(np.abs(logits - native_logits).max(), 1e-3)

    def test_requests_sharing_a_step_do_not_see_each_other(self):
        first, second = self.tokens[:200], self.tokens[40:150]
        _, together = self.run_torch(first + second, list(range(200)) + list(range(110)))
        _, alone = self.run_torch(second, list(range(110)))
        _, alone_first = self.run_torch(first, list(range(200)))
        for a, b, c in zip(together, alone, alone_first):
            self.assertLess((a[200:] - b).abs().max().item(), 1e-5)
            self.assertLess((a[:200] - c).abs().max().item(), 1e-5)
        # Prompts shorter than a pooling group (ratio 16) and than the window.
        _, short = self.run_torch(self.tokens[:10] + self.tokens[:3], list(range(10)) + [0, 1, 2])
        self.assertEqual(short[3].shape, (13, 128))

    def test_a_step_that_is_not_whole_prompts_is_refused(self):
        for positions in ([3, 4, 5, 6, 7], [0, 1, 2, 7, 8]):
            with self.assertRaisesRegex(RuntimeError, "whole prompts in one step"):
                self.run_torch(self.tokens[:5], positions)


PUBLISHED = REPO / "models" / "tiny-deepseek_v41_flash"


def vllm_config(config: dict) -> SimpleNamespace:
    """The parts of vLLM's config the class reads: the model's HF config and one worker."""
    hf_config = SimpleNamespace(to_dict=lambda: config)
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))


class PublishedCheckpointTest(unittest.TestCase):
    """The checkpoint as DeepSeek publishes it (DeepSeek's names, fp8 projections and fp4 experts with
    ue8m0 scales), one file set: the class reads it through vLLM's `load_weights`, the decoder through
    mlx-lm's own loader, and the attention inputs agree."""

    @classmethod
    def setUpClass(cls):
        import mlx_lm
        from safetensors.torch import load_file

        config = json.loads((PUBLISHED / "config.json").read_text())
        cls.weights = load_file(str(PUBLISHED / "model.safetensors"))
        cls.model = deepseek_v41.DeepseekV41ForCausalLM(vllm_config=vllm_config(config))
        cls.loaded = cls.model.load_weights(iter(cls.weights.items()))
        cls.model.set_aux_hidden_state_layers(cls.model.get_eagle3_default_aux_hidden_state_layers())
        cls.mlx_model, tokenizer = mlx_lm.load(str(PUBLISHED))
        cls.mlx_model.set_dtype(mx.float32)  # as the decoder runs it (the checkpoint's rest is bf16)
        cls.tokens = tokenizer.encode((REPO / "LICENSE").read_text())[:300]

    def test_the_attention_inputs_are_the_decoders(self):
        from pdbridge_cache.check import native_prefill

        self.assertEqual(self.loaded, {n for n, _ in self.model.named_parameters()})
        _, native, _ = native_prefill(self.mlx_model, self.tokens, 2048, {})
        with torch.no_grad():
            out, inputs = self.model(torch.tensor(self.tokens), torch.arange(len(self.tokens)))
        for layer, (got, want) in enumerate(zip(inputs, native, strict=True)):
            want = np.array(want)
            rel = np.abs(got.numpy() - want).max() / np.abs(want).max()
            self.assertLess(rel, 1e-4, f"layer {layer}")
        logits = self.model.compute_logits(out[-1])
        native_logits = np.array(self.mlx_model(mx.array([self.tokens]))[0, -1])
        self.assertEqual(int(logits.argmax()), int(native_logits.argmax()))

    def test_a_checkpoint_missing_a_piece_is_refused(self):
        from pdbridge_vllm.deepseek_checkpoint import CheckpointError

        def without(*names):
            return iter((n, t) for n, t in self.weights.items() if n not in names)

        cases = {
            "layers.2.ffn.experts.1.w3.scale": (CheckpointError, "without its fp4 scale"),
            "layers.2.attn.wq_b.weight": (CheckpointError, r"scales without a weight: \['layers.2.attn.wq_b'\]"),
            "layers.0.ffn.shared_experts.w2.weight": (CheckpointError, "scales without a weight"),
            "layers.3.attn.attn_sink": (ValueError, r"lacks \['layers.3.attn.attn_sink'\]"),
        }
        for name, (error, message) in cases.items():
            with self.subTest(name), self.assertRaisesRegex(error, message):
                self.model.load_weights(without(name))
        with self.assertRaisesRegex(CheckpointError, "layer 1 has 3 w1 experts, the config 4"):
            self.model.load_weights(without("layers.1.ffn.experts.2.w1.weight", "layers.1.ffn.experts.2.w1.scale"))
        extra = {**self.weights, "layers.0.attn.wq_c.weight": torch.zeros(2)}
        with self.assertRaisesRegex(ValueError, "layers.0.attn.wq_c.weight is not a parameter"):
            self.model.load_weights(iter(extra.items()))


if __name__ == "__main__":
    unittest.main(verbosity=2)
