"""The decoder itself: mlx-lm model work behind the adapter's protocol.

Everything here except `info` and `tokenize` touches MLX and must run on the
adapter's single model thread (MLX is not thread-safe); the server enforces it.
Only mlx-lm's public API is used: `load`, `stream_generate`/`generate_step`
with `prompt_cache=` and `kv_bits=`, `make_prompt_cache`, the cache classes'
`state`, the tokenizer wrapper, and `mlx.core` ops. What a block holds per
cache class, and how a cache is rebuilt from blocks, is `pdbridge_cache.kinds`
(shared with the prefill plugin).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from pdbridge_cache import kinds
from pdbridge_cache.layers import CachePath, effective_rope, versions
from pdbridge_cache.safetensors_io import dtype_name, serialize, tensor_bytes, write_atomic

from .errors import BadRequest, BlockUnusable, Cancelled, StartupError

log = logging.getLogger("pdbridge_mlx")

BLOCK_FORMAT = "pdbridge-block-v1"
# Block metadata: SHA-256 of the tensors' bytes, tensor by tensor in name order
# (written by decoded's store).
DATA_SHA256 = "pdb_data_sha256"
# generate_step's and mlx_lm.server's default; export must chunk exactly as a
# native generation would so its blocks are the decoder's own cache.
PREFILL_STEP_SIZE = 2048
# Parent key of block 0 in decoded's store (`BlockKey::ROOT`).
ROOT_KEY = "00" * 32
# Files whose bytes define how text becomes token ids (tokenizer + chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Newer transformers keep the chat template beside the config; hash it when present.
EXTRA_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


Emit = Callable[[dict], None]


def _ms(start: float, end: float | None = None) -> float:
    return round(((end if end is not None else time.perf_counter()) - start) * 1000.0, 3)


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
    ):
        t0 = time.perf_counter()
        self.model_dir = Path(model_dir).resolve()
        self.block_tokens = block_tokens
        self.cancelled = threading.Event()
        self.model, self.tokenizer, self.config = load(str(self.model_dir), return_config=True)
        # Only floating parameters change (scales, biases, norms); packed 4-bit
        # weights stay as they are. On x86 CPU, fp16 is emulated: use float32.
        self.model.set_dtype(dtype)
        mx.eval(self.model.parameters())
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
        load_ms = _ms(t0)

        layer_specs = self._probe_cache(kinds.decoder_caches(self.model, kv_bits, kv_group_size))
        self.spec = self._make_spec(model_id or self.model_dir.name, layer_specs)
        bridged = [l["index"] for l in layer_specs if l["kind"] == kinds.ROWS]
        self.cache_path = CachePath(self.model, self.templates, dtype, bridged)
        params = self.cache_path.needed_params()
        bundle_bytes = serialize(params, self.cache_path.bundle_metadata(self.config, kv_bits or 0, kv_group_size))
        self.bundle_sha256 = hashlib.sha256(bundle_bytes).hexdigest()
        os.makedirs(bundle_dir, exist_ok=True)
        self.bundle_path = Path(bundle_dir).resolve() / f"bundle-{self.bundle_sha256[:16]}.safetensors"
        if not (self.bundle_path.is_file() and _sha256_file(self.bundle_path) == self.bundle_sha256):
            write_atomic(str(self.bundle_path), bundle_bytes)
        self.tokenizer_sha256 = self._tokenizer_sha256()
        self._info = {
            "model_id": self.spec["model_id"],
            "spec": self.spec,
            "bundle_path": str(self.bundle_path),
            "bundle_sha256": self.bundle_sha256,
            "tokenizer_sha256": self.tokenizer_sha256,
        }
        classes = sorted({l["cache_class"] for l in layer_specs})
        log.info(
            "loaded %s in %.0f ms (startup %.0f ms): %d layers, caches %s, %s, bundle %s (%d bytes, %d tensors)",
            self.model_dir, load_ms, _ms(t0), self.num_layers, classes, dtype,
            self.bundle_path.name, len(bundle_bytes), len(params),
        )
        for l in layer_specs:
            if l["kind"] != kinds.ROWS:
                log.warning("layer %d cannot be bridged: %s", l["index"], l["unsupported_reason"])

    # ------------------------------------------------------------------ startup

    def _probe_cache(self, caches: list) -> list[dict]:
        """Runs one token through `caches` (empty ones of the decoder's own) and describes, per
        layer, what they really hold: class, parameters, tensors with their dtype and per-token
        shape."""
        self.model(mx.array([[0]]), cache=caches)
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

    def _make_spec(self, model_id: str, layers: list[dict]) -> dict:
        cfg = self.config
        heads = int(cfg["num_attention_heads"])
        architectures = cfg.get("architectures") or [cfg["model_type"]]
        return {
            "model_id": model_id,
            "architecture": architectures[0],
            "num_layers": self.num_layers,
            "num_attention_heads": heads,
            "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            "hidden_size": int(cfg["hidden_size"]),
            "vocab_size": int(cfg["vocab_size"]),
            "max_context": int(cfg.get("max_position_embeddings") or 0),
            "block_tokens": self.block_tokens,
            "layers": layers,
            "decoder_code": {"model_type": str(cfg["model_type"]), **versions()},
        }

    def _tokenizer_sha256(self) -> str:
        h = hashlib.sha256()
        names = [n for n in TOKENIZER_FILES] + [
            n for n in EXTRA_TEMPLATE_FILES if (self.model_dir / n).is_file()
        ]
        for name in names:
            path = self.model_dir / name
            if not path.is_file():
                raise StartupError(f"{path} is missing; cannot fingerprint the tokenizer")
            h.update(path.read_bytes())
        return h.hexdigest()

    # ------------------------------------------------------- any thread (cheap)

    def info(self) -> dict:
        return self._info

    def tokenize(self, req: dict) -> list[int]:
        """Exactly what mlx_lm.server would prefill for this request."""
        if "messages" in req:
            messages = req["messages"]
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
            ):
                raise BadRequest("messages must be a list of objects with a string 'role'")
            add_generation_prompt = req.get("add_generation_prompt", True)
            if not isinstance(add_generation_prompt, bool):
                raise BadRequest("add_generation_prompt must be a boolean")
            kwargs = dict(req.get("chat_template_kwargs") or {})
            if req.get("tools") is not None:
                kwargs["tools"] = req["tools"]
            try:
                tokens = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
                )
            except Exception as e:  # template errors are the request's fault
                raise BadRequest(f"chat template failed: {e}") from e
        elif "prompt" in req:
            if not isinstance(req["prompt"], str):
                raise BadRequest("prompt must be a string")
            # As mlx_lm.server's /v1/completions: special tokens per the tokenizer config.
            tokens = self.tokenizer.encode(req["prompt"])
        else:
            raise BadRequest("tokenize needs 'messages' or 'prompt'")
        return [int(t) for t in tokens]

    # ------------------------------------------------------ model thread only

    def generate(self, req: dict, emit: Emit, received: float) -> dict:
        """Restores `blocks` (if any) into a fresh cache, lets the model process
        the rest of the prompt and streams the new tokens through `emit`."""
        tokens = self._tokens(req)
        max_tokens = _int(req, "max_tokens", 256, lo=1)
        temperature = _float(req, "temperature", 0.0, lo=0.0)
        top_p = _float(req, "top_p", 1.0, lo=0.0, hi=1.0)
        seed = req.get("seed")
        if seed is not None and (type(seed) is not int or seed < 0):
            raise BadRequest("seed must be a non-negative integer or null")
        presence = _float(req, "presence_penalty", 0.0, lo=-2.0, hi=2.0)
        frequency = _float(req, "frequency_penalty", 0.0, lo=-2.0, hi=2.0)
        top_logprobs = req.get("logprobs")
        if top_logprobs is not None and (type(top_logprobs) is not int or not 0 <= top_logprobs <= 20):
            raise BadRequest("logprobs must be null or the number of alternatives, 0 to 20")
        blocks = req.get("blocks") or []
        if not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks):
            raise BadRequest("blocks must be a list of file paths")
        tail = req.get("tail")
        if tail is not None and not isinstance(tail, str):
            raise BadRequest("tail must be a file path or null")
        spec_fp = req.get("spec_fingerprint")
        if spec_fp is not None and not isinstance(spec_fp, str):
            raise BadRequest("spec_fingerprint must be a string")
        stops = req.get("stop") or []
        if not isinstance(stops, list) or not all(isinstance(t, str) and t for t in stops):
            raise BadRequest("stop must be a list of non-empty strings")
        if len(blocks) * self.block_tokens > len(tokens):
            raise BadRequest(
                f"{len(blocks)} blocks of {self.block_tokens} tokens cover more than the "
                f"{len(tokens)}-token prompt"
            )

        start = time.perf_counter()
        if blocks or tail:
            cache, cached = self._restore(blocks, tail, tokens, spec_fp)
        else:
            cache, cached = make_prompt_cache(self.model), 0
        restore_ms = _ms(start)

        if seed is not None:
            mx.random.seed(seed)
        sampler = make_sampler(temp=temperature, top_p=top_p)
        # OpenAI's penalties, as mlx-lm computes them: over the last `max_tokens` tokens.
        processors = make_logits_processors(
            presence_penalty=presence or None, presence_context_size=max_tokens,
            frequency_penalty=frequency or None, frequency_context_size=max_tokens,
        )
        finish, tail, completion = "length", "", 0
        stop_text = StopText(stops)
        prefill_ms = first_token_ms = None
        t_gen = t_decode = time.perf_counter()
        # stream_generate is mlx_lm.server's own loop: generate_step prefill in
        # PREFILL_STEP_SIZE chunks, EOS handling, streaming detokenizer.
        responses = stream_generate(
            self.model, self.tokenizer, mx.array(tokens[cached:]),
            max_tokens=max_tokens, sampler=sampler, prompt_cache=cache, logits_processors=processors,
            prefill_step_size=PREFILL_STEP_SIZE, **self.kv_args,
        )
        try:
            for r in responses:
                if prefill_ms is None:
                    prefill_ms, first_token_ms = _ms(t_gen), _ms(received)
                    t_decode = time.perf_counter()
                if r.finish_reason == "stop":  # r.token is the EOS: not output
                    finish = "stop"
                    tail, _ = stop_text.push(r.text)
                    break
                completion += 1
                text, stopped = stop_text.push(r.text)
                if text or not stops or top_logprobs is not None:
                    event = {"token": int(r.token), "text": text}
                    if top_logprobs is not None:
                        event["logprob"] = self._logprob(r.token, r.logprobs, top_logprobs)
                    emit(event)
                if stopped:
                    finish = "stop"
                    break
                if r.finish_reason == "length":
                    break
                if self.cancelled.is_set():
                    raise Cancelled("adapter is shutting down")
        finally:
            responses.close()
        done = {
            "done": True,
            "finish_reason": finish,
            "prompt_tokens": len(tokens),
            "cached_tokens": cached,
            "completion_tokens": completion,
            "timings_ms": {
                "queue": _ms(received, start),
                "restore": restore_ms,
                "prefill": prefill_ms,
                "first_token": first_token_ms,
                "decode": _ms(t_decode),
                "total": _ms(received),
            },
        }
        # Text held back until the end: by the detokenizer (e.g. a partial UTF-8 char) or as a
        # possible start of a stop sequence that never completed.
        tail += stop_text.flush()
        if tail:
            done["text"] = tail
        return done

    def export(self, req: dict) -> dict:
        """Computes the decoder's native cache for `tokens` and writes each
        whole block as a block file."""
        tokens = self._tokens(req)
        out_dir = req.get("dir")
        if not isinstance(out_dir, str) or not out_dir:
            raise BadRequest("dir must be a path")
        block_tokens = _int(req, "block_tokens", self.block_tokens, lo=1)
        spec_fp = req.get("spec_fingerprint") or ""
        if not isinstance(spec_fp, str):
            raise BadRequest("spec_fingerprint must be a string")
        n = len(tokens) // block_tokens
        keys = req.get("keys")
        if keys is not None and (
            not isinstance(keys, list) or len(keys) < n or not all(isinstance(k, str) for k in keys)
        ):
            raise BadRequest(f"keys must be a list of at least {n} hex strings")
        os.makedirs(out_dir, exist_ok=True)

        start = time.perf_counter()
        cache = make_prompt_cache(self.model)
        if n:
            # The whole prompt, as a native generation of it would prefill it;
            # max_tokens=0 stops right after the last prompt token is processed.
            for _ in generate_step(
                mx.array(tokens), self.model, prompt_cache=cache,
                max_tokens=0, prefill_step_size=PREFILL_STEP_SIZE, **self.kv_args,
            ):
                pass
        prefill_ms = _ms(start)

        t_write = time.perf_counter()
        rows = [kinds.codec_for(c).rows(c) for c in cache] if n else []
        for layer, r in enumerate(rows):
            if any(a.shape[kinds.TOKEN_AXIS] != len(tokens) for a in r.values()):
                raise BadRequest(f"layer {layer}'s {type(cache[layer]).__name__} no longer holds every "
                                 "prompt token; its blocks cannot be exported")
        files = []
        for i in range(n):
            lo, hi = i * block_tokens, (i + 1) * block_tokens
            tensors = [(f"{layer}.{name}", a[..., lo:hi, :]) for layer, r in enumerate(rows) for name, a in r.items()]
            metadata = {
                "format": BLOCK_FORMAT,
                "pdb_block": str(i),
                "pdb_tokens": str(block_tokens),
                "pdb_spec": spec_fp,
                "pdb_key": keys[i] if keys else "",
                "pdb_parent": (keys[i - 1] if i else ROOT_KEY) if keys else "",
                "pdb_token_ids": ",".join(map(str, tokens[lo:hi])),
                DATA_SHA256: _data_sha256(dict(tensors)),
            }
            path = os.path.join(os.path.abspath(out_dir), f"block-{i:06}.safetensors")
            write_atomic(path, serialize(tensors, metadata))
            files.append(path)
        return {
            "blocks": n,
            "files": files,
            "timings_ms": {"prefill": prefill_ms, "write": _ms(t_write)},
        }

    # ------------------------------------------------------------------ helpers

    def _logprob(self, token: int, logprobs: mx.array, top: int) -> dict:
        """OpenAI's logprob entry for the sampled `token`: its text, log probability and UTF-8
        bytes, and the `top` most likely tokens at that step."""
        def entry(t: int, lp: float) -> dict:
            text = self.tokenizer.decode([t])
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        chosen = entry(int(token), logprobs[int(token)].item())
        if top:
            best = mx.argpartition(-logprobs, kth=top - 1)[:top]
            pairs = sorted(zip(best.tolist(), logprobs[best].tolist()), key=lambda p: -p[1])
            chosen["top_logprobs"] = [entry(t, lp) for t, lp in pairs]
        else:
            chosen["top_logprobs"] = []
        return chosen

    def _tokens(self, req: dict) -> list[int]:
        tokens = req.get("tokens")
        vocab = self.spec["vocab_size"]
        if not isinstance(tokens, list) or not tokens:
            raise BadRequest("tokens must be a non-empty list of token ids")
        for t in tokens:
            if type(t) is not int or not 0 <= t < vocab:
                raise BadRequest(f"token id {t!r} is not in [0, {vocab})")
        return tokens

    def _restore(self, paths: list[str], tail: str | None, tokens: list[int],
                 spec_fp: str | None) -> tuple[list, int]:
        """The decoder's caches rebuilt from the blocks (and the prompt's tail after them, all but
        its last token), and the number of prompt tokens the model will not recompute."""
        B = self.block_tokens
        parts: list[dict[str, list[mx.array]]] = [{} for _ in range(self.num_layers)]
        files = [(path, tokens[i * B:(i + 1) * B]) for i, path in enumerate(paths)]
        if tail is not None:
            files.append((tail, tokens[len(paths) * B:len(tokens) - 1]))
        for i, (path, ids) in enumerate(files):
            arrays = self._read_block(i, path, ids, spec_fp)
            for name, a in arrays.items():
                layer, tensor = name.split(".", 1)
                parts[int(layer)].setdefault(tensor, []).append(a)
        # The model must process at least the last prompt token itself: that step yields the
        # first logits.
        cached = min(sum(len(ids) for _, ids in files), len(tokens) - 1)
        rows = [
            {t: mx.concatenate(p, axis=kinds.TOKEN_AXIS)[..., :cached, :] for t, p in layer.items()}
            for layer in parts
        ]
        cache = kinds.restore(self.templates, rows, cached)
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
        if (recorded := meta.get(DATA_SHA256)) is not None and recorded != _data_sha256(arrays):
            raise BlockUnusable(index, f"{where}: tensor bytes fail their checksum")
        B = len(block_ids)
        expect_meta = {"format": BLOCK_FORMAT, "pdb_block": str(index), "pdb_tokens": str(B)}
        if spec_fp is not None:
            expect_meta["pdb_spec"] = spec_fp
        for key, want in expect_meta.items():
            if meta.get(key) != want:
                raise BadRequest(f"{where}: metadata {key}={meta.get(key)!r}, expected {want!r}")
        if "pdb_token_ids" in meta and meta["pdb_token_ids"] != ",".join(map(str, block_ids)):
            start = index * self.block_tokens
            raise BadRequest(f"{where}: holds other tokens than the prompt's tokens {start}..{start + B}")
        expected = {
            f"{layer['index']}.{t['name']}": (t["dtype"], tuple(B if i == t["token_axis"] else d for i, d in enumerate(t["shape"])))
            for layer in self.spec["layers"]
            for t in layer["tensors"]
        }
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


class StopText:
    """Stop sequences over streamed text: `push` returns the text safe to send now and whether a
    stop sequence completed. Text that could still become a stop sequence is held back, and a stop
    sequence itself is never returned, as OpenAI's `stop` behaves."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def push(self, piece: str) -> tuple[str, bool]:
        self.pending += piece
        found = [i for stop in self.stops if (i := self.pending.find(stop)) >= 0]
        if found:
            out, self.pending = self.pending[: min(found)], ""
            return out, True
        held = max((k for stop in self.stops for k in range(1, len(stop)) if self.pending.endswith(stop[:k])), default=0)
        cut = len(self.pending) - held
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _data_sha256(arrays: dict[str, mx.array]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(tensor_bytes(arrays[name]))
    return digest.hexdigest()


def _dtype_str(dtype: mx.Dtype) -> str:
    try:
        return dtype_name(dtype)
    except ValueError:
        return str(dtype)


def _int(req: dict, key: str, default: int, *, lo: int) -> int:
    v = req.get(key, default)
    if v is None:
        v = default
    if type(v) is not int or v < lo:
        raise BadRequest(f"{key} must be an integer >= {lo}")
    return v


def _float(req: dict, key: str, default: float, *, lo: float, hi: float | None = None) -> float:
    v = req.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < lo or (hi is not None and v > hi):
        raise BadRequest(f"{key} must be a number in [{lo}, {hi if hi is not None else 'inf'}]")
    return float(v)
