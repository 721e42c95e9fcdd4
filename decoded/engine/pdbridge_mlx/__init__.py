"""pd-bridge decode engine adapter for mlx-lm.

decoded runs it as

    PYTHONPATH=decoded/engine .venv/bin/python -m pdbridge_mlx \\
        --model <dir> --socket <path> [--block-tokens 256] [--dtype float32] \\
        [--bundle-dir <dir>] [--model-id <id>] [--max-batch 8] [--chat-template <file>]

Startup: load the model, probe its cache (one token into a fresh cache), write
the reconstruction bundle, bind the socket, then print exactly one line
`{"ready": true, "socket": "<path>"}` on stdout (on failure:
`{"ready": false, "error": "..."}` and exit status 1). Logs go to stderr, one
line per request. SIGTERM/SIGINT: stop, remove the socket, exit 0.

Protocol (unix stream socket): one request per connection. The client sends
one JSON object and "\\n"; the adapter answers with JSON lines and closes. A
failure is a last line `{"error": "<message>", "kind": "bad_request"|"internal"}`.

* `{"op": "info"}` -> `{"model_id", "spec", "bundle_path", "bundle_sha256",
  "tokenizer_sha256"}`; `spec` mirrors `pdbridge.v1.CacheSpec` (snake_case,
  dtypes as safetensors names, e.g. "F32"), without the fingerprints decoded
  computes itself.
* `{"op": "tokenize", "messages": [...], "add_generation_prompt": true}` (optional
  "tools", "chat_template_kwargs") or `{"op": "tokenize", "prompt": "..."}` ->
  `{"tokens": [...]}`, exactly what mlx_lm.server would prefill.
* `{"op": "generate", "tokens": [...], "blocks": [paths], "max_tokens": N,
  "temperature": 0.0, "top_p": 1.0, "seed": null, "spec_fingerprint": "..."?}`
  -> one `{"token": id, "text": delta}` line per generated token, then
  `{"done": true, "finish_reason": "stop"|"length", "prompt_tokens",
  "cached_tokens", "completion_tokens", "timings_ms": {"queue", "restore",
  "prefill", "first_token", "decode", "total"}, "text"?}`. Block i covers tokens
  [i*B, (i+1)*B); cached_tokens = min(len(blocks)*B, len(tokens)-1). A block
  that does not fit (metadata, names, shapes, dtype, spec fingerprint, token
  ids) is a bad_request, never a silent native run. The EOS token is not
  streamed; "text" on the done line carries text the detokenizer held back
  until the end (present only when non-empty).
* `{"op": "export", "tokens": [...], "dir": path, "block_tokens": B,
  "spec_fingerprint"?: hex, "keys"?: [hex]}` -> the decoder's native cache of
  `tokens`, one file per whole block, `{"blocks": n, "files": [...],
  "timings_ms": {...}}`.

Block file (shared with decoded's store): safetensors, per layer its codec's
tensors (pdbridge_cache.kinds): "{layer}.keys" and "{layer}.values", each
[1, n_kv_heads, B, head_dim] in the cache dtype (more for a quantized KV cache),
or a recurrent layer's state after the block, "{layer}.state0", "{layer}.state1"…,
or a pooled layer's (DeepSeek-V4.1) window after the block and the groups it closed,
packed: "{layer}.window" (mxfp8), "{layer}.compress_kv" (nvfp4), "{layer}.index_k"
(mxfp4), each with its "_scales";
metadata format="pdbridge-block-v1", pdb_block, pdb_tokens, pdb_spec, pdb_key
(+ pdb_parent, pdb_token_ids as decoded's store writes them).

Model work runs on one thread (MLX is not thread-safe). Generations share it as
one continuous batch of up to --max-batch (mlx-lm's BatchGenerator; a request's
restored cache joins as its prompt cache), joining and leaving between steps;
export, seeded sampling (temperature > 0 with a seed: mlx-lm samples from one
global generator) and caches mlx-lm cannot batch (quantized KV) run alone, after
the batch drains. info and tokenize answer on the connection's own thread, also
while generations run.
"""

__version__ = "0.1.0"
