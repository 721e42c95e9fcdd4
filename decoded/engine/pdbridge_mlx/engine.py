"""The decoder itself: mlx-lm model work behind the adapter's protocol.

Everything here except `info` and `tokenize` touches MLX and must run on the
adapter's single model thread (MLX is not thread-safe); the server enforces it.
mlx-lm's API is used: `load`, `stream_generate` with
`prompt_cache=` and `kv_bits=`, `make_prompt_cache`, the cache classes' `state`,
the tokenizer wrapper, and `mlx.core` ops; beyond it only what mlx-lm's own
server uses from `mlx_lm.generate` (`BatchGenerator`, `TextStateMachine`), on
the pinned mlx-lm. What a block holds per
cache class, and how a cache is rebuilt from blocks, is `pdbridge_cache.kinds`
(shared with the prefill plugin).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from google.protobuf import json_format
from pdbridge_cache import blockfile, kinds
from pdbridge_cache.format import (
    TOKENIZER_FILES, proto_dtype, safetensors_dtype, tensor_shape,
)
from pdbridge_cache.layers import CachePath, effective_rope, versions
from pdbridge_cache.proto import bridge_pb2, engine_pb2
from pdbridge_cache.safetensors_io import dtype_name, serialize, write_atomic

from .chat import ChatTokenizer
from .errors import BadRequest, BlockUnusable, Cancelled, StartupError
from .generation import Job, Output, Params, ms

log = logging.getLogger("pdbridge_mlx")

# generate_step's and mlx_lm.server's default: a native generation's chunks (the test kit's export
# chunks the same, so its blocks are the decoder's own cache).
PREFILL_STEP_SIZE = 2048


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Engine:
    """The loaded decoder: its model, tokenizer, cache spec and bundle."""

    def __init__(
        self,
        model_dir: str,
        *,
        block_tokens: int,
        dtype: mx.Dtype,
        bundle_dir: str,
        model_id: str | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        max_batch: int = 1,
        chat_template: str | None = None,
    ):
        t0 = time.perf_counter()
        self.model_dir = Path(model_dir).resolve()
        self.block_tokens = block_tokens
        self.prefill_step_size = PREFILL_STEP_SIZE
        self.cancelled = threading.Event()
        # A chat template of the deployment's choosing replaces the checkpoint's, as
        # mlx_lm.server's --chat-template: mlx-lm picks its tool parser from it.
        tokenizer_config = {"chat_template": chat_template} if chat_template is not None else None
        self.model, self.tokenizer, self.config = load(
            str(self.model_dir), return_config=True, tokenizer_config=tokenizer_config
        )
        # Only floating parameters change (scales, biases, norms); packed 4-bit
        # weights stay as they are. On x86 CPU, fp16 is emulated: use float32.
        self.model.set_dtype(dtype)
        mx.eval(self.model.parameters())
        self.chat = ChatTokenizer(self.tokenizer)
        self.layers = self.model.layers
        self.num_layers = len(self.layers)
        # As mlx-lm's generate_step(kv_bits=...), quantizing from the first token on, so the
        # spec's cache classes hold for any prompt length.
        self.kv_args = (
            {"kv_bits": kv_bits, "kv_group_size": kv_group_size, "quantized_kv_start": 0} if kv_bits else {}
        )
        try:
            self.templates = kinds.decoder_caches(self.model, kv_bits, kv_group_size)
        except ValueError as e:
            raise StartupError(f"kv_bits {kv_bits}: {e}") from None
        # mlx-lm batches only caches it can merge (not QuantizedKVCache), as mlx_lm.server decides.
        self.max_batch = max_batch
        self.can_batch = max_batch > 1 and all(hasattr(c, "merge") for c in self.templates)
        load_ms = ms(t0)

        layer_specs = self._probe_cache(kinds.decoder_caches(self.model, kv_bits, kv_group_size))
        self.model_id = model_id or self.model_dir.name
        # The spec as proto3 JSON (a dict): what `info` publishes, and what blocks are held to.
        self.spec = self._make_spec(layer_specs, dtype)
        bridged = [l["index"] for l in layer_specs if l["kind"] != kinds.UNSUPPORTED]
        self.cache_path = CachePath(self.model, self.templates, dtype, bridged)
        # A layer carrying a state from block to block cannot be computed from one block's inputs.
        self.recurrent = self.cache_path.recurrent
        # A layer that is not rewindable (a state, a pooled layer's blocks): no stored block may end
        # with a prompt's last token.
        self.rewindable = all(l["rewindable"] for l in layer_specs if l["index"] in bridged)
        # A layer whose tensors are not per-token rows: the decoder's own cache is cut into blocks
        # prefill by prefill.
        self.per_block = self.cache_path.per_block
        params = self.cache_path.needed_params(probe_tokens=block_tokens)
        bundle_bytes = serialize(params, self.cache_path.bundle_metadata(self.config, kv_bits or 0, kv_group_size))
        self.bundle_sha256 = hashlib.sha256(bundle_bytes).hexdigest()
        os.makedirs(bundle_dir, exist_ok=True)
        self.bundle_path = Path(bundle_dir).resolve() / f"bundle-{self.bundle_sha256[:16]}.safetensors"
        if not (self.bundle_path.is_file() and _sha256_file(self.bundle_path) == self.bundle_sha256):
            write_atomic(str(self.bundle_path), bundle_bytes)
        self.tokenizer_sha256 = self._tokenizer_sha256()
        self._info = engine_pb2.InfoReply(
            model_id=self.model_id,
            spec=json_format.ParseDict(self.spec, bridge_pb2.CacheSpec()),
            bundle_path=str(self.bundle_path),
            bundle_sha256=self.bundle_sha256,
            tokenizer_sha256=self.tokenizer_sha256,
        )
        classes = sorted({l["cache_class"] for l in layer_specs})
        log.info(
            "loaded %s in %.0f ms (startup %.0f ms): %d layers, caches %s, %s, bundle %s (%d bytes, %d tensors), "
            "batch %s, tool calls %s",
            self.model_dir, load_ms, ms(t0), self.num_layers, classes, dtype,
            self.bundle_path.name, len(bundle_bytes), len(params),
            f"up to {max_batch}" if self.can_batch else "off (one generation at a time)",
            self.tokenizer.tool_call_start if self.tokenizer.has_tool_calling else "none",
        )
        if max_batch > 1 and not self.can_batch:
            log.warning("caches %s cannot be batched by mlx-lm: generations run one at a time", classes)
        for l in layer_specs:
            if l["kind"] == kinds.UNSUPPORTED:
                log.warning("layer %d cannot be bridged: %s", l["index"], l["unsupported_reason"])

    # ------------------------------------------------------------------ startup

    def _probe_cache(self, caches: list) -> list[dict]:
        """Runs one block of tokens through `caches` (empty ones of the decoder's own) and
        describes, per layer, what they really hold: class, parameters, tensors with their dtype
        and per-token (or per-block) shape."""
        self.model(mx.zeros((1, self.block_tokens), mx.int32), cache=caches)
        mx.eval([c.state for c in caches])
        layers = [kinds.describe(i, c) for i, c in enumerate(caches)]
        args = getattr(self.model, "args", None)
        theta = float(getattr(args, "rope_theta", 0.0) or self.config.get("rope_theta") or 10000.0)
        scaling = getattr(args, "rope_scaling", None)
        for spec, layer in zip(layers, self.layers):
            rope = effective_rope(getattr(layer, "self_attn", None), theta, scaling if isinstance(scaling, dict) else None)
            if rope is not None:
                spec["rope"] = rope
        return layers

    def _make_spec(self, layers: list[dict], dtype: mx.Dtype) -> dict:
        """The `pdbridge.v1.CacheSpec` as proto3 JSON, but for what decoded fills in (the model
        id and the fingerprints)."""
        cfg = self.config
        architectures = cfg.get("architectures") or [cfg["model_type"]]
        # A multimodal checkpoint (Llama 4) keeps the language model's shape under text_config.
        text = {**cfg, **(cfg.get("text_config") or {})}
        return {
            "architecture": architectures[0],
            "num_layers": self.num_layers,
            "hidden_size": int(text["hidden_size"]),
            "vocab_size": int(text["vocab_size"]),
            "max_context": int(text.get("max_position_embeddings") or 0),
            "block_tokens": self.block_tokens,
            "layers": layers,
            # The device too: MLX's CPU and GPU kernels round a quantized KV cache differently.
            "decoder_code": {"model_type": str(cfg["model_type"]), **versions(),
                             "device": mx.default_device().type.name},
            # A layer's input is cast to it before its cache path: layer inputs travel in it.
            "input_dtype": proto_dtype(dtype_name(dtype)),
        }

    def _tokenizer_sha256(self) -> str:
        h = hashlib.sha256()
        for name in TOKENIZER_FILES:
            path = self.model_dir / name
            if not path.is_file():
                raise StartupError(f"{path} is missing; cannot fingerprint the tokenizer")
            h.update(path.read_bytes())
        return h.hexdigest()

    # ------------------------------------------------------- any thread (cheap)

    def info(self) -> engine_pb2.InfoReply:
        return self._info

    def tokenize(self, req: engine_pb2.TokenizeRequest) -> list[int]:
        """What mlx_lm.server would prefill for this request, but for special-token text in a
        chat's messages, which is text unless the request allows it (`chat.ChatTokenizer`)."""
        which = req.WhichOneof("input")
        if which == "messages_json":
            messages = _json(req.messages_json, "messages_json")
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
            ):
                raise BadRequest("messages must be a list of objects with a string 'role'")
            add_generation_prompt = req.add_generation_prompt if req.HasField("add_generation_prompt") else True
            kwargs = _json(req.chat_template_kwargs_json, "chat_template_kwargs_json") or {}
            if not isinstance(kwargs, dict):
                raise BadRequest("chat_template_kwargs_json must be a JSON object")
            tools = _json(req.tools_json, "tools_json")
            try:
                tokens = self.chat.tokenize(
                    messages, tools, allow_special=req.allow_special_tokens_in_content,
                    add_generation_prompt=add_generation_prompt, **kwargs,
                )
            except Exception as e:  # template errors are the request's fault
                raise BadRequest(f"chat template failed: {e}") from e
        elif which == "prompt":
            # As mlx_lm.server's /v1/completions: special tokens per the tokenizer config.
            tokens = self.tokenizer.encode(req.prompt)
        else:
            raise BadRequest("tokenize needs messages_json or prompt")
        return [int(t) for t in tokens]

    # ------------------------------------------------------ model thread only

    def parse(self, req: engine_pb2.GenerateRequest) -> Params:
        """A generate request, validated; any thread."""
        return Params.parse(req, self.spec["vocab_size"], self.block_tokens)

    def batchable(self, p: Params) -> bool:
        """Whether `p` may join the continuous batch rather than run alone."""
        return self.can_batch and not p.seeded_sampling

    def prompt_cache(self, p: Params) -> tuple[list, int]:
        """The cache the generation starts from: restored from its blocks (and tail), or empty;
        and how many prompt tokens it already holds."""
        if p.blocks or p.tail:
            return self.restore(p.blocks, p.tail, p.tokens, p.spec_fingerprint)
        return make_prompt_cache(self.model), 0

    @staticmethod
    def sampling(p: Params) -> tuple[Callable | None, list]:
        """The request's sampler (None: greedy, which a batch samples in one call for all) and
        OpenAI's penalties as mlx-lm computes them: over the last `max_tokens` tokens."""
        sampler = make_sampler(temp=p.temperature, top_p=p.top_p) if p.temperature > 0 else None
        processors = make_logits_processors(
            presence_penalty=p.presence_penalty or None, presence_context_size=p.max_tokens,
            frequency_penalty=p.frequency_penalty or None, frequency_context_size=p.max_tokens,
        )
        return sampler, processors

    def generate(self, job: Job) -> None:
        """Runs one generation alone, with mlx_lm.server's own single-request loop
        (`stream_generate`: prefill in PREFILL_STEP_SIZE chunks, EOS, streaming detokenizer)."""
        p = job.params
        admitted = time.perf_counter()
        cache, cached = self.prompt_cache(p)
        output = Output(job, self.tokenizer, cached=cached, admitted=admitted, restore_ms=ms(admitted))
        if p.seed is not None:
            mx.random.seed(p.seed)
        sampler, processors = self.sampling(p)
        responses = stream_generate(
            self.model, self.tokenizer, mx.array(p.tokens[cached:]),
            max_tokens=p.max_tokens, sampler=sampler, prompt_cache=cache, logits_processors=processors,
            prefill_step_size=self.prefill_step_size, **self.kv_args,
        )
        try:
            for r in responses:
                if self.cancelled.is_set():
                    raise Cancelled("adapter is shutting down")
                if output.step(r.token, r.text, r.logprobs, r.finish_reason):
                    return
        finally:
            responses.close()

    def reconstruct(self, req: engine_pb2.ReconstructRequest) -> engine_pb2.ReconstructReply:
        """The decoder's cache for a block's layer inputs, computed here with the decoder's own
        modules and kernels (exact on this backend by construction): reads `inputs` (a safetensors
        file of `"{layer}.input"`, [rows, hidden] in the activation dtype, tokens at `offset`..),
        writes the cache tensors (`"{layer}.{tensor}"`) to `out`."""
        if self.recurrent:
            raise BadRequest("a recurrent state chains every block before it: it cannot be computed "
                             "from one block's layer inputs")
        paths = [req.inputs, req.out]
        if not all(paths):
            raise BadRequest("inputs and out must be paths")
        offset = req.offset
        start = time.perf_counter()
        try:
            arrays = mx.load(paths[0])
        except Exception as e:  # a missing or damaged file
            raise BadRequest(f"inputs {paths[0]}: {e}") from None
        path = self.cache_path
        expected = {f"{layer}.input" for layer in path.layers}
        if set(arrays) != expected:
            raise BadRequest(f"inputs hold {sorted(arrays)[:4]}..., expected one 'input' per bridged layer")
        first = arrays[f"{path.layers[0]}.input"]
        for name, a in arrays.items():
            if a.ndim != 2 or a.shape != first.shape or a.shape[1] != path.hidden_size or a.dtype != path.dtype:
                raise BadRequest(f"{name} is {_dtype_str(a.dtype)} {list(a.shape)}, expected "
                                 f"{_dtype_str(path.dtype)} [rows, {path.hidden_size}]")
        hidden = mx.stack([arrays[f"{layer}.input"] for layer in path.layers], axis=1)
        rows = path.block(hidden, offset)
        write_atomic(paths[1], serialize([(f"{layer}.{name}", a) for layer, name, a in rows], {}))
        return engine_pb2.ReconstructReply(rows=int(first.shape[0]), timings_ms={"reconstruct": ms(start)})

    # ------------------------------------------------------------------ helpers

    def restore(self, paths: list[str], tail: str | None, tokens: list[int],
                 spec_fp: str | None) -> tuple[list, int]:
        """The decoder's caches rebuilt from the blocks (and the prompt's tail after them, all but
        its last token), and the number of prompt tokens the model will not recompute."""
        B = self.block_tokens
        parts: list[dict[str, list[mx.array]]] = [{} for _ in range(self.num_layers)]
        files = [(path, tokens[i * B:(i + 1) * B]) for i, path in enumerate(paths)]
        if tail is not None:
            files.append((tail, tokens[len(paths) * B:len(tokens) - 1]))
        covered = sum(len(ids) for _, ids in files)
        if not self.rewindable and covered > len(tokens) - 1:
            raise BadRequest(f"blocks cover {covered} of {len(tokens)} tokens: a recurrent state or pooled cache "
                             "cannot be rewound, so they must end before the prompt's last token")
        for i, (path, ids) in enumerate(files):
            arrays = self._read_block(i, path, ids, spec_fp)
            for name, a in arrays.items():
                layer, tensor = name.split(".", 1)
                parts[int(layer)].setdefault(tensor, []).append(a)
        # The model must process at least the last prompt token itself: that step yields the
        # first logits.
        cached = min(covered, len(tokens) - 1)
        cache = kinds.restore(self.templates, parts, cached, self.cache_path.dtype)
        mx.eval([c.state for c in cache])
        return cache, cached

    def _read_block(self, index: int, path: str, block_ids: list[int], spec_fp: str | None) -> dict:
        """Loads one block file (or the tail's: fewer rows) and checks it fits this decoder and
        these tokens; any mismatch is a bad request, never a silent native fallback."""
        where = f"block {index} ({path})"
        if not os.path.isfile(path):
            raise BlockUnusable(index, f"{where}: no such file")
        try:
            arrays, meta = mx.load(path, format="safetensors", return_metadata=True)
        except Exception as e:
            raise BlockUnusable(index, f"{where}: not a readable safetensors file: {e}") from e
        try:
            block = blockfile.read(meta)
        except ValueError as e:
            raise BadRequest(f"{where}: {e}") from None
        if block.data_sha256 and block.data_sha256 != blockfile.data_sha256(arrays):
            raise BlockUnusable(index, f"{where}: tensor bytes fail their checksum")
        if block.index != index:
            raise BadRequest(f"{where}: metadata index={block.index}, expected {index}")
        if spec_fp is not None and block.spec_fingerprint != spec_fp:
            raise BadRequest(f"{where}: metadata spec_fingerprint={block.spec_fingerprint!r}, expected {spec_fp!r}")
        B = len(block_ids)
        if list(block.token_ids) != list(block_ids):
            start = index * self.block_tokens
            raise BadRequest(f"{where}: holds other tokens than the prompt's tokens {start}..{start + B}")
        expected = {
            f"{layer['index']}.{t['name']}": (safetensors_dtype(t["dtype"]), tensor_shape(t, B, self.block_tokens))
            for layer in self.spec["layers"]
            for t in layer["tensors"]
        }
        if partial := sorted(name for name, (_, shape) in expected.items() if shape is None):
            raise BadRequest(f"{where}: {B} tokens, but {', '.join(partial[:4])} exist for whole blocks only")
        if missing := sorted(set(expected) - set(arrays)):
            raise BadRequest(f"{where}: missing tensors {', '.join(missing[:4])}")
        if extra := sorted(set(arrays) - set(expected)):
            raise BadRequest(f"{where}: unexpected tensors {', '.join(extra[:4])}")
        for name, (dtype, shape) in expected.items():
            a = arrays[name]
            if tuple(a.shape) != shape or _dtype_str(a.dtype) != dtype:
                raise BadRequest(
                    f"{where}: tensor {name} is {_dtype_str(a.dtype)} {list(a.shape)}, expected {dtype} {list(shape)}"
                )
        return arrays


def _json(text: str, field: str):
    """A JSON-text field of a request; empty: None."""
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"{field} is not JSON: {e}") from None


def _dtype_str(dtype: mx.Dtype) -> str:
    try:
        return dtype_name(dtype)
    except ValueError:
        return str(dtype)
