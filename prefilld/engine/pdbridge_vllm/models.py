"""The capture of each layer's input, where a model class's own does not give the bridge what it needs.

Two capture routes read the residual stream entering every layer (the input of its
``input_layernorm``, ``hidden_states + residual`` as Llama defines it):

* **the drafter route** (one process, or tensor parallelism): vLLM's ``extract_hidden_states``
  method, through the EAGLE-3 interface (`SupportsEagle3`). Some classes lack it (Gemma 3: "Model
  does not support EAGLE3 interface but aux_hidden_state_outputs was requested"); some have it but
  fail on layer 0 (DeepSeek-V2/V3 add a residual that is still None there). For those (`HOOKED`)
  forward pre-hooks on the chosen layers record the states and the forward returns
  ``(hidden_states, states)`` as Llama's does.
* **the stage route** (pipeline parallelism): vLLM 0.32's V1 model runner, the one vLLM-CPU runs,
  cannot run the drafter there (it reads ``self.drafter`` on stages that have none), so prefilld
  starts vLLM with the bridge's connector, no drafter and ``--additional-config`` `STAGE_ROUTE`.
  Each stage's model then asks its own EAGLE-3 capture for its layers' inputs (`STAGED`: classes
  with one; `Recorder.record_stage` says which) and, in its outer forward, takes them out of what
  it returns (the last stage's ``(hidden_states, inputs)``, an earlier stage's intermediate
  tensors, which would otherwise carry them to the next stage) for its connector. vLLM-CPU needs
  its compiled mode under pipeline parallelism (without the warm-up run, which eager mode skips,
  later stages have no buffer for the states they receive), so the capture must be part of the
  compiled graph: hooks added after compilation never run, and an op the compiler cannot see
  into corrupted vLLM-CPU 0.32's heap there.

`register` (a vLLM general plugin, entry point group ``vllm.general_plugins``, installed with the
engines by ``scripts/setup-engines.sh``) registers, in a vLLM the bridge captures from (its
environment has ``PDBRIDGE_CAPTURE=1``: prefilld sets it for the engine it starts; any other vLLM
of the environment keeps its own classes — on CUDA the subclasses broke vLLM's compiled start,
its CUDA-graph capture of a model's output), through vLLM's public ``ModelRegistry``, the
plugin's own classes for families vLLM-CPU has none of (`OWN`: DeepSeek-V4.1, which hands out its
layers' attention inputs itself; on CUDA vLLM's own class with the capture, `OWN_ON_CUDA`) and a
subclass of each of the above: same module, same weights,
only methods added, and unchanged behaviour until a route asks for the capture. The subclasses
are built on first use (vLLM imports ``pdbridge_vllm.models:<class>`` only when it builds such a
model), so registering costs no model import. A process's model is found again with `recorder()`
(one model per vLLM worker).
"""

from __future__ import annotations

import importlib
import json
import os
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# Architecture → the vLLM module defining it. Hooked for both routes.
HOOKED = {
    "Gemma3ForCausalLM": "vllm.model_executor.models.gemma3",
    "DeepseekV3ForCausalLM": "vllm.model_executor.models.deepseek_v2",
}
# Their own EAGLE-3 capture serves both routes; the stage route takes it out of their output.
STAGED = {
    "LlamaForCausalLM": "vllm.model_executor.models.llama",
    "Qwen3ForCausalLM": "vllm.model_executor.models.qwen3",
}

_built: weakref.ref | None = None  # the inner module of the model this process built


def _gemma3_embedding_scale(inner: Any) -> None:
    """mlx-lm's Gemma 3 (``gemma3_text``) scales the embeddings by √hidden rounded to bf16, in any
    dtype (25.25 for Gemma 3 270M's 640); vLLM's by √hidden in the engine's dtype (25.2982 in fp32,
    0.19 % more). The captured inputs must be the decoder's, so the capture class takes its scale."""
    import torch

    inner.normalizer.fill_(torch.tensor(inner.config.hidden_size**0.5, dtype=torch.bfloat16).item())


# What the decoder computes otherwise than vLLM's class before the first layer, applied to the
# capture class's inner module (the one holding ``layers``) when it is built.
DECODER_ARITHMETIC = {"Gemma3ForCausalLM": _gemma3_embedding_scale}


# The plugin's own classes, for families vLLM-CPU cannot run, declared once for this package and
# prefilld (which embeds the file): by architecture, the module defining its class on vLLM-CPU
# (`cpu_module`), the module adding the capture to vLLM's own class on CUDA (`cuda_module`), and
# the vLLM arguments the CPU class needs (`cpu_vllm_args`, `{max_model_len}` filled in by prefilld:
# a prompt whole in one step, ids without the family's prompt encoder, the checkpoint's fp8 and fp4
# tensors dequantized by the class itself rather than vLLM's quantization).
OWN_CLASSES = json.loads((Path(__file__).with_name("own_classes.json")).read_text())
OWN = {architecture: own["cpu_module"] for architecture, own in OWN_CLASSES.items()}
OWN_ON_CUDA = {architecture: own["cuda_module"] for architecture, own in OWN_CLASSES.items()}


# In the environment of a vLLM the bridge captures from (prefilld's engine, the test kit's servers).
CAPTURE_ENV = "PDBRIDGE_CAPTURE"
# The build prefilld's config says vLLM is (`engine.device`: cpu or cuda).
DEVICE_ENV = "PDBRIDGE_DEVICE"


def register() -> None:
    if os.environ.get(CAPTURE_ENV) != "1":
        return
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    device = "cuda" if current_platform.is_cuda() else "cpu"
    said = os.environ.get(DEVICE_ENV, device)
    if said != device:
        raise RuntimeError(f"pdbridge: prefilld's engine.device is {said!r}, but this vLLM is its {device} build; "
                           f"set engine.device = {device!r} (or point engine.python at vLLM's {said} build)")
    for architecture in (*HOOKED, *STAGED):
        ModelRegistry.register_model(architecture, f"{__name__}:{architecture}")
    for architecture, module in (OWN_ON_CUDA if device == "cuda" else OWN).items():
        ModelRegistry.register_model(architecture, f"{module}:{architecture}")


def recorder() -> Recorder | None:
    """The recording inner module of the model this process built, if its class is one of ours."""
    return _built() if _built is not None else None


# vLLM's `additional_config` entry that selects the stage route. Being part of the config's hash, it
# also keeps the stage route's compiled graph (which returns the layers' inputs) and a plain
# engine's apart in vLLM's compile cache.
STAGE_ROUTE = {"pdbridge_capture": "stages"}


def stage_route(vllm_config: Any) -> bool:
    """Whether this engine captures on the stage route (`STAGE_ROUTE` in its additional config)."""
    extra = vllm_config.additional_config
    return isinstance(extra, dict) and all(extra.get(k) == v for k, v in STAGE_ROUTE.items())


class Recorder:
    """Mixed into a model's inner module (the one holding ``layers``) by a class swap."""

    _captured_layers: tuple[int, ...] = ()
    _hooks: tuple = ()
    _returns_inputs = False  # the drafter route: forward returns (hidden_states, inputs)
    _sink: list | None = None  # the drafter route's inputs during a forward
    _wanted: Callable[[], bool] = staticmethod(lambda: False)  # the stage route: keep this forward's?
    _stage_inputs: list | None = None

    @property
    def captured_layers(self) -> tuple[int, ...]:
        return self._captured_layers

    def record_layer_inputs(self, layers: Iterable[int]) -> None:
        """The drafter route (`set_aux_hidden_state_layers`)."""
        layers = tuple(sorted(set(layers)))
        beyond = [i for i in layers if not self.start_layer <= i < self.end_layer]
        if beyond:
            raise ValueError(f"layer inputs {beyond} are outside this model's layers "
                             f"[{self.start_layer}, {self.end_layer})")
        for handle in self._hooks:  # a new choice replaces the old one
            handle.remove()
        self._hooks = tuple(self.layers[i].register_forward_pre_hook(self._record) for i in layers)
        self._captured_layers = layers
        self._returns_inputs = True
        self.aux_hidden_state_layers = ()  # the model's own capture stays off

    def _record(self, _layer: Any, args: tuple) -> None:
        # Layers are called as layer(positions, hidden_states, residual, ...), residual None at the first.
        if self._sink is not None:
            _positions, hidden_states, residual = args[:3]
            self._sink.append(_layer_input(hidden_states, residual))

    def _maybe_add_hidden_state(self, aux_hidden_states: list, layer_idx: int, hidden_states: Any,
                                residual: Any) -> list:
        # The model's own EAGLE-3 capture, as it is but for the first layer's input, kept by reference there.
        if layer_idx in self.aux_hidden_state_layers:
            aux_hidden_states.append(_layer_input(hidden_states, residual))
        return aux_hidden_states

    def record_stage(self) -> None:
        """The stage route: this stage's layers' inputs from the model's own capture, for
        `take_stage_output`."""
        if not hasattr(self, "pack_local_aux_hidden_states"):
            raise RuntimeError(f"pdbridge: pipeline stages capture with the model's own EAGLE-3 "
                               f"capture, which {type(self).__name__} lacks; classes with it: {sorted(STAGED)}")
        # The capture takes a layer's input after the layer before it ran (the first stage's
        # first also before), so a stage gives the inputs of its layers but its first, and of the
        # next stage's first: every layer's once over the stages.
        first = self.start_layer if self.start_layer == 0 else self.start_layer + 1
        layers = tuple(range(first, min(self.end_layer + 1, len(self.layers))))
        if not layers:
            raise RuntimeError(f"pdbridge: the pipeline stage of layers [{self.start_layer}, {self.end_layer}) "
                               "captures none (the stage before it captures its first layer's input); "
                               "a stage after the first needs two layers or more")
        # Set directly, not through `_set_aux_hidden_state_layers`: each stage keeps its own,
        # numbered from 0, and expects none from the stage before it.
        self.aux_hidden_state_layers = self._captured_layers = layers

    def want_stage_inputs(self, wanted: Callable[[], bool]) -> None:
        """Keep the inputs of the forwards for which `wanted()` holds (the step has bridge work;
        never a profiling or warm-up run)."""
        self._wanted = wanted

    def take_stage_output(self, output: Any) -> Any:
        """What the stage returns without its layers' inputs, which are kept when wanted."""
        if isinstance(output, tuple):  # the last stage: (hidden_states, inputs)
            output, inputs = output
        else:  # an earlier stage's intermediate tensors
            keys = [k for k in output.tensors if k.startswith(self.AUX_HIDDEN_STATE_KEY)]
            inputs = [output.tensors.pop(k) for k in sorted(keys, key=lambda k: int(k[len(self.AUX_HIDDEN_STATE_KEY):]))]
        self._stage_inputs = inputs if self._wanted() else None
        return output

    def take_stage_inputs(self) -> list:
        """The last forward's inputs of this stage's layers, ascending: one [tokens, hidden] each."""
        inputs, self._stage_inputs = self._stage_inputs, None
        return inputs or []

    def forward(self, *args, **kwargs):
        if not self._returns_inputs:
            return super().forward(*args, **kwargs)
        self._sink = []
        try:
            return super().forward(*args, **kwargs), self._sink
        finally:
            self._sink = None


def _layer_input(hidden_states: Any, residual: Any) -> Any:
    """The residual stream entering a layer, in a tensor of its own. Without a residual (the first
    layer) it is the embedding tensor itself, which becomes the layer's residual: on CUDA vLLM's
    fused add-norm then updates it in place (its `vllm_c` kernel; the CPU build's is out of place),
    so a reference would hold the last layer's residual by the time the states are read."""
    return hidden_states.clone() if residual is None else hidden_states + residual


def _recording(base: type, drafter_hooks: bool) -> type:
    from vllm.model_executor.models.interfaces import SupportsEagle3

    class Recording(base, *((SupportsEagle3,) if drafter_hooks else ())):
        def __init__(self, *, vllm_config, prefix: str = ""):
            global _built
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            inner = type(self.model)
            self.model.__class__ = type(f"{inner.__name__}Recording", (Recorder, inner), {})
            _built = weakref.ref(self.model)
            if base.__name__ in DECODER_ARITHMETIC:
                DECODER_ARITHMETIC[base.__name__](self.model)
            self._stage_route = stage_route(vllm_config)
            if self._stage_route:  # now: vLLM compiles the inner forward as it is after __init__
                self.model.record_stage()

        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            return self.model.take_stage_output(output) if self._stage_route else output

        if drafter_hooks:
            def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
                self.model.record_layer_inputs(layers)

    Recording.__name__ = Recording.__qualname__ = base.__name__
    return Recording


def __getattr__(name: str) -> type:
    module = HOOKED.get(name) or STAGED.get(name)
    if module is None:
        raise AttributeError(name)
    cls = _recording(getattr(importlib.import_module(module), name), drafter_hooks=name in HOOKED)
    globals()[name] = cls
    return cls
