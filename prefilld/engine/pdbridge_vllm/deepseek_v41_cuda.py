"""DeepSeek-V4.1 on CUDA: vLLM's own class (its fp8/fp4 kernels, sparse attention, KV cache and
chunked prefill), with the bridge's capture. The one module that reaches into vLLM's V4.1 internals
(its decoder layer's forward signature, two of its hyper-connection kernels, its replay switch).

The bridge needs each layer's attention input, ``collapse(streams, pre_mix)`` before ``attn_norm``,
the one vector the decoder's cache path starts from. vLLM's layer never materializes it: a fused
kernel applies the previous layer's post-mix, collapses and normalizes in one pass, and its EAGLE-3
capture hands out the streams' mean instead. So each layer's class is swapped for one whose forward,
when the model asks for its input (``capture_previous_aux``), applies the post-mix on its own
(vLLM's ``mhc_post_tilelang``), collapses the streams with the carried pre-mix (vLLM's
``hc_collapse_triton``, the kernel its model collapses the last layer with) and hands the layer the
finished streams, the input vLLM's layer takes as a pipeline stage's first: the attention then reads
exactly the captured vector. The collapse goes back in the slot of vLLM's own capture, so the
model's EAGLE-3 plumbing (the drafter route, sequence-parallel gathers) carries it unchanged; it is
part of the graph (no hooks). Layers asked for nothing keep vLLM's fused path.

While capturing, vLLM's "decoder SWA bounded replay" is off: it runs the layers after the last KV
source on each request's trailing window only, and the bridge needs every row of every layer.
Refused, with the reason: engram layers (the decoder has none), the fused all-reduce of mHC (its MoE
finalize lands inside the next layer's kernel), and pipeline stages (vLLM's V4.1 model passes no
auxiliary states between stages).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.kernels.mhc.tilelang import mhc_post_tilelang
from vllm.model_executor.kernels.mhc.triton import hc_collapse_triton
from vllm.models.deepseek_v41 import DeepseekV41ForCausalLM as VllmDeepseekV41

from . import models


class CapturingLayer:
    """Mixed into vLLM's ``DeepseekV4DecoderLayer`` by a class swap."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor | None,
                pre_mix: torch.Tensor | None = None, post_mix: torch.Tensor | None = None,
                res_mix: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                engram_hashes: torch.Tensor | None = None, engram_mask: torch.Tensor | None = None, *,
                capture_previous_aux: bool = False, mega_gate_metadata: Any = None) -> tuple:
        if not capture_previous_aux:
            return super().forward(x, positions, input_ids, pre_mix, post_mix, res_mix, residual, engram_hashes,
                                   engram_mask, mega_gate_metadata=mega_gate_metadata)
        streams, attention_input = layer_input(x, pre_mix, post_mix, res_mix, residual)
        *output, _ = super().forward(streams, positions, input_ids, pre_mix, post_mix, res_mix, None,
                                     engram_hashes, engram_mask, mega_gate_metadata=mega_gate_metadata)
        return (*output, attention_input)


def layer_input(x: torch.Tensor, pre_mix: torch.Tensor | None, post_mix: torch.Tensor | None,
                res_mix: torch.Tensor | None, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the layer then takes, its attention input). The first layer takes the embedding, whose
    collapse under the identity pre-mix is itself (a copy: vLLM's kernels may write in place); a
    stage's first takes finished streams; any other the previous layer's output and streams."""
    if residual is None and x.dim() == 2:
        return x, x.clone()
    streams = x if residual is None else mhc_post_tilelang(x, residual, post_mix, res_mix)
    return streams, hc_collapse_triton(streams, pre_mix)


class DeepseekV41ForCausalLM(VllmDeepseekV41):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if models.stage_route(vllm_config) or vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("pdbridge: DeepSeek-V4.1 on CUDA captures on one pipeline stage only (vLLM's model "
                             "passes no auxiliary states between stages)")
        inner = self.language_model.model
        if inner.fuse_mhc_all_reduce:
            raise ValueError("pdbridge: DeepSeek-V4.1's fused all-reduce of mHC leaves a layer's input unfinished "
                             "until the next layer's kernel; the capture needs it off")
        for layer in inner.layers[inner.start_layer:inner.end_layer]:
            if layer.engram is not None:
                raise ValueError("pdbridge: DeepSeek-V4.1 with engram layers: the decoder (mlx-lm) has none")
            layer.__class__ = type(f"{type(layer).__name__}Capturing", (CapturingLayer, type(layer)), {})
        # Every row of every layer: no replay of the trailing window only.
        inner.decoder_replay_layers = None
        inner.decoder_replay_start = inner.end_layer
