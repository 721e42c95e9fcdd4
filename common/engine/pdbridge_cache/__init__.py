"""pd-bridge's cache codec, shared by the decoder adapter (`decoded/engine/pdbridge_mlx`) and the
prefill plugin (`prefilld/engine/pdbridge_vllm`): what a store block holds per cache kind
(`kinds`), the decoder's cache path run with its own mlx-lm modules (`layers`), and deterministic
safetensors bytes (`safetensors_io`); what every side spells the same (`format`, pure Python),
and the protos' generated modules (`proto`: `bridge_pb2`, `engine_pb2`, made by
`scripts/gen-proto.py`). Both sides import this one package, so the decoder's cache
and the prefill side's reconstruction of it are defined in one place.

Imports MLX and mlx-lm. The distribution `pdbridge-cache` (`common/engine/pyproject.toml`),
installed editable in the engines' venv by `scripts/setup-engines.sh`.
"""
