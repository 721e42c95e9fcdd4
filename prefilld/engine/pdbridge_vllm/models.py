"""The capture hooks for model classes vLLM does not give them, registered as a vLLM general plugin.

The bridge reads the residual stream entering every layer through vLLM's ``extract_hidden_states``
method, which uses the EAGLE-3 interface (`SupportsEagle3`); only some model classes implement it.
Gemma 3 does not ("Model does not support EAGLE3 interface but aux_hidden_state_outputs was
requested"). `register` (entry point group ``vllm.general_plugins``, installed with the engines by
``scripts/setup-engines.sh``) registers, through vLLM's public ``ModelRegistry``, a subclass that
implements it as Llama does. The classes live in their own modules, imported only when vLLM
builds such a model.
"""

from __future__ import annotations

# Architecture name → "module:class" of the subclass with the capture hooks.
AUX_HIDDEN_STATE_MODELS = {
    "Gemma3ForCausalLM": "pdbridge_vllm.gemma3:Gemma3ForCausalLM",
}


def register() -> None:
    from vllm import ModelRegistry

    for architecture, target in AUX_HIDDEN_STATE_MODELS.items():
        ModelRegistry.register_model(architecture, target)
