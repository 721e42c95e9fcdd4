"""pd-bridge's plugin for vLLM (the prefill engine).

It computes **the decoder's own KV cache** inside the prefill engine: vLLM's public
``extract_hidden_states`` speculative method captures the residual stream entering every layer;
`connector.PdBridgeConnector` (a v1 KV connector, loaded through ``kv_connector_module_path``) copies
each finished block of captured states out of vLLM's paged cache during the engine step that
completes it, and a background thread (`streamer`) runs the decoder's own input norm and attention
module (mlx-lm, loaded from the decoder's bundle by the shared `pdbridge_cache` codec) into the
decoder's own cache class (`reconstruct`) and streams the block to prefilld over a unix socket
(`protocol`), followed by an end-of-prefill event addressed to the request.

Modules: `protocol` (wire format; no dependencies), `reconstruct` (MLX), `streamer` (thread, sockets),
`connector` (vLLM). Importing this package imports none of them.
"""

__version__ = "0.1.0"
