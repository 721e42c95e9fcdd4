"""pd-bridge's cache codec, shared by the decoder adapter (`decoded/engine/pdbridge_mlx`) and the
prefill plugin (`prefilld/engine/pdbridge_vllm`): what a store block holds per cache kind
(`kinds`), the decoder's cache path run with its own mlx-lm modules (`layers`), and deterministic
safetensors bytes (`safetensors_io`). Both sides import this one package, so the decoder's cache
and the prefill side's reconstruction of it are defined in one place.

Imports MLX and mlx-lm; `scripts/setup-engines.sh` puts this folder on the engines' path.
"""
