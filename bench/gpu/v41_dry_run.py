#!/usr/bin/env python3
"""DeepSeek-V4.1's device session rehearsed on a machine without a GPU: `bench/gpu/kit.sh dry-run`,
which installs the kit's parts as `remote unpack` does (vLLM 0.32.0's CUDA wheel, TileLang, DeepGEMM
2.6.1 built by unpack's own function over this Python's torch) and runs this over them.

What it proves, over this Python's torch (the device has 2.11):
1. imports: the modules vLLM's V4.1 CUDA path and the plugin's capture load, each ok or failed with its
   cause: without a driver (a child process, as this machine is) and with kit.sh's stub libcuda.so.1
   (every cu* entry point vLLM's ops link, answering CUDA_ERROR_NO_DEVICE), under which vLLM's and
   DeepGEMM's native libraries load, i.e. every torch symbol they link resolves in this torch.
2. config: vLLM's EngineArgs -> VllmConfig over deepseek_v41_wide.py's config.json with kit.sh's V4.1
   flags (V41_ENGINE_ARGS; V41_ARGS through vLLM's CLI parser agree): its class, quantization, kernels.
3. weights: vLLM's class built on the meta device (no memory), then its own load_weights fed every
   checkpoint tensor (name, shape, dtype as deepseek_v41_wide.specs() draws them, meta tensors): every
   key reaches a weight loader, every parameter but the vision-only ones is loaded, shapes agree (copy_
   on meta tensors checks them), and which dtype goes into which. Exit status 0 when all of it holds.
Faked, inside this process only: vLLM's current platform is its CUDA platform reporting one H100
(capability 9.0, 80 GiB), the sm90 path the device takes; torch.cuda.Stream/Event are inert (the model
makes side streams when built). No kernel runs. Not provable here: kernels, DeepGEMM 2.6.1's numerics
inside vLLM, memory, time.

Usage: bench/gpu/kit.sh dry-run [--out var/gpu-v41/dry-run.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = (
    "torch", "tilelang", "deep_gemm", "vllm", "vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch",
    "vllm._flashmla_C", "vllm.utils.deep_gemm", "vllm.model_executor.kernels.mhc.tilelang",
    "vllm.model_executor.layers.sparse_attn_indexer", "vllm.models.deepseek_v41.sparse_mla",
    "vllm.models.deepseek_v41.nvidia.flashmla", "vllm.models.deepseek_v4.nvidia.ops.o_proj",
    "vllm.models.deepseek_v41.nvidia.ops.o_proj", "vllm.models.deepseek_v41.nvidia.model",
    "vllm.models.deepseek_v41.nvidia.vl_model", "pdbridge_vllm.deepseek_v41_cuda",
    # Not carried: gated on sm90, each with a fallback (expected missing).
    "flashinfer", "cutlass", "quack",
)
# The vision wrapper's delimiter vectors: built on the meta device and never loaded with
# --language-model-only (vLLM's _mark_tower_model); its strict check is off for quantized models.
VISION_ONLY = ("image_start", "image_end", "image_newline")
# The DeepGEMM entry points vLLM's V4.1 path calls (vllm/utils/deep_gemm.py).
DEEP_GEMM = ("fp8_gemm_nt", "fp8_einsum", "fp8_fp4_mqa_logits", "get_paged_mqa_logits_metadata",
             "fp8_fp4_paged_mqa_logits", "tf32_hc_prenorm_gemm")


def imports() -> dict:
    out = {}
    for name in MODULES:
        try:
            __import__(name)
            out[name] = "ok"
        except BaseException as e:  # noqa: BLE001 - a native library's failure can be anything
            text = f"{type(e).__name__}: {e}"
            if "libcuda.so" in text:
                out[name] = f"no CUDA driver ({text[:160]})"
            elif isinstance(e, ModuleNotFoundError):
                out[name] = f"missing module {e.name}"
            else:
                out[name] = f"FAILED {text[:300]}"
    return out


def fake_sm90() -> None:
    """vLLM's CUDA platform as an H100 reports itself, set before any model module binds it."""
    import torch
    import vllm.platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class FakeH100(NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3 (faked)"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 << 30

        @classmethod
        def device_count(cls) -> int:
            return 1

    class Inert:
        def __init__(self, *args, **kwargs):
            pass

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    vllm.platforms._current_platform = FakeH100()
    torch.cuda.Stream = torch.cuda.Event = Inert
    torch.cuda.current_device = lambda: 0


def engine_args() -> dict:
    """kit.sh's V4.1 arguments for vLLM alone (`remote v41 native`), read from kit.sh itself."""
    kit = (ROOT / "bench/gpu/kit.sh").read_text()
    return json.loads(re.search(r"^V41_ENGINE_ARGS='(.*)'$", kit, re.M).group(1)) | {
        "enforce_eager": True, "tokenizer_mode": "hf", "dtype": "bfloat16", "max_model_len": 16384}


def cli_flags(model: str) -> dict:
    """kit.sh's V41_ARGS (prefilld's extra_args for the box) through vLLM's own CLI parser."""
    import shlex

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    kit = (ROOT / "bench/gpu/kit.sh").read_text()
    config = re.search(r"^V41_KERNEL_CONFIG='(.*)'$", kit, re.M).group(1)
    argv = [config if a == "$V41_KERNEL_CONFIG" else a
            for a in shlex.split(re.search(r"^V41_ARGS=\((.*)\)$", kit, re.M).group(1))]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parsed = EngineArgs.from_cli_args(parser.parse_args(["--model", model, *argv]))
    kernel = parsed.kernel_config
    return {"argv": argv, "moe_backend": parsed.moe_backend, "language_model_only": parsed.language_model_only,
            "enforce_eager": parsed.enforce_eager, "enable_jit_warmup": getattr(kernel, "enable_jit_warmup", kernel)}


def weights(model, tensors: dict) -> dict:
    """vLLM's load_weights over meta tensors of the checkpoint's shapes and dtypes; each weight loader
    call is traced back to the checkpoint key whose tensor (or a view of it) it was handed."""
    import torch
    from vllm.model_executor.model_loader import weight_utils

    feed = [(name, torch.empty(shape, dtype=dtype, device="meta")) for name, (shape, dtype) in tensors.items()]
    origin = {id(t): name for name, t in feed}
    consumed: collections.Counter = collections.Counter()
    loaded: set[str] = set()
    dtypes: collections.Counter = collections.Counter()
    examples: dict[str, str] = {}
    unattributed = []

    def root(t):
        while getattr(t, "_base", None) is not None and id(t) not in origin:
            t = t._base
        return origin.get(id(t))

    # A dtype view (the experts' e8m0 scales as uint8) has no _base: followed by wrapping view().
    view, kept = torch.Tensor.view, []

    def tracked_view(self, *args, **kwargs):
        out = view(self, *args, **kwargs)
        if (key := root(self)) is not None and out is not self:
            origin[id(out)] = key
            kept.append(out)  # ids stay unique while they live
        return out

    def traced(param_name, loader):
        def call(param, loaded_weight, *args, **kwargs):
            result = loader(param, loaded_weight, *args, **kwargs)
            key = root(loaded_weight)
            if result is not False:
                loaded.add(param_name)
                pair = f"{loaded_weight.dtype} -> {param.dtype}".replace("torch.", "")
                dtypes[pair] += 1
                examples.setdefault(pair, param_name)
                consumed[key] += 1 if key else 0
                if key is None:
                    unattributed.append(param_name)
            return result
        return call

    params = dict(model.named_parameters())
    for name, param in params.items():
        param.weight_loader = traced(name, getattr(param, "weight_loader", weight_utils.default_weight_loader))
    started = time.monotonic()
    torch.Tensor.view = tracked_view
    try:
        returned = model.load_weights(iter(feed))
    finally:
        torch.Tensor.view = view
    # attn_sink: copied straight into its parameter (no loader); counted by what load_weights returns.
    for name in tensors:
        if "attn_sink" in name and not consumed[name]:
            consumed[name] += 1
    missing_keys = sorted(k for k in tensors if not consumed[k])
    unloaded = sorted(n for n in params if n not in loaded and n not in returned)
    return {"checkpoint_keys": len(tensors), "keys_consumed": len(tensors) - len(missing_keys),
            "keys_not_consumed": missing_keys[:50], "model_parameters": len(params),
            "parameters_loaded": len(params) - len(unloaded), "parameters_not_loaded": unloaded[:50],
            "parameters_not_loaded_beyond_vision_only": [n for n in unloaded if n not in VISION_ONLY],
            "loader_calls_unattributed": len(unattributed), "returned_by_load_weights": len(returned),
            "dtype_into_parameter": {k: [n, examples[k]] for k, n in sorted(dtypes.items())},
            "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "var/gpu-v41/dry-run.json")
    p.add_argument("--tokenizer", type=Path, default=ROOT / "models/smollm2-mlx")
    p.add_argument("--imports-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.imports_only:
        print(json.dumps(imports()))
        return
    report: dict = {"python": sys.version.split()[0]}
    # 1. Without a driver: a child whose library path lacks kit.sh's stub.
    env = dict(os.environ, LD_LIBRARY_PATH=":".join(
        d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d and not (Path(d) / "libcuda.so.1").exists()))
    child = subprocess.run([sys.executable, __file__, "--imports-only"], env=env, capture_output=True, text=True)
    report["imports_without_driver"] = json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0 \
        else {"child failed": child.stderr[-2000:]}
    # 1'. With the stub driver, the platform faked first (the model modules bind it when imported).
    fake_sm90()
    import torch
    report["torch"] = torch.__version__
    report["imports_with_stub_driver"] = imports()
    try:
        import deep_gemm
        report["deep_gemm"] = {"version": deep_gemm.__version__, "file": deep_gemm.__file__,
                               "missing_entry_points": [n for n in DEEP_GEMM if not hasattr(deep_gemm, n)]}
    except Exception as e:  # noqa: BLE001
        report["deep_gemm"] = {"error": repr(e)[:300]}
    # 2. The checkpoint's config.json and tensor list, drawn as the device draws them (meta tensors).
    sys.path.insert(0, str(ROOT / "bench/gpu"))
    import deepseek_v41_wide

    started = time.monotonic()
    config, tensors = deepseek_v41_wide.specs(args.tokenizer)
    report["checkpoint"] = {"tensors": len(tensors), "GB": round(sum(
        torch.Size(s).numel() * d.itemsize for s, d in tensors.values()) / 1e9, 2),
        "seconds": round(time.monotonic() - started, 1)}
    folder = Path(tempfile.mkdtemp(prefix="pdb-v41-dry-"))
    try:
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
            if (args.tokenizer / name).exists():
                shutil.copy2(args.tokenizer / name, folder / name)
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.models.registry import ModelRegistry

        flags = engine_args()
        report["engine_args"] = flags
        report["cli_args"] = cli = cli_flags(str(folder))
        report["cli_matches_engine_args"] = (cli["moe_backend"], cli["language_model_only"], cli["enforce_eager"],
                                             cli["enable_jit_warmup"]) == (flags["moe_backend"], True, True, False)
        vllm_config = EngineArgs(model=str(folder), load_format="dummy", **flags).create_engine_config()
        model_config = vllm_config.model_config
        report["config"] = {"architectures": model_config.architectures, "quantization": model_config.quantization,
                            "quant_config": type(vllm_config.quant_config).__name__,
                            "moe_backend": vllm_config.kernel_config.moe_backend,
                            "enforce_eager": model_config.enforce_eager,
                            "language_model_only": model_config.multimodal_config.language_model_only
                            if model_config.multimodal_config else None}
        # 3. The class on the meta device, then its own weight loading.
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{folder}/dist")
            initialize_model_parallel(1, 1)
            cls, arch = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
            started = time.monotonic()
            with torch.device("meta"):
                model = cls(vllm_config=vllm_config, prefix="")
            attn = {type(m).__name__ for n, m in model.named_modules() if n.endswith(".attn")}
            moe = {f"{type(m.quant_method).__name__} ({getattr(m.quant_method, 'mxfp4_backend', None)})"
                   for m in model.modules() if type(getattr(m, "quant_method", None)).__name__.startswith("Mxfp4")}
            linear = collections.Counter(
                f"{type(m.quant_method).__name__}"
                + "".join(f" ({type(v).__name__})" for k, v in vars(m.quant_method).items() if "kernel" in k.lower())
                for m in model.modules() if type(m).__name__.endswith("Linear") and hasattr(m, "quant_method"))
            report["model"] = {"class": f"{cls.__module__}.{cls.__name__}", "attention": sorted(attn),
                               "experts": sorted(moe), "linear": dict(linear), "parameters_GB": round(sum(
                                   t.numel() * t.element_size() for t in model.parameters()) / 1e9, 2),
                               "seconds": round(time.monotonic() - started, 1)}
            report["weights"] = weights(model, tensors)
    except Exception:
        report["error"] = traceback.format_exc()[-3000:]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    w = report.get("weights", {})
    ok = "error" not in report and w.get("keys_consumed") == w.get("checkpoint_keys") and \
        not w.get("parameters_not_loaded_beyond_vision_only") and not w.get("loader_calls_unattributed") and \
        report.get("cli_matches_engine_args")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
