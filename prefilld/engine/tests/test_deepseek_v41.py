"""The plugin's DeepSeek-V4.1 class (torch, no vLLM server) against the decoder's own mlx-lm model on
the tiny checkpoint: the attention inputs it hands out are the decoder's up to float rounding,
requests sharing a step do not see each other, prompts too short to close a group run, and a step
that is not whole prompts is refused."""

from __future__ import annotations

import json
import unittest
from pathlib import Path

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


if __name__ == "__main__":
    unittest.main(verbosity=2)
