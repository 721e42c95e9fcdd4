"""The kv route's quantizer (`pdbridge_vllm.kv_quant`, torch) against MLX's own ``mx.quantize``.

The golden file `golden/affine_quantize.json` pins both: torch must give its bytes under each rule,
and this machine's MLX (its CPU kernel) those of the ``cpu`` rule, so an MLX that rounds otherwise
fails here rather than in a decoder's cache. The ``gpu`` rule (MLX's Metal and CUDA kernels) is held
to MLX where MLX runs on a GPU (the GPU kit checks it there). A sweep of random inputs over every
dtype, width and group size the decoder's cache can have compares the two byte for byte.

Run: .venv/bin/python -m unittest discover -s prefilld/engine/tests -p test_kv_quant.py -v
"""

from __future__ import annotations

import json
import unittest
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from pdbridge_vllm import kv_quant

GOLDEN = json.loads((Path(__file__).parent / "golden" / "affine_quantize.json").read_text())
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MLX = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def golden_input() -> np.ndarray:
    return np.array(GOLDEN["input"], dtype=np.uint32).view(np.float32)


def torch_bits(codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor) -> tuple[list, list, list]:
    """Codes as uint32 and scales/biases as their dtype's bit patterns, as the golden file keeps them."""
    def bits(a: torch.Tensor) -> list:
        wide = a.element_size() == 4
        return (a.view(torch.int32 if wide else torch.int16).numpy().astype(np.int64)
                & (0xFFFFFFFF if wide else 0xFFFF)).tolist()
    return bits(codes.view(torch.int32)), bits(scales), bits(biases)


def mlx_bits(codes: mx.array, scales: mx.array, biases: mx.array) -> tuple[list, list, list]:
    def bits(a: mx.array) -> list:
        view = mx.uint32 if a.dtype.size == 4 else mx.uint16
        return np.array(a.view(view)).astype(np.int64).tolist()
    return bits(codes), bits(scales), bits(biases)


class GoldenTest(unittest.TestCase):
    def test_torch_gives_the_golden_bytes_under_each_rule(self):
        x = golden_input()
        for case in GOLDEN["cases"]:
            with self.subTest(**{k: case[k] for k in ("rule", "bits", "group_size", "dtype")}):
                got = kv_quant.quantize(torch.from_numpy(x).to(TORCH[case["dtype"]]), case["group_size"],
                                        case["bits"], case["rule"])
                self.assertEqual(torch_bits(*got), (case["codes"], case["scales_bits"], case["biases_bits"]))

    def test_this_mlx_gives_the_golden_bytes_of_its_device(self):
        rule = mx.default_device().type.name
        x = golden_input()
        cases = [c for c in GOLDEN["cases"] if c["rule"] == rule]
        self.assertTrue(cases)
        for case in cases:
            with self.subTest(**{k: case[k] for k in ("bits", "group_size", "dtype")}):
                got = mx.quantize(mx.array(x).astype(MLX[case["dtype"]]), group_size=case["group_size"],
                                  bits=case["bits"])
                self.assertEqual(mlx_bits(*got), (case["codes"], case["scales_bits"], case["biases_bits"]))

    def test_the_rules_differ_where_mlx_backends_do(self):
        """An all-negative group below -1: the GPU kernels span [min, 0], the CPU one [min, max]."""
        x = golden_input()[1:2, :32]
        cpu = kv_quant.quantize(torch.from_numpy(x), 32, 4, "cpu")
        gpu = kv_quant.quantize(torch.from_numpy(x), 32, 4, "gpu")
        self.assertNotEqual(cpu[1].item(), gpu[1].item())


class SweepTest(unittest.TestCase):
    def test_random_rows_quantize_as_mlx_does(self):
        """Cache-shaped rows [layers, 2, heads, tokens, head_dim] of every scale, as mx.quantize on
        this machine's MLX device quantizes them."""
        rng = np.random.default_rng(7)
        rule = mx.default_device().type.name
        for dtype in TORCH:
            for head_dim in (64, 128):
                for bits in (4, 8):
                    for group_size in (32, 64):
                        scale = rng.choice([1e-3, 1.0, 40.0], size=(3, 2, 2, 9, 1))
                        x = (rng.standard_normal((3, 2, 2, 9, head_dim)) * scale).astype(np.float32)
                        with self.subTest(dtype=dtype, head_dim=head_dim, bits=bits, group_size=group_size):
                            want = mx.quantize(mx.array(x).astype(MLX[dtype]), group_size=group_size, bits=bits)
                            got = kv_quant.quantize(torch.from_numpy(x).to(TORCH[dtype]), group_size, bits, rule)
                            self.assertEqual(torch_bits(*got), mlx_bits(*want))

    def test_what_it_cannot_pack_is_refused(self):
        with self.assertRaises(ValueError):
            kv_quant.quantize(torch.zeros(2, 64), 64, 3)
        with self.assertRaises(ValueError):
            kv_quant.quantize(torch.zeros(2, 48), 32, 4)
        with self.assertRaises(ValueError):
            kv_quant.quantize(torch.zeros(2, 64), 64, 4, "metal")


class Divisions(TorchFunctionMode):
    """Records the divisors of every true division torch is asked for."""

    DIVIDE = {torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.__rtruediv__}

    def __init__(self):
        super().__init__()
        self.divisors = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.DIVIDE:
            self.divisors.append(args[0] if func is torch.Tensor.__rtruediv__ else args[1])
        return func(*args, **(kwargs or {}))


class DeviceTest(unittest.TestCase):
    def test_every_division_is_by_a_tensor_on_the_inputs_device(self):
        """On CUDA torch divides by a CPU scalar (a Python number, a 0-d CPU tensor) as a multiply
        by its reciprocal, 1 ulp off MLX's IEEE division for some groups (H100, 2026-12-07: the
        route's scales unlike the fused kernel's): so the quantizer divides only by tensors, made
        on the input's device."""
        for rule in kv_quant.RULES:
            with self.subTest(rule=rule), Divisions() as seen:
                kv_quant.quantize(torch.randn(2, 4, 64), 32, 4, rule)
            self.assertTrue(seen.divisors)
            for divisor in seen.divisors:
                self.assertIsInstance(divisor, torch.Tensor, f"{rule}: divided by {divisor!r}")


if __name__ == "__main__":
    unittest.main()
