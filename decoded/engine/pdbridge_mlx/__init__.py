"""pd-bridge decode engine adapter for mlx-lm.

decoded runs it as

    PYTHONPATH=decoded/engine .venv/bin/python -m pdbridge_mlx \\
        --model <dir> --socket <path> [--block-tokens 256] [--dtype float32] \\
        [--bundle-dir <dir>] [--model-id <id>] [--max-batch 8] [--chat-template <file>]

Startup: load the model, probe its cache (one token into a fresh cache), write
the reconstruction bundle, bind the socket, then print exactly one line on
stdout, a `Ready`: `{"ready": true, "socket": "<path>"}` (on failure:
`{"error": "..."}` and exit status 1). Logs go to stderr, one line per request.
SIGTERM/SIGINT: stop, remove the socket, exit 0.

Protocol (unix stream socket): proto/engine.proto, package pdbridge.engine.v1,
where every field is documented; proto/golden/ holds an example of every
message. One request per connection: the client sends one `Request` and "\n";
the adapter answers with `Reply` lines and closes. Every line is the message's
proto3 JSON with the proto field names (snake_case; camelCase is accepted),
enums by name, 64-bit integers as strings, default values left out; the
adapter parses and prints them with the generated classes
(pdbridge_cache.proto, made by scripts/gen-proto.py) and
`google.protobuf.json_format`, so anything else is a bad request. A failure is
a last line `{"error": {"message", "kind": "ERROR_KIND_BAD_REQUEST" |
"ERROR_KIND_INTERNAL" | "ERROR_KIND_BLOCK_UNUSABLE", "block"?}}` (block: the
unusable block's index in the request's `blocks`; the tail's is len(blocks)).

* `{"info": {}}` -> `{"info": InfoReply}`: `model_id`, `spec` (a
  `pdbridge.v1.CacheSpec`: cache kinds and dtypes by their enum names,
  "CACHE_KIND_ROWS", "DTYPE_F32"; model_id and the fingerprints left to
  decoded), `bundle_path`, `bundle_sha256`, `tokenizer_sha256`.
* `{"tokenize": {"messages_json": "[...]", "add_generation_prompt"?: true,
  "tools_json"?, "chat_template_kwargs_json"?}}` or `{"tokenize": {"prompt":
  "..."}}` -> `{"tokenize": {"tokens": [...]}}`, exactly what mlx_lm.server
  would prefill. What a template renders travels as JSON text, numbers as the
  client wrote them.
* `{"generate": {"tokens", "blocks"?, "tail"?, "spec_fingerprint"?,
  "sampling"?: {"max_tokens"?, "temperature"?, "top_p"?, "seed"?, "stop"?,
  "presence_penalty"?, "frequency_penalty"?, "logprobs"?}, "tools_json"?}}` ->
  a `{"token": {"id", "text", "logprob"?, "tool_calls"?}}` line per generated
  token, then `{"done": {"finish_reason": "stop"|"length"|"tool_calls",
  "prompt_tokens", "cached_tokens", "completion_tokens", "timings_ms": {"queue",
  "restore", "prefill", "first_token", "decode", "total"}, "text"?,
  "tool_calls"?}}`. Block i covers tokens [i*B, (i+1)*B), the tail the rows
  after them; cached_tokens = min(covered, len(tokens)-1). A block that does
  not fit (metadata, names, shapes, dtype, spec fingerprint, token ids) is a
  bad request, never a silent native run; a missing, unreadable or rotten one
  is ERROR_KIND_BLOCK_UNUSABLE. The first line comes once the cache is restored
  and the prompt prefilled. The EOS token is not streamed; `done.text` carries
  text held back until the end (the detokenizer's, an unfinished stop sequence
  or tool call).
* `{"reconstruct": {"inputs", "offset", "out"}}` -> the cache of one block's
  layer inputs (`"{layer}.input"`) computed with the decoder's own modules,
  written to `out`, `{"reconstruct": {"rows", "timings_ms"}}`.

Block file (shared with decoded's store): safetensors, per layer its codec's
tensors (pdbridge_cache.kinds): "{layer}.keys" and "{layer}.values", each
[1, n_kv_heads, B, head_dim] in the cache dtype (more for a quantized KV cache),
or a recurrent layer's state after the block, "{layer}.state0", "{layer}.state1"…,
or a pooled layer's (DeepSeek-V4.1) window after the block and the groups it closed,
packed: "{layer}.window" (mxfp8), "{layer}.compress_kv" (nvfp4), "{layer}.index_k"
(mxfp4), each with its "_scales";
metadata {"format": "pdbridge-block-v2", "pdbridge": a BlockMetadata's proto3 JSON}
(proto/engine.proto; pdbridge_cache.blockfile reads and writes it).

Model work runs on one thread (MLX is not thread-safe). Generations share it as
one continuous batch of up to --max-batch (mlx-lm's BatchGenerator; a request's
restored cache joins as its prompt cache), joining and leaving between steps;
seeded sampling (temperature > 0 with a seed: mlx-lm samples from one
global generator) and caches mlx-lm cannot batch (quantized KV) run alone, after
the batch drains. info and tokenize answer on the connection's own thread, also
while generations run.
"""

__version__ = "0.1.0"
