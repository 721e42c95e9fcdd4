"""The decoder's cache math, run with MLX inside the prefill engine's process.

Given the residual stream entering layer l (what vLLM's ``extract_hidden_states`` captures, before
``input_layernorm``), mlx-lm's llama ``Attention`` stores::

    x = rms_norm(h, input_layernorm.weight, eps)
    K = rope(k_proj(x) as [1, n_kv, T, head_dim], offset)      V = v_proj(x) as [1, n_kv, T, head_dim]

with ``k_proj``/``v_proj`` MLX affine-quantized linears. Running the same MLX ops (``mx.fast.rms_norm``,
``mx.quantized_matmul``, ``mx.fast.rope``) on the same tensors makes the result the decoder's own
arithmetic by construction: MLX's CPU kernels are per-token and per-output sequential, so the chunk
and offset a token is computed with do not change its bits (measured bit-exact per chunk, one-shot and
per token; see ARCHITECTURE.md, "Exactness").

The *reconstruction bundle* (safetensors, written by the decoder adapter, ``decoded/engine``)
carries exactly those weights — per layer ``model.layers.{i}.input_layernorm.weight`` and
``model.layers.{i}.self_attn.{k,v}_proj.{weight,scales,biases}`` — plus string metadata
``rms_norm_eps, rope_theta, rope_traditional, head_dim, num_kv_heads, group_size, bits`` and,
optionally, ``format, quant_mode, dtype, num_layers, spec_fingerprint``.

Only import this module where MLX may run: it imports ``mlx.core``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.input_layernorm\.weight$")
BUNDLE_FORMAT = "pdbridge-bundle-v1"
_REQUIRED_META = ("rms_norm_eps", "rope_theta", "rope_traditional", "head_dim", "num_kv_heads",
                  "group_size", "bits")


class BundleError(Exception):
    """The bundle cannot be used; `reason` is a protocol error reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _meta_value(raw: str):
    # Metadata values are strings; accept JSON scalars and Python-style booleans.
    text = raw.strip()
    if text in ("True", "False"):
        return text == "True"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@dataclass
class LayerWeights:
    norm: mx.array
    k: tuple[mx.array, mx.array, mx.array]  # packed weight, scales, biases
    v: tuple[mx.array, mx.array, mx.array]


class Bundle:
    """A loaded reconstruction bundle: the decoder's K/V-producing weights and math parameters.

    Refuses (BUNDLE_MISMATCH) whatever this module would not reproduce exactly: non-affine or
    unquantized k/v projections, a k-norm (qwen3-style), RoPE scaling, a cache dtype other than
    F32, another bundle format."""

    def __init__(self, arrays: dict[str, mx.array], meta: dict[str, str], sha256: str):
        from . import protocol

        def refuse(message: str) -> BundleError:
            return BundleError(protocol.BUNDLE_MISMATCH, message)

        missing = [k for k in _REQUIRED_META if k not in meta]
        if missing:
            raise BundleError(protocol.BUNDLE_UNREADABLE, f"bundle metadata lacks {missing}")
        values = {k: _meta_value(v) for k, v in meta.items()}
        self.sha256 = sha256
        self.eps = float(values["rms_norm_eps"])
        self.rope_theta = float(values["rope_theta"])
        self.rope_traditional = bool(values["rope_traditional"])
        self.head_dim = int(values["head_dim"])
        self.num_kv_heads = int(values["num_kv_heads"])
        self.group_size = int(values["group_size"])
        self.bits = int(values["bits"])
        self.spec_fingerprint: str | None = meta.get("spec_fingerprint")  # optional; kept verbatim
        mode = str(values.get("quant_mode", values.get("mode", "affine")))
        if meta.get("format", BUNDLE_FORMAT) != BUNDLE_FORMAT:
            raise refuse(f"bundle format {meta['format']!r}, expected {BUNDLE_FORMAT!r}")
        if mode != "affine" or self.bits <= 0 or self.group_size <= 0:
            raise refuse(f"k/v projections quantized as {mode!r} (bits {self.bits}, group "
                         f"{self.group_size}); only MLX affine quantization is supported")
        if meta.get("dtype", "F32") != "F32":
            raise refuse(f"decoder cache dtype {meta['dtype']}; only F32 is supported")
        if values.get("rope_scaling") not in (None, "", "null", {}):
            raise refuse("rope_scaling is not supported")
        if any(".k_norm." in k for k in arrays):
            raise refuse("k_norm (per-head key norm) is not supported")

        self.layers: list[int] = sorted(
            int(m.group(1)) for k in arrays if (m := _LAYER_RE.match(k))
        )
        if not self.layers:
            raise BundleError(protocol.BUNDLE_UNREADABLE, "bundle holds no layers")
        if "num_layers" in values and int(values["num_layers"]) != len(self.layers):
            raise BundleError(protocol.BUNDLE_UNREADABLE,
                              f"metadata says {values['num_layers']} layers, tensors hold "
                              f"{len(self.layers)}")
        self.weights: dict[int, LayerWeights] = {}
        try:
            for i in self.layers:
                p = f"model.layers.{i}."
                proj = lambda n: tuple(  # noqa: E731
                    arrays[f"{p}self_attn.{n}.{part}"] for part in ("weight", "scales", "biases")
                )
                self.weights[i] = LayerWeights(arrays[p + "input_layernorm.weight"], proj("k_proj"),
                                               proj("v_proj"))
        except KeyError as e:
            raise BundleError(protocol.BUNDLE_UNREADABLE, f"bundle lacks tensor {e}") from None
        kw = self.weights[self.layers[0]].k[0]
        if kw.shape[0] != self.num_kv_heads * self.head_dim:
            raise refuse(f"k_proj has {kw.shape[0]} outputs, expected num_kv_heads*head_dim")
        self.hidden_size = kw.shape[1] * 32 // self.bits

    @classmethod
    def load(cls, path: str, expected_sha256: str | None) -> Bundle:
        from . import protocol

        try:
            digest = file_sha256(path)
            if expected_sha256 and digest != expected_sha256.lower():
                raise BundleError(protocol.BUNDLE_MISMATCH,
                                  f"bundle sha256 {digest} != expected {expected_sha256}")
            arrays, meta = mx.load(path, return_metadata=True)
            bundle = cls(arrays, meta, digest)
        except BundleError:
            raise
        except Exception as e:  # OSError, MLX parse errors, bad metadata values: one reason
            raise BundleError(protocol.BUNDLE_UNREADABLE, f"{path}: {e}") from None
        mx.eval([list(vars(w).values()) for w in bundle.weights.values()])
        return bundle

    def reconstruct(self, hidden: np.ndarray, offset: int,
                    streams: list[mx.Stream] | None = None) -> list[np.ndarray]:
        """K and V for `hidden` = float32 [T, len(self.layers), hidden] at positions offset..offset+T.

        Returns ``[K(layer0), V(layer0), K(layer1), ...]`` as C-contiguous float32 numpy arrays of
        shape [1, n_kv, T, head_dim]. One ``mx.eval`` for all layers: no host sync per layer.
        Layers are spread round-robin over `streams` (each MLX CPU stream has its own thread); a
        layer's ops all run on one stream, so its bits do not depend on how many there are.
        """
        assert hidden.dtype == np.float32 and hidden.ndim == 3, (hidden.dtype, hidden.shape)
        streams = streams or [mx.default_stream(mx.default_device())]
        outs = []
        for j, layer in enumerate(self.layers):
            with mx.stream(streams[j % len(streams)]):
                outs += self._layer_kv(self.weights[layer], hidden[None, :, j, :], offset)
        mx.eval(outs)
        # V is a transposed view; the wire format wants each tensor contiguous.
        return [np.ascontiguousarray(np.asarray(a), dtype="<f4") for a in outs]

    def _layer_kv(self, w: LayerWeights, hidden: np.ndarray, offset: int) -> list[mx.array]:
        # [1, T, hidden] exactly as the decoder's TransformerBlock sees it (B=1, L=T).
        h = mx.array(hidden)
        T = h.shape[1]
        x = mx.fast.rms_norm(h, w.norm, self.eps)
        qmm = dict(transpose=True, group_size=self.group_size, bits=self.bits)
        k = mx.quantized_matmul(x, w.k[0], w.k[1], w.k[2], **qmm)
        v = mx.quantized_matmul(x, w.v[0], w.v[1], w.v[2], **qmm)
        # Head split as mlx_lm/models/llama.py Attention: reshape(B, L, n_kv, -1).transpose(0, 2, 1, 3)
        k = k.reshape(1, T, self.num_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(1, T, self.num_kv_heads, -1).transpose(0, 2, 1, 3)
        k = mx.fast.rope(k, self.head_dim, traditional=self.rope_traditional,
                         base=self.rope_theta, scale=1.0, offset=offset)
        return [k, v]
