"""The decoder's cache path, run with the decoder's own mlx-lm modules.

For layer l, mlx-lm's decoder block computes ``self_attn(input_layernorm(h_l), mask, cache)`` and
the attention module hands its finished keys and values (after its projections, norms, biases and
RoPE) to ``cache.update_and_fetch``. `CachePath` calls the block's input norm on a captured h_l and
hands the result to the layer's codec (`kinds.Codec.compute`) with the module its codec names and
an empty cache of the decoder's own class — or, for a layer not computed from its block's inputs
alone (a recurrent state), the request's state so far, which it advances. A codec of per-token rows
records k and v and aborts the attention, so queries, SDPA and the output projection never run (MLX
is lazy: the query path is never even evaluated); a recurrent or pooled layer runs its module whole
and only its cache is evaluated. No architecture's math is ported here: a model mlx-lm runs, this
runs.

The *bundle* carries what that needs: the decoder's config and, per layer, the input norm and the
attention parameters its cache depends on (found by probing: a parameter group is shipped when
zeroing it changes the cache), in the decoder's dtype. The prefill side instantiates the model with
mlx-lm's own loader from that config and loads only those tensors.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten, tree_unflatten

from .kinds import PER_TOKEN, codec_for, decoder_caches
from .format import BUNDLE_FORMAT
from .safetensors_io import DTYPE_NAMES, dtype_name

# A parameter of layer N's cache path: its input norm or a parameter of that module (its path there).
_LAYER_PARAM = re.compile(r"(?:^|\.)layers\.(\d+)\.(input_layernorm|self_attn|linear_attn)\.(.+)$")
# mlx-lm's RoPE modules, by the rope type a HF config names (what vLLM applies).
_ROPE_KIND = {
    "Llama3RoPE": "llama3",
    "YarnRoPE": "yarn",
    "SuScaledRoPE": "longrope",
    "DynamicNTKScalingRoPE": "dynamic",
    "ProportionalRoPE": "proportional",
}


class BundleError(Exception):
    """The bundle cannot be used. `unreadable` separates a damaged file from one that does not fit."""

    def __init__(self, message: str, *, unreadable: bool = False):
        super().__init__(message)
        self.unreadable = unreadable


def _owner(name: str) -> str:
    """The module that owns a parameter (`indexer.k_proj.weight` -> `indexer.k_proj`); a module's
    own array (`sinks`) owns itself."""
    return name.rsplit(".", 1)[0] if "." in name else name


def _owners(module: Any) -> dict[str, list[tuple[str, mx.array]]]:
    owners: dict[str, list[tuple[str, mx.array]]] = {}
    for name, array in tree_flatten(module.parameters()):
        owners.setdefault(_owner(name), []).append((name, array))
    return owners


def versions() -> dict[str, str]:
    """The decoder code that defines the cache."""
    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}


# What an mlx-lm RoPE module does whatever its config says, in HF rope-parameter terms: its YaRN
# always rounds the correction range (HF `truncate: true`); a config asking otherwise is ignored.
_ROPE_FIXED = {"YarnRoPE": {"truncate": 1.0}}


def effective_rope(attention: Any, theta: float, scaling: dict | None) -> dict | None:
    """The rotary embedding the attention module really applies, read from the instantiated
    module, not from the config (mlx-lm ignores config keys it does not know). `theta`: the base the
    model was built with, for modules that keep only their derived frequencies; `scaling`: the
    rope-scaling parameters the model was built with (numbers only, booleans as 0/1)."""
    rope = getattr(attention, "rope", None)
    if rope is None:
        return None
    name = type(rope).__name__
    scale = float(getattr(rope, "scale", 1.0))
    kind = _ROPE_KIND.get(name) or ("default" if scale == 1.0 else "linear")
    base = getattr(rope, "base", None) or theta
    spec = {"kind": kind, "module": name, "base": float(base),
            "traditional": bool(getattr(rope, "traditional", False)), "dims": int(getattr(rope, "dims", 0))}
    if kind != "default":
        numbers = {k: float(v) for k, v in (scaling or {}).items() if isinstance(v, (int, float))}
        spec["scaling"] = dict(sorted((numbers | _ROPE_FIXED.get(name, {})).items()))
    return spec


class CachePath:
    """The decoder model's per-layer cache path. `templates` are the decoder's caches (one per
    layer; their class and parameters are what reconstruction produces); `dtype` the decoder's
    activation dtype."""

    def __init__(self, model: Any, templates: list, dtype: mx.Dtype, layers: Iterable[int] | None = None):
        self.model = model
        self.templates = templates
        self.dtype = dtype
        self.layers = list(layers) if layers is not None else list(range(len(templates)))

    def restricted(self, layers: Iterable[int]) -> CachePath:
        """The same path over only those of its layers in `layers` (a pipeline stage's part)."""
        keep = set(layers)
        return CachePath(self.model, self.templates, self.dtype, [lay for lay in self.layers if lay in keep])

    def is_recurrent(self, layer: int) -> bool:
        """Whether the layer carries a state from block to block (its codec is not `from_inputs`)."""
        return not codec_for(self.templates[layer]).from_inputs

    @property
    def recurrent(self) -> bool:
        """Whether a block's tensors depend on every block before it (a layer keeps a state)."""
        return any(self.is_recurrent(layer) for layer in self.layers)

    @property
    def per_block(self) -> bool:
        """Whether blocks must be computed one by one: a layer's tensors are not one row per token
        (a state, or a window and pools), so several blocks' tensors cannot be cut from one call."""
        return any(codec_for(self.templates[layer]).extent != PER_TOKEN for layer in self.layers)

    def module(self, layer: int) -> Any:
        """The decoder's module that writes layer `layer`'s cache (the one its codec names)."""
        block = self.model.layers[layer]
        name = codec_for(self.templates[layer]).module
        module = getattr(block, name, None)
        if module is None:
            raise RuntimeError(f"layer {layer}: the decoder's block has no {name} module for its "
                               f"{type(self.templates[layer]).__name__}")
        return module

    def layer_tensors(self, layer: int, hidden: mx.array, offset: int, state: Any = None) -> dict[str, mx.array]:
        """The tensors layer `layer` caches for `hidden` = its input [1, T, hidden] at positions
        offset..offset+T (lazy; evaluate them together). A recurrent layer continues from `state`
        (its cache after the tokens before `offset`; None at 0), which it advances."""
        block = self.model.layers[layer]
        template = self.templates[layer]
        codec = codec_for(template)
        x = block.input_layernorm(hidden.astype(self.dtype))
        module = self.module(layer)
        cache = state if state is not None else codec.fresh(template)
        try:
            return codec.compute(module, x, offset, cache)
        except RuntimeError as e:
            raise RuntimeError(f"layer {layer}: {e}") from None

    def new_states(self) -> dict[int, Any]:
        """Empty states of the recurrent layers, for a request's first block."""
        return {layer: codec_for(self.templates[layer]).fresh(self.templates[layer])
                for layer in self.layers if self.is_recurrent(layer)}

    def block(self, hidden: Any, offset: int, streams: list | None = None, states: dict[int, Any] | None = None,
              only_states: bool = False) -> list[tuple[int, str, mx.array]]:
        """Every layer's tensors for a block. `hidden`: [T, len(self.layers), hidden] (numpy or
        MLX), the inputs of `self.layers` in order. `states`: the recurrent layers' states after
        the blocks before this one (`new_states()` before the first), advanced in place; blocks of
        a request must come in order. `only_states`: a block the decoder already has, run only to
        advance the states (nothing returned). Layers are spread round-robin over `streams` (on
        CPU each has its own thread); a layer's ops all run on one stream, so its bits do not
        depend on the stream count. One `mx.eval` for the whole block."""
        streams = streams or [mx.default_stream(mx.default_device())]
        states = states if states is not None else self.new_states()
        out = []
        for j, layer in enumerate(self.layers):
            if only_states and layer not in states:
                continue
            with mx.stream(streams[j % len(streams)]):
                tensors = self.layer_tensors(layer, mx.array(hidden[None, :, j, :]), offset, states.get(layer))
            out += [(layer, name, a) for name, a in tensors.items()]
        mx.eval([a for _, _, a in out])
        return [] if only_states else out

    # ---- the decoder's side: what the bundle must carry ----------------------------------------

    def needed_params(self, probe_tokens: int = 2) -> list[tuple[str, mx.array]]:
        """Input norms and the parameters of the module that writes each layer's cache (attention
        or recurrent) that the cache depends on, by name, probed per owner (a projection's weight,
        scales and biases together; a submodule's projections one by one). `probe_tokens`: how
        many tokens the probe runs (a pooled layer writes a group only once it has a block's)."""
        needed: dict[int, set[str]] = {}
        for layer in self.layers:
            module = self.module(layer)
            probe = mx.random.normal((1, probe_tokens, self.hidden_size), key=mx.random.key(layer))
            baseline = self.layer_tensors(layer, probe, 0)
            needed[layer] = set()
            for owner, params in _owners(module).items():
                module.update(tree_unflatten([(n, mx.zeros_like(a)) for n, a in params]))
                changed = self.layer_tensors(layer, probe, 0)
                module.update(tree_unflatten(params))
                if any(not mx.array_equal(baseline[n], changed[n]).item() for n in baseline):
                    needed[layer].add(owner)
        out = []
        for name, array in tree_flatten(self.model.parameters()):
            m = _LAYER_PARAM.search(name)
            if m and int(m.group(1)) in needed and (m.group(2) == "input_layernorm"
                                                    or _owner(m.group(3)) in needed[int(m.group(1))]):
                out.append((name, array))
        return sorted(out)

    @property
    def hidden_size(self) -> int:
        return int(self.model.layers[self.layers[0]].input_layernorm.weight.shape[-1])

    def bundle_metadata(self, config: dict, kv_bits: int, kv_group_size: int) -> dict[str, str]:
        return {
            "format": BUNDLE_FORMAT,
            "config": json.dumps(config, sort_keys=True),
            "dtype": dtype_name(self.dtype),
            "kv_bits": str(kv_bits),
            "kv_group_size": str(kv_group_size),
            "layers": ",".join(map(str, self.layers)),
            **versions(),
        }

    # ---- the prefill side: the cache path rebuilt from a bundle ----------------------------------

    @classmethod
    def from_bundle(cls, path: str) -> CachePath:
        """Instantiates the decoder's model class with mlx-lm's own loader (config, quantization,
        sanitize) and loads only the bundle's tensors; everything else stays lazy and unused."""
        from mlx_lm.utils import load_model

        try:
            arrays, meta = mx.load(path, return_metadata=True)
            if meta.get("format") != BUNDLE_FORMAT:
                raise BundleError(f"bundle format {meta.get('format')!r}, expected {BUNDLE_FORMAT!r}")
            config = json.loads(meta["config"])
            dtype = next(d for d, n in DTYPE_NAMES.items() if n == meta["dtype"])
            kv_bits, kv_group_size = int(meta["kv_bits"]), int(meta["kv_group_size"])
            layers = [int(i) for i in meta["layers"].split(",")]
            theirs = {k: meta[k] for k in versions()}
        except BundleError:
            raise
        except Exception as e:  # missing keys, bad JSON, an unknown dtype name
            raise BundleError(f"{path}: bad bundle metadata: {e!r}", unreadable=True) from None
        if theirs != versions():
            raise BundleError(f"the decoder runs {theirs}, this plugin {versions()}: the cache is what the "
                              "decoder's code computes, so both sides must run the same mlx and mlx-lm")
        with tempfile.TemporaryDirectory(prefix="pdbridge-bundle-") as folder:
            Path(folder, "config.json").write_text(json.dumps(config))
            os.symlink(os.path.abspath(path), Path(folder, "model.safetensors"))
            try:
                model, _ = load_model(Path(folder), lazy=True, strict=False)
            except Exception as e:
                raise BundleError(f"mlx-lm cannot build the decoder's {config.get('model_type')!r}: {e}") from None
            model.set_dtype(dtype)
            loaded = [(n, a) for n, a in tree_flatten(model.parameters()) if n in arrays]
            if len(loaded) != len(arrays):
                extra = sorted(set(arrays) - {n for n, _ in loaded})
                raise BundleError(f"tensors {extra[:4]} are not parameters of {config.get('model_type')!r}",
                                  unreadable=True)
            mx.eval([a for _, a in loaded])  # before the folder (and its link) goes
        return cls(model, decoder_caches(model, kv_bits or None, kv_group_size), dtype, layers)
