"""Gemma 3 with the EAGLE-3 aux-hidden-state interface (see `models`).

What Llama records for layer i is ``hidden_states + residual`` as layer i receives them: the
residual stream entering the layer, the input of its ``input_layernorm``. Gemma 3's decoder layer
takes the same (hidden_states, residual) pair, so forward pre-hooks on the chosen layers record
exactly that, and the model returns ``(hidden_states, aux)`` as Llama's does. Gemma 3's own forward
runs unchanged; without pipeline parallelism only (the bridge runs it that way).
"""

from __future__ import annotations

import torch
from vllm.model_executor.models import gemma3
from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3


class _Gemma3ModelWithAux(EagleModelMixin, gemma3.Gemma3Model):
    _aux_sink: list[torch.Tensor] | None = None

    def _set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        super()._set_aux_hidden_state_layers(layers)
        beyond = [i for i in self.aux_hidden_state_layers if not self.start_layer <= i < self.end_layer]
        if beyond:
            raise ValueError(f"aux hidden states of layers {beyond} are outside this model's layers "
                             f"[{self.start_layer}, {self.end_layer})")
        for i in self.aux_hidden_state_layers:
            self.layers[i].register_forward_pre_hook(self._record)

    def _record(self, _layer, args) -> None:
        if self._aux_sink is not None:
            _positions, hidden_states, residual = args[:3]
            self._aux_sink.append(hidden_states if residual is None else hidden_states + residual)

    def forward(self, *args, **kwargs):
        if not self.aux_hidden_state_layers:
            return super().forward(*args, **kwargs)
        self._aux_sink = []
        try:
            hidden_states = super().forward(*args, **kwargs)
            return hidden_states, self._aux_sink
        finally:
            self._aux_sink = None


class Gemma3ForCausalLM(gemma3.Gemma3ForCausalLM, SupportsEagle3):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # Same module, same weights and state: only methods are added.
        self.model.__class__ = _Gemma3ModelWithAux
