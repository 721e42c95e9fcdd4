"""The GPU kit carries the test model's decoder folder with fp16 scales and restores it on the
machine bit for bit (bench/gpu/carry.py, `kit.sh prepare` and `remote unpack`)."""

from __future__ import annotations

import filecmp
import tempfile
import unittest
from pathlib import Path

import mlx.core as mx

import carry

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models/smollm2-mlx"


class CarryTest(unittest.TestCase):
    def test_the_decoder_folder_travels_smaller_and_comes_back_bit_for_bit(self):
        with tempfile.TemporaryDirectory(prefix="pdb-carry-") as tmp:
            packed, restored = Path(tmp) / "packed", Path(tmp) / "restored"
            carry.pack(MODEL, packed)
            carry.unpack(packed, restored)
            scales = mx.load(str(packed / carry.WEIGHTS))
            self.assertTrue(all(v.dtype == mx.float16 for k, v in scales.items() if k.endswith(".scales")))
            self.assertLess((packed / carry.WEIGHTS).stat().st_size, (MODEL / carry.WEIGHTS).stat().st_size)
            original, back = mx.load(str(MODEL / carry.WEIGHTS)), mx.load(str(restored / carry.WEIGHTS))
            self.assertEqual(original.keys(), back.keys())
            for name, a in original.items():
                b = back[name]
                self.assertEqual((a.dtype, a.shape), (b.dtype, b.shape), name)
                self.assertTrue(mx.array_equal(a.view(mx.uint8), b.view(mx.uint8)).item(), name)
            others = sorted(p.name for p in MODEL.iterdir() if p.name != carry.WEIGHTS)
            self.assertEqual(filecmp.cmpfiles(MODEL, restored, others, shallow=False)[0], others)

    def test_a_folder_fp16_cannot_hold_is_refused(self):
        with tempfile.TemporaryDirectory(prefix="pdb-carry-") as tmp:
            src = Path(tmp) / "src"
            src.mkdir()
            mx.save_safetensors(str(src / carry.WEIGHTS), {"w.scales": mx.array([1.0 + 2.0 ** -20])})
            with self.assertRaises(SystemExit):
                carry.pack(src, Path(tmp) / "dst")


if __name__ == "__main__":
    unittest.main()
