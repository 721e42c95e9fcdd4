"""Helpers shared by the scripts that build model folders for the two engines
(`prepare-model.py` for the test model, `make-tiny-model.py` for generated
checkpoints): every model comes as a decoder folder (mlx-lm, quantized) and a
prefill folder (HF/vLLM) holding the same weights dequantized bit-exactly."""

import hashlib
import json
import shutil
import time
from pathlib import Path

import mlx.core as mx

STAMP = ".prepare-model.stamp"


def sha256(path: Path) -> str:
    """A file's SHA-256, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def dequantized(weights: dict, group_size: int) -> dict:
    """HF-named fp32 tensors: quantized modules through mx.dequantize, the rest as they are."""
    out = {}
    for name, a in weights.items():
        base, _, suffix = name.rpartition(".")
        if suffix in ("scales", "biases"):
            continue
        # Only `.weight` is packed: a quantized linear's own `.bias` (gpt-oss) stays as it is.
        if suffix == "weight" and f"{base}.scales" in weights:
            scales = weights[f"{base}.scales"]
            # Bits per module as mlx-lm infers them: the Q8_0 embedding is 8-bit, the linears 4-bit.
            bits = a.shape[-1] * 32 // (scales.shape[-1] * group_size)
            a = mx.dequantize(a, scales, weights[f"{base}.biases"], group_size=group_size, bits=bits)
        out[name] = a
    return out


def build_hf(folder: Path, mlx_folder: Path, relayout=None, torch_dtype: str = "float32") -> None:
    """`relayout` maps the dequantized tensors from mlx-lm's names and layout to the HF checkpoint's
    (e.g. stacked experts back to per-expert tensors); only indexing, so still bit-exact.
    `torch_dtype`: what the config tells the prefill engine to run (the tensors stay fp32)."""
    # Read the decoder folder rather than the GGUF: the prefill weights are by definition the
    # decoder's tensors, dequantized exactly as MLX would (w = scale*q + bias in fp32).
    mlx_config = json.loads((mlx_folder / "config.json").read_text())
    group_size = mlx_config.get("quantization", {}).get("group_size", 0)  # 0: nothing is quantized
    relayout = relayout or (lambda weights: weights)
    mx.save_safetensors(
        str(folder / "model.safetensors"),
        relayout(dequantized(mx.load(str(mlx_folder / "model.safetensors")), group_size)),
        metadata={"format": "pt"},
    )
    verify_dequantized(folder, mlx_folder, group_size, relayout)

    mlx_only = ("quantization", "quantization_config", "rope_traditional")
    config = {k: v for k, v in mlx_config.items() if k not in mlx_only}
    # mlx-lm's llama hard-codes SiLU; HF and vLLM read it here (a family that differs names its own).
    config.setdefault("hidden_act", "silu")
    config["torch_dtype"] = torch_dtype
    write_json(folder / "config.json", config)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy2(mlx_folder / name, folder / name)
    # transformers 5 (which vLLM uses) saves the chat template as its own file; keep that layout.
    # A base model's GGUF may carry none (prepare-gguf-model.py): then there is nothing to write.
    template = json.loads((mlx_folder / "tokenizer_config.json").read_text()).get("chat_template")
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)


def verify_dequantized(hf_folder: Path, mlx_folder: Path, group_size: int, relayout) -> None:
    """Re-reads both files and requires bit equality (uint32 views), so no NaN or -0.0 slips by."""
    written = mx.load(str(hf_folder / "model.safetensors"))
    expected = relayout(dequantized(mx.load(str(mlx_folder / "model.safetensors")), group_size))
    if written.keys() != expected.keys():
        raise RuntimeError(f"HF tensor names differ: {sorted(written.keys() ^ expected.keys())}")
    for name, a in expected.items():
        b = written[name]
        if b.dtype != mx.float32 or not mx.array_equal(a.view(mx.uint32), b.view(mx.uint32)).item():
            raise RuntimeError(f"{name}: HF weight is not bit-identical to mx.dequantize of the MLX folder")


def ensure(folder: Path, stamp: str, build) -> None:
    if (folder / STAMP).is_file() and (folder / STAMP).read_text() == stamp:
        print(f"{folder.name}: up to date")
        return
    start = time.monotonic()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
    (tmp / STAMP).write_text(stamp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{folder.name}: built {folder} in {time.monotonic() - start:.1f} s ({size / 1e6:.1f} MB)")


