"""The kv route's fused quantizer (`pdbridge_vllm.kv_quant_fused`, one Triton kernel) against the
torch quantizer it stands in for, byte for byte (finite inputs: a cache holds no inf or NaN), in
Triton's interpreter on this CPU: the golden file's inputs, cache-shaped random rows of every dtype,
width, bits and group, and the edges (an all-negative group, zeros, a constant, magnitudes past
2^23). On CUDA the kernel is compiled and `Fused` checks it against torch on its first input of
each kind.

Run: .venv/bin/python -m unittest discover -s prefilld/engine/tests -p test_kv_quant_fused.py -v
"""

from __future__ import annotations

import json
import os
import unittest
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton compiles anything: the kernel runs on this CPU

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pdbridge_vllm import kv_quant, kv_quant_fused  # noqa: E402

GOLDEN = json.loads((Path(__file__).parent / "golden" / "affine_quantize.json").read_text())
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def same_bytes(got, want) -> bool:
    return all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(got, want))


class KernelTest(unittest.TestCase):
    def assert_as_torch(self, w: torch.Tensor, group_size: int, bits: int) -> None:
        got = kv_quant_fused.quantize(w, group_size, bits)
        self.assertTrue(same_bytes(got, kv_quant.quantize(w, group_size, bits, kv_quant.GPU)))

    def test_the_golden_inputs(self):
        x = torch.from_numpy(np.array(GOLDEN["input"], dtype=np.uint32).view(np.float32))
        cases = [c for c in GOLDEN["cases"] if c["rule"] == kv_quant.GPU]
        self.assertTrue(cases)
        for case in cases:
            with self.subTest(**{k: case[k] for k in ("bits", "group_size", "dtype")}):
                self.assert_as_torch(x.to(DTYPES[case["dtype"]]), case["group_size"], case["bits"])

    def test_cache_shaped_rows(self):
        """[blocks, layers, 2, heads, tokens, head_dim] rows of three scales, as `Layout.lay_out`
        hands them over (a permuted view: the kernel reads a contiguous copy)."""
        gen = torch.Generator().manual_seed(11)
        for dtype in DTYPES.values():
            for head_dim in (64, 128):
                for bits in (4, 8):
                    for group_size in (32, 64, 128):
                        if group_size > head_dim:
                            continue
                        scale = torch.tensor([1e-3, 1.0, 40.0])[torch.randint(0, 3, (2, 3, 2, 2, 1, 1), generator=gen)]
                        rows = (torch.randn(2, 3, 2, 2, 5, head_dim, generator=gen) * scale).to(dtype)
                        with self.subTest(dtype=dtype, head_dim=head_dim, bits=bits, group_size=group_size):
                            self.assert_as_torch(rows.transpose(0, 1), group_size, bits)

    def test_the_edges(self):
        rows = torch.randn(6, 64)
        rows[0] = -5.0  # all negative: the max starts at 0
        rows[1] = 0.0
        rows[2] = 3.0
        rows[3, :32] = 1e9  # past 2^23, where float32 holds integers only (float16: its largest)
        rows[4] = torch.linspace(-1e-9, 1e-9, 64)  # a scale at its floor
        rows[5, 1::2] = -rows[5, ::2]
        for dtype in DTYPES.values():
            for bits in (4, 8):
                with self.subTest(dtype=dtype, bits=bits):
                    self.assert_as_torch(rows.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype), 32,
                                         bits)

    def test_what_it_cannot_pack_is_refused(self):
        with self.assertRaises(ValueError):
            kv_quant_fused.quantize(torch.zeros(2, 64), 64, 3)
        with self.assertRaises(ValueError):
            kv_quant_fused.quantize(torch.zeros(2, 48), 32, 4)


class FusedTest(unittest.TestCase):
    def test_the_kernel_quantizes_once_it_agreed_with_torch(self):
        fused = kv_quant_fused.Fused(devices=("cpu",))
        w = torch.randn(4, 64, dtype=torch.bfloat16)
        calls = []
        real = kv_quant_fused.quantize
        kv_quant_fused.quantize = lambda *a: calls.append(a) or real(*a)
        try:
            for _ in range(3):
                self.assertTrue(same_bytes(fused.quantize(w, 64, 4, kv_quant.GPU),
                                           kv_quant.quantize(w, 64, 4, kv_quant.GPU)))
        finally:
            kv_quant_fused.quantize = real
        self.assertEqual(len(calls), 3)  # the check, then the kernel alone

    def test_a_kernel_that_disagrees_is_not_used(self):
        fused = kv_quant_fused.Fused(devices=("cpu",))
        w = torch.randn(4, 64)
        calls = []

        def off_by_one(w, group_size, bits):
            calls.append(bits)
            codes, scales, biases = kv_quant.quantize(w, group_size, bits, kv_quant.GPU)
            return codes, scales, biases + 1

        real = kv_quant_fused.quantize
        kv_quant_fused.quantize = off_by_one
        try:
            with self.assertLogs("vllm.pdbridge_vllm", "WARNING") as logs:
                first = fused.quantize(w, 64, 4, kv_quant.GPU)
            second = fused.quantize(w, 64, 4, kv_quant.GPU)
        finally:
            kv_quant_fused.quantize = real
        want = kv_quant.quantize(w, 64, 4, kv_quant.GPU)
        self.assertTrue(same_bytes(first, want) and same_bytes(second, want))
        self.assertEqual(calls, [4])
        self.assertIn("differ", logs.output[0])

    def test_the_cpu_rule_and_other_devices_stay_with_torch(self):
        w = torch.randn(4, 64)

        def refuse(*_):
            raise AssertionError("the kernel ran")

        real = kv_quant_fused.quantize
        kv_quant_fused.quantize = refuse
        try:
            for fused, rule in ((kv_quant_fused.Fused(), kv_quant.GPU), (kv_quant_fused.Fused(("cpu",)), kv_quant.CPU)):
                self.assertTrue(same_bytes(fused.quantize(w, 64, 4, rule), kv_quant.quantize(w, 64, 4, rule)))
        finally:
            kv_quant_fused.quantize = real


if __name__ == "__main__":
    unittest.main()
