"""End-to-end tests of the pdbridge_mlx adapter: real models over the real socket, no mocks.

The protocol, the blocks and the batch run on the seeded generated Llama 3 checkpoint
(models/tiny-llama3-mlx, scripts/make-tiny-model.py: two layers, SmolLM2's tokenizer), which
answers ~100x faster than the real one on this CPU; what depends on the real checkpoint (its spec,
its 4-bit bundle, a tool call the model makes) runs on models/smollm2-mlx (scripts/prepare-model.py),
whose 4-bit CPU prefill is ~8 tokens/s. PDB_TEST_MODEL points the first part elsewhere. The
decoder's own cache as block files (the reference bridged blocks are held to) comes from the test
kit's `export_blocks`, run by the adapter's engine in this process.

Run (from the repository root):
    flock /tmp/pdb-heavy.lock .venv/bin/python -m unittest discover -s decoded/engine/tests -p test_adapter.py -v
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from pathlib import Path

from google.protobuf import json_format
from pdbridge_cache import blockfile
from pdbridge_cache.proto import engine_pb2
from pdbridge_testkit.decoder import export_blocks

ROOT = Path(__file__).resolve().parents[3]
ENGINE_DIR = ROOT / "decoded" / "engine"
MODEL = Path(os.environ.get("PDB_TEST_MODEL", ROOT / "models" / "tiny-llama3-mlx"))
REAL_MODEL = ROOT / "models" / "smollm2-mlx"
BLOCK = 16  # small blocks so a ~90-token prompt spans several
# A generation still running while a test asks something else of the adapter: seconds of the
# generated model's answer (it never says its end-of-text to MESSAGES), left early by the test.
LONG = 4096
START_TIMEOUT_S = 300
MESSAGES = [{
    "role": "user",
    "content": "Here are some notes about a small garden. The garden has tomatoes, basil, and three kinds "
    "of peppers. The tomatoes need water every morning, the basil likes partial shade, and the peppers "
    "grow best in full sun. Summarize the care instructions for each plant in one short sentence each.",
}]
MAX_TOKENS = 24


# Request fields a chat template renders: JSON text on the wire (engine.proto says why).
_AS_JSON_TEXT = {"messages": "messages_json", "tools": "tools_json"}
# A generate request's fields that travel in its `sampling` message.
_SAMPLING = {f.name for f in engine_pb2.Sampling.DESCRIPTOR.fields}


def wire(obj: dict) -> bytes:
    """A request written here as {"op": name, field: value, ...}, as the line engine.proto's
    `Request` is: {name: {field: value, ...}}, with JSON values as JSON text and a generate
    request's sampling fields in its `sampling`."""
    obj = dict(obj)
    op = obj.pop("op")
    fields = {_AS_JSON_TEXT.get(k, k): json.dumps(v) if k in _AS_JSON_TEXT else v
              for k, v in obj.items() if v is not None}
    if op == "generate":
        sampling = {k: fields.pop(k) for k in _SAMPLING & fields.keys()}
        if sampling:
            fields["sampling"] = sampling
    return json.dumps({op: fields}).encode() + b"\n"


def flat(line: bytes) -> dict:
    """A reply line, held to engine.proto's `Reply` (parsing fails on anything else), as one dict
    with every field of its message (defaults too): a `done` line with "done": True, an `error`
    line as {"error": message, "kind": ..., "block": ...}."""
    reply = json_format.Parse(line, engine_pb2.Reply())
    which = reply.WhichOneof("reply")
    body = json_format.MessageToDict(getattr(reply, which), preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    if which == "done":
        body["done"] = True
    if which == "error":
        body["error"] = body.pop("message")
    return body


def request(path: str, obj: dict | bytes, timeout: float = 600) -> list[dict]:
    """One request; every reply line, parsed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(obj if isinstance(obj, bytes) else wire(obj))
        with s.makefile("rb") as f:
            return [flat(line) for line in f]


class Running:
    """A generate request streaming in the background: `first` is set at its first reply line,
    `done` once its last has come; `leave()` hangs up (the adapter cancels the generation)."""

    def __init__(self, path: str, req: dict):
        self.lines: list[dict] = []
        self.first, self.done = threading.Event(), threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._sock.sendall(wire({"op": "generate", **req}))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            with self._sock.makefile("rb") as f:
                for line in f:
                    self.lines.append(flat(line))
                    self.first.set()
        except OSError:
            pass  # left by the test
        finally:
            self._sock.close()
            self.done.set()

    def started(self) -> "Running":
        assert self.first.wait(timeout=600), "the generation never started"
        return self

    def finished(self) -> list[dict]:
        assert self.done.wait(timeout=600), "the generation never ended"
        return self.lines

    def leave(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the adapter hung up first
        self._reader.join(timeout=60)


class Adapter:
    """The adapter as decoded runs it: a subprocess that prints a ready line."""

    def __init__(self, workdir: str, *, bundle_dir: str | None = None, socket_name: str = "engine.sock",
                 model: Path = MODEL, extra: tuple[str, ...] = ()):
        self.socket = os.path.join(workdir, socket_name)
        self.stderr_path = tempfile.mkstemp(prefix="adapter-", suffix=".log", dir=workdir)[1]
        cmd = [sys.executable, "-m", "pdbridge_mlx", "--model", str(model), "--socket", self.socket,
               "--block-tokens", str(BLOCK)]
        if bundle_dir:
            cmd += ["--bundle-dir", bundle_dir]
        cmd += extra
        env = dict(os.environ, PYTHONPATH=str(ENGINE_DIR))
        self._stderr = open(self.stderr_path, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr, env=env)
        self.ready = self._read_ready_line()
        self.startup_s = time.perf_counter() - t0

    def _read_ready_line(self) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if readable:
                line = self.proc.stdout.readline()
                if not line:
                    break
                ready = json_format.Parse(line, engine_pb2.Ready())
                return json_format.MessageToDict(ready, always_print_fields_with_no_presence=True)
        self.proc.kill()
        raise AssertionError(f"adapter gave no ready line; stderr:\n{self.log()}")

    def log(self) -> str:
        return Path(self.stderr_path).read_text(errors="replace")

    def request(self, obj, **kw) -> list[dict]:
        return request(self.socket, obj, **kw)

    def stop(self, *, signal_it: bool = True) -> int:
        if signal_it and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.proc.stdout.close()
            self._stderr.close()


def load_tokenizer():
    from mlx_lm.utils import load_tokenizer as load

    return load(MODEL)


class AdapterTest(unittest.TestCase):
    """One adapter (block size 16) shared by the tests; the native generation
    and the exported blocks are computed once."""

    @classmethod
    def setUpClass(cls):
        if not (MODEL / "config.json").is_file():
            raise unittest.SkipTest(f"{MODEL} is missing (run scripts/make-tiny-model.py --family llama3)")
        cls.tmp = tempfile.TemporaryDirectory(prefix="pdb-adapter-")
        cls.adapter = Adapter(cls.tmp.name)
        assert cls.adapter.ready == {"ready": True, "socket": cls.adapter.socket, "error": ""}, cls.adapter.ready
        cls.info = cls.adapter.request({"op": "info"})[0]
        cls.tokens = cls.adapter.request({"op": "tokenize", "messages": MESSAGES})[0]["tokens"]
        cls.native = cls.generate(cls.tokens)
        # The decoder's own cache as block files, computed in this process by the adapter's engine.
        import mlx.core as mx
        from pdbridge_mlx.engine import Engine

        cls.engine = Engine(str(MODEL), block_tokens=BLOCK, dtype=mx.float32,
                            bundle_dir=os.path.join(cls.tmp.name, "bundle"))
        cls.files = export_blocks(cls.engine, cls.tokens, os.path.join(cls.tmp.name, "blocks"))

    @classmethod
    def tearDownClass(cls):
        code = cls.adapter.stop()
        log = cls.adapter.log()
        sys.stderr.write(f"\n--- adapter startup {cls.adapter.startup_s:.2f} s; log:\n{log}")
        cls.tmp.cleanup()
        assert code == 0, f"adapter exited with {code}"

    @classmethod
    def generate(cls, tokens, blocks=(), **extra) -> tuple[list[dict], dict]:
        lines = cls.adapter.request({"op": "generate", "tokens": tokens, "blocks": list(blocks),
                                     "max_tokens": MAX_TOKENS, "temperature": 0.0, "top_p": 1.0, **extra})
        if "error" in lines[-1]:
            raise AssertionError(f"generate failed: {lines[-1]}")
        return lines[:-1], lines[-1]

    def assert_bad_request(self, lines: list[dict], needle: str):
        self.assertEqual(len(lines), 1, lines)
        self.assertEqual(lines[0].get("kind"), "ERROR_KIND_BAD_REQUEST", lines)
        self.assertIn(needle, lines[0]["error"])

    # ---------------------------------------------------------------- info

    def test_tokenizer_fingerprint(self):
        h = hashlib.sha256((MODEL / "tokenizer.json").read_bytes() + (MODEL / "tokenizer_config.json").read_bytes())
        self.assertEqual(self.info["tokenizer_sha256"], h.hexdigest())

    # ------------------------------------------------------------ tokenize

    def test_tokenize_matches_mlx_lm(self):
        tok = load_tokenizer()
        self.assertEqual(self.tokens, tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True))
        self.assertGreater(len(self.tokens), 5 * BLOCK)
        reply = self.adapter.request({"op": "tokenize", "prompt": "Once upon a time"})
        self.assertEqual(reply, [{"tokens": tok.encode("Once upon a time")}])

    # ------------------------------------------------------------ generate

    def test_native_generation(self):
        lines, done = self.native
        self.assertEqual(done["cached_tokens"], 0)
        self.assertEqual(done["prompt_tokens"], len(self.tokens))
        self.assertEqual(done["completion_tokens"], len(lines))
        self.assertGreater(len(lines), 0)
        self.assertIn(done["finish_reason"], ("stop", "length"))
        for key in ("restore", "prefill", "first_token", "total"):
            self.assertIsInstance(done["timings_ms"][key], float)
        # The streamed deltas spell out exactly the generated ids, as mlx-lm's own streaming
        # detokenizer does (which drops the answer's leading space).
        text = "".join(line["text"] for line in lines) + done.get("text", "")
        detokenizer = load_tokenizer().detokenizer
        detokenizer.reset()
        for line in lines:
            detokenizer.add_token(line["id"])
        detokenizer.finalize()
        self.assertEqual(text, detokenizer.text)

    def test_stop_sequences_end_the_answer_before_them(self):
        lines, done = self.native
        full = "".join(line["text"] for line in lines) + done.get("text", "")
        self.assertGreater(len(full), 10, full)
        stop = full[5:8]  # from the middle of a greedy answer: it will come again
        expected = full[: full.find(stop)]
        lines, done = self.generate(self.tokens, stop=["never in this answer", stop])
        text = "".join(line["text"] for line in lines) + done.get("text", "")
        self.assertEqual((text, done["finish_reason"]), (expected, "stop"))
        # A stop sequence that never comes changes nothing.
        lines, unchanged = self.generate(self.tokens, stop=["never in this answer"])
        text = "".join(line["text"] for line in lines) + unchanged.get("text", "")
        self.assertEqual((text, unchanged["finish_reason"]), (full, self.native[1]["finish_reason"]))
        self.assert_bad_request(self.adapter.request({"op": "generate", "tokens": self.tokens, "stop": [""]}), "stop")

    def test_generation_from_exported_blocks_is_identical(self):
        n = len(self.tokens) // BLOCK
        self.assertEqual(len(self.files), n)
        lines, done = self.generate(self.tokens, self.files)
        self.assertEqual(done["cached_tokens"], n * BLOCK)
        self.assertEqual([l["id"] for l in lines], [l["id"] for l in self.native[0]])
        self.assertEqual([l["text"] for l in lines], [l["text"] for l in self.native[0]])
        self.assertEqual(done["finish_reason"], self.native[1]["finish_reason"])
        sys.stderr.write(f"\nnative {self.native[1]['timings_ms']}\nbridged {done['timings_ms']}\n")

    def test_blocks_covering_the_whole_prompt_leave_the_last_token(self):
        prompt = self.tokens[: 5 * BLOCK]  # a prompt that is exactly whole blocks
        native_lines, native_done = self.generate(prompt)
        lines, done = self.generate(prompt, self.files[:5])
        self.assertEqual(done["cached_tokens"], len(prompt) - 1)
        self.assertEqual([l["id"] for l in lines], [l["id"] for l in native_lines])
        self.assertEqual(done["finish_reason"], native_done["finish_reason"])

    def test_seeded_sampling_is_reproducible(self):
        runs = [self.generate(self.tokens, self.files, temperature=0.9, top_p=0.9, seed=7)[0] for _ in range(2)]
        self.assertEqual([l["id"] for l in runs[0]], [l["id"] for l in runs[1]])

    def test_a_client_that_leaves_cancels_its_generation(self):
        cancelled = "op=generate cancelled: client went away"
        before = self.adapter.log().count(cancelled)
        running = Running(self.adapter.socket, {"tokens": self.tokens, "blocks": self.files,
                                                "max_tokens": LONG}).started()
        running.leave()
        deadline = time.monotonic() + 60
        while self.adapter.log().count(cancelled) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(self.adapter.log().count(cancelled), before + 1, self.adapter.log())
        self.assertLess(len(running.lines), LONG, "the generation ran to its end")
        _, done = self.generate(self.tokens, self.files, max_tokens=1)
        self.assertEqual(done["completion_tokens"], 1)

    def test_a_client_gone_before_its_answer_is_told_not_failed(self):
        """decoded's liveness probe gives up on a stopped adapter (SIGSTOP); resumed, the adapter
        finds no reader for that probe's answer: a line saying so, not a failure."""
        self.adapter.proc.send_signal(signal.SIGSTOP)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(self.adapter.socket)  # queued until the adapter accepts again
                s.sendall(wire({"op": "info"}))
        finally:
            self.adapter.proc.send_signal(signal.SIGCONT)
        self.assertEqual(self.adapter.request({"op": "info"}), [self.info])
        deadline = time.monotonic() + 30
        while "op=info: the client left" not in self.adapter.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertIn("op=info: the client left", self.adapter.log())
        self.assertNotIn("op=info failed", self.adapter.log())

    # -------------------------------------------------------------- export

    def test_exported_blocks_match_the_spec(self):
        import mlx.core as mx

        files = self.files
        self.assertEqual([os.path.basename(f) for f in files],
                         [f"block-{i:06}.safetensors" for i in range(len(files))])
        for i, path in enumerate(files):
            arrays, meta = mx.load(path, return_metadata=True)
            block = blockfile.read(meta)
            self.assertEqual((block.index, block.spec_fingerprint, block.key), (i, "", ""))
            self.assertEqual(list(block.token_ids), self.tokens[i * BLOCK:(i + 1) * BLOCK])
            self.assertEqual(block.data_sha256, blockfile.data_sha256(arrays))
            names = set()
            for layer in self.info["spec"]["layers"]:
                for t in layer["tensors"]:
                    name = f"{layer['index']}.{t['name']}"
                    names.add(name)
                    shape = [int(d) for d in t["shape"]]
                    shape[t["token_axis"]] = BLOCK
                    self.assertEqual(list(arrays[name].shape), shape, name)
                    self.assertEqual(arrays[name].dtype, mx.float32, name)
            self.assertEqual(set(arrays), names)

    def test_export_with_fingerprint_and_keys(self):
        spec_fp, keys = "ab" * 32, ["%064x" % (i + 1) for i in range(2)]
        out = os.path.join(self.tmp.name, "keyed")
        files = export_blocks(self.engine, self.tokens[: 2 * BLOCK + 3], out, spec_fingerprint=spec_fp, keys=keys)
        self.assertEqual(len(files), 2, files)
        import mlx.core as mx

        for i, path in enumerate(files):
            block = blockfile.read(mx.load(path, return_metadata=True)[1])
            self.assertEqual((block.spec_fingerprint, block.key, block.parent),
                             (spec_fp, keys[i], keys[i - 1] if i else "00" * 32))
        # A request naming the same spec accepts them; another spec is refused.
        _, done = self.generate(self.tokens, files, spec_fingerprint=spec_fp, max_tokens=1)
        self.assertEqual(done["cached_tokens"], 2 * BLOCK)
        lines = self.adapter.request({"op": "generate", "tokens": self.tokens, "blocks": files,
                                      "spec_fingerprint": "cd" * 32, "max_tokens": 1})
        self.assert_bad_request(lines, "spec_fingerprint")

    # ------------------------------------------------- refusals (no model work)

    def _tampered(self, name: str, change) -> str:
        """A copy of block 0 with `change(arrays)` applied and no checksum, so
        the checks after the checksum are what refuses it."""
        import mlx.core as mx

        arrays, meta = mx.load(self.files[0], return_metadata=True)
        block = blockfile.read(meta)
        block.ClearField("data_sha256")
        meta = blockfile.metadata(block)
        change(arrays)
        path = os.path.join(self.tmp.name, f"{name}.safetensors")
        mx.save_safetensors(path, arrays, metadata=meta)
        return path

    def _generate_with_block0(self, path: str) -> list[dict]:
        return self.adapter.request({"op": "generate", "tokens": self.tokens,
                                     "blocks": [path, *self.files[1:]], "max_tokens": 4})

    def test_refuses_a_block_with_a_wrong_shape(self):
        path = self._tampered("short", lambda a: a.update({"1.keys": a["1.keys"][:, :, : BLOCK // 2, :]}))
        self.assert_bad_request(self._generate_with_block0(path), "1.keys")

    def test_refuses_a_block_with_a_missing_tensor(self):
        path = self._tampered("missing", lambda a: a.pop("1.values"))
        self.assert_bad_request(self._generate_with_block0(path), "missing tensors 1.values")

    def test_refuses_a_block_with_a_wrong_dtype(self):
        import mlx.core as mx

        path = self._tampered("f16", lambda a: a.update({"0.values": a["0.values"].astype(mx.float16)}))
        self.assert_bad_request(self._generate_with_block0(path), "0.values is F16")

    def test_refuses_blocks_out_of_order_or_for_other_tokens(self):
        files = self.files
        lines = self.adapter.request({"op": "generate", "tokens": self.tokens, "blocks": [files[1], files[0]]})
        self.assert_bad_request(lines, "metadata index=1, expected 0")
        other = [t for t in self.tokens]
        other[3] = (other[3] + 1) % 49152
        lines = self.adapter.request({"op": "generate", "tokens": other, "blocks": files[:1]})
        self.assert_bad_request(lines, "other tokens")
        lines = self.adapter.request({"op": "generate", "tokens": self.tokens[:BLOCK], "blocks": files[:2]})
        self.assert_bad_request(lines, "cover more than")

    def assert_block_unusable(self, lines: list[dict], block: int, needle: str):
        self.assertEqual(len(lines), 1, lines)
        self.assertEqual((lines[0].get("kind"), lines[0].get("block")), ("ERROR_KIND_BLOCK_UNUSABLE", block), lines)
        self.assertIn(needle, lines[0]["error"])

    def test_a_missing_or_rotten_block_is_named_as_unusable(self):
        files = self.files
        lines = self.adapter.request({"op": "generate", "tokens": self.tokens, "blocks": [files[0], "/nonexistent/b"]})
        self.assert_block_unusable(lines, 1, "no such file")
        # One flipped bit in the last tensor byte: the file still parses.
        rotten = os.path.join(self.tmp.name, "rotten.safetensors")
        data = bytearray(Path(files[1]).read_bytes())
        data[-1] ^= 0x01
        Path(rotten).write_bytes(bytes(data))
        lines = self.adapter.request({"op": "generate", "tokens": self.tokens, "blocks": [files[0], rotten]})
        self.assert_block_unusable(lines, 1, "checksum")
        truncated = os.path.join(self.tmp.name, "truncated.safetensors")
        Path(truncated).write_bytes(bytes(data[: len(data) // 2]))
        lines = self.adapter.request({"op": "generate", "tokens": self.tokens, "blocks": [truncated]})
        self.assert_block_unusable(lines, 0, "not a readable safetensors file")

    def test_reconstruct_from_the_decoders_layer_inputs_is_its_exported_cache(self):
        """Given its own layer inputs for block 1 (RoPE offset 16), the reconstruct op writes the
        decoder's own cache for that block (the test kit's export), bit for bit; malformed inputs
        are refused."""
        import mlx.core as mx
        import numpy as np
        from pdbridge_testkit.decoder import decoder_native_cache  # captured from mlx-lm's prefill

        _, hidden = decoder_native_cache(self.tokens, MODEL)
        rows = hidden[BLOCK:2 * BLOCK]
        layers = [layer["index"] for layer in self.info["spec"]["layers"]]
        inputs, out = (os.path.join(self.tmp.name, name) for name in ("inputs.safetensors", "cache.safetensors"))
        mx.save_safetensors(inputs, {f"{i}.input": mx.array(rows[:, i, :]) for i in layers})
        reply = self.adapter.request({"op": "reconstruct", "inputs": inputs, "offset": BLOCK, "out": out})
        self.assertEqual(reply[-1].get("rows"), BLOCK, reply)
        got, want = mx.load(out), mx.load(self.files[1])
        self.assertEqual(set(got), set(want))
        for name, a in want.items():
            self.assertTrue(np.array_equal(np.array(got[name]).view(np.uint32), np.array(a).view(np.uint32)), name)

        mx.save_safetensors(inputs, {f"{i}.input": mx.array(rows[:, i, :]) for i in layers[1:]})
        self.assert_bad_request(self.adapter.request({"op": "reconstruct", "inputs": inputs, "offset": 0, "out": out}),
                                "one 'input' per bridged layer")
        mx.save_safetensors(inputs, {f"{i}.input": mx.array(rows[:, i, :]).astype(mx.float16) for i in layers})
        self.assert_bad_request(self.adapter.request({"op": "reconstruct", "inputs": inputs, "offset": 0, "out": out}),
                                "expected F32")
        self.assert_bad_request(self.adapter.request({"op": "reconstruct", "inputs": inputs, "offset": 0}), "out")

    def test_bad_requests(self):
        self.assert_bad_request(self.adapter.request(b"{not json\n"), "not a pdbridge.engine.v1.Request")
        self.assert_bad_request(self.adapter.request({"op": "fly"}), "not a pdbridge.engine.v1.Request")
        self.assert_bad_request(self.adapter.request(b"{}\n"), "names no op")
        self.assert_bad_request(self.adapter.request({"op": "generate", "tokens": "1, 2"}), "tokens")
        self.assert_bad_request(self.adapter.request({"op": "generate", "tokens": []}), "tokens")
        self.assert_bad_request(self.adapter.request({"op": "generate", "tokens": [1, 10**6]}), "token id")
        self.assert_bad_request(self.adapter.request({"op": "generate", "tokens": [1], "max_tokens": 0}),
                                "max_tokens")
        self.assert_bad_request(self.adapter.request({"op": "tokenize"}), "messages")

    # ----------------------------------------------------------- concurrency

    def test_info_and_tokenize_answer_while_generating(self):
        running = Running(self.adapter.socket, {"tokens": self.tokens, "max_tokens": LONG}).started()
        try:
            info = self.adapter.request({"op": "info"})
            tokens = self.adapter.request({"op": "tokenize", "messages": MESSAGES})
            self.assertFalse(running.done.is_set(), "info/tokenize waited for the generation")
        finally:
            running.leave()
        self.assertEqual(info, [self.info])
        self.assertEqual(tokens, [{"tokens": self.tokens}])

    def test_reconstruct_runs_between_the_steps_of_a_running_generation(self):
        """A bridged block's reconstruction does not wait out the answers being generated: it runs
        between two of the batch's steps."""
        import mlx.core as mx

        hidden = mx.random.normal((BLOCK, self.info["spec"]["hidden_size"]), key=mx.random.key(0))
        inputs, out = (os.path.join(self.tmp.name, name) for name in ("busy-in.safetensors", "busy-out.safetensors"))
        mx.save_safetensors(inputs, {f"{layer['index']}.input": hidden for layer in self.info["spec"]["layers"]})
        running = Running(self.adapter.socket, {"tokens": self.tokens, "max_tokens": LONG}).started()
        try:
            reply = self.adapter.request({"op": "reconstruct", "inputs": inputs, "offset": 0, "out": out})
            self.assertFalse(running.done.is_set(), "reconstruct waited for the generation to finish")
        finally:
            running.leave()
        self.assertEqual(reply[-1].get("rows"), BLOCK, reply)

    def test_generations_share_the_model_as_one_batch_and_answer_as_alone(self):
        """A bridged request arriving while a native one is mid-answer joins it: its whole
        answer comes back before the long one ends, and every answer is the one it gets alone. The
        long one (~8 s alone on a CPU core) outlasts the two short ones (<1 s) several times over."""
        long = 512
        running = Running(self.adapter.socket, {"tokens": self.tokens, "max_tokens": long}).started()
        short = [self.generate(self.tokens, self.files, max_tokens=4) for _ in range(2)]
        self.assertFalse(running.done.is_set(), "the short answers waited for the long one")
        long_lines = running.finished()
        long_alone = self.generate(self.tokens, max_tokens=long)
        self.assertEqual(len(long_alone[0]), long)
        self.assertEqual([l["id"] for l in long_lines[:-1]], [l["id"] for l in long_alone[0]])
        for lines, done in short:
            self.assertEqual([l["id"] for l in lines], [l["id"] for l in self.native[0][:4]])
            self.assertEqual(done["cached_tokens"], (len(self.tokens) // BLOCK) * BLOCK)

    def test_answers_of_a_full_batch_equal_those_given_alone(self):
        """More concurrent requests (10) than the batch holds (--max-batch, default 8): the rest
        wait their turn, and the answers equal those given one at a time."""
        prompts = [self.tokens[: 40 + 3 * i] for i in range(10)]
        alone = [self.generate(p, max_tokens=6)[0] for p in prompts[:3]]
        results: dict[int, list[dict]] = {}

        def run(i):
            results[i] = self.adapter.request({"op": "generate", "tokens": prompts[i], "max_tokens": 6})

        workers = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=600)
        self.assertEqual(sorted(results), list(range(len(prompts))))
        for i, lines in results.items():
            self.assertTrue(lines[-1].get("done"), lines[-1])
            self.assertEqual(lines[-1]["completion_tokens"], len(lines) - 1)
        for i in range(3):
            self.assertEqual([l["id"] for l in results[i][:-1]], [l["id"] for l in alone[i]])


class RealCheckpointTest(unittest.TestCase):
    """The real checkpoint (SmolLM2, 4-bit) with a chat template that renders tools
    (deploy/templates): the spec and the bundle of a quantized model; mlx-lm picks its JSON tool
    parser from the template, and a tool call the model makes comes back parsed, not as text."""

    TEMPLATE = ROOT / "deploy" / "templates" / "smollm2-tools.jinja"
    TOOLS = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

    @classmethod
    def setUpClass(cls):
        if not (REAL_MODEL / "config.json").is_file():
            raise unittest.SkipTest(f"{REAL_MODEL} is missing (run scripts/prepare-model.py)")
        cls.tmp = tempfile.TemporaryDirectory(prefix="pdb-real-")
        cls.adapter = Adapter(cls.tmp.name, model=REAL_MODEL, extra=("--chat-template", str(cls.TEMPLATE)))
        assert cls.adapter.ready["ready"], cls.adapter.log()
        cls.info = cls.adapter.request({"op": "info"})[0]

    @classmethod
    def tearDownClass(cls):
        code = cls.adapter.stop()
        cls.tmp.cleanup()
        assert code == 0, f"adapter exited with {code}"

    def test_info_spec(self):
        spec = self.info["spec"]
        self.assertEqual(spec["architecture"], "LlamaForCausalLM")
        self.assertEqual(spec["input_dtype"], "DTYPE_F32")
        self.assertEqual(
            {k: spec[k] for k in ("num_layers", "hidden_size", "vocab_size", "max_context", "block_tokens")},
            {"num_layers": 30, "hidden_size": 576, "vocab_size": 49152, "max_context": 8192, "block_tokens": BLOCK},
        )
        self.assertEqual(len(spec["layers"]), 30)
        for i, layer in enumerate(spec["layers"]):
            self.assertEqual(layer, {
                "index": i, "cache_class": "KVCache",
                # uint64 in proto3 JSON: strings
                "tensors": [{"name": n, "dtype": "DTYPE_F32", "shape": ["1", "3", "1", "64"], "token_axis": 2,
                             "extent": "EXTENT_PER_TOKEN"} for n in ("keys", "values")],
                "rope": {"kind": "default", "module": "RoPE", "base": 100000.0, "traditional": False, "dims": 64,
                         "scaling": {}},
                "window": 0, "keep": 0, "kv_bits": 0, "kv_group_size": 0, "kind": "CACHE_KIND_ROWS",
                "unsupported_reason": "", "rewindable": True, "takes_tail": True, "from_inputs": True,
            })
        # What decoded fills in is left to it.
        self.assertEqual(self.info["model_id"], REAL_MODEL.name)
        self.assertEqual([spec[k] for k in ("model_id", "weights_fingerprint", "tokenizer_fingerprint",
                                            "spec_fingerprint")], [""] * 4)
        import mlx.core as mx
        import mlx_lm

        self.assertEqual(spec["decoder_code"], {"model_type": "llama", "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                                                "device": mx.default_device().type.name})

    def test_bundle_holds_what_the_decoders_cache_depends_on(self):
        import mlx.core as mx

        path = self.info["bundle_path"]
        self.assertEqual(hashlib.sha256(Path(path).read_bytes()).hexdigest(), self.info["bundle_sha256"])
        arrays, meta = mx.load(path, return_metadata=True)
        expected = {f"model.layers.{i}.{part}" for i in range(30) for part in (
            "input_layernorm.weight",
            *(f"self_attn.{p}_proj.{t}" for p in "kv" for t in ("weight", "scales", "biases")))}
        self.assertEqual(set(arrays), expected)
        self.assertEqual(arrays["model.layers.0.self_attn.k_proj.weight"].dtype, mx.uint32)
        self.assertEqual(arrays["model.layers.0.self_attn.k_proj.scales"].dtype, mx.float32)
        for key, want in {"format": "pdbridge-bundle-v2", "dtype": "F32", "kv_bits": "0",
                          "layers": ",".join(map(str, range(30)))}.items():
            self.assertEqual(meta.get(key), want, key)
        # The decoder's own config, as mlx-lm loaded it (the prefill side builds the model from it).
        config = json.loads(meta["config"])
        self.assertEqual((config["model_type"], config["quantization"]["bits"]), ("llama", 4))
        # The fp32 model folder holds exactly these arrays: the bundle is the decoder's form.
        weights = mx.load(str(REAL_MODEL / "model.safetensors"))
        for name in expected:
            self.assertTrue(mx.array_equal(arrays[name], weights[name]).item(), name)
            self.assertEqual(arrays[name].dtype, weights[name].dtype, name)

    def conversation(self, city: str) -> list[int]:
        """Two earlier questions answered with calls, then a new one: the model follows suit."""
        def ask(c):
            return {"role": "user", "content": f"What is the weather in {c}?"}

        def call(i, c):
            return {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}]}

        messages = [ask("Berlin"), call(0, "Berlin"), ask("Rome"), call(1, "Rome"), ask(city)]
        return self.adapter.request({"op": "tokenize", "messages": messages, "tools": self.TOOLS})[0]["tokens"]

    def test_a_tool_call_is_parsed_out_of_the_answer(self):
        # One city here; the e2e SDK test asks for calls through the front door, streamed too.
        city = "Paris"
        tokens = self.conversation(city)
        lines = self.adapter.request({"op": "generate", "tokens": tokens, "max_tokens": 40, "tools": self.TOOLS})
        done = lines[-1]
        calls = [c for line in lines for c in line.get("tool_calls", [])]
        text = "".join(line.get("text", "") for line in lines)
        self.assertEqual(done["finish_reason"], "tool_calls", lines)
        self.assertEqual([(c["name"], json.loads(c["arguments"])) for c in calls], [("get_weather", {"city": city})])
        self.assertTrue(calls[0]["id"].startswith("call_"))
        self.assertNotIn("tool_call", text)
        # Without tools in the request, the same answer is plain text, markers and all.
        lines = self.adapter.request({"op": "generate", "tokens": tokens, "max_tokens": 40})
        text = "".join(line.get("text", "") for line in lines)
        self.assertIn("<tool_call>", text)
        self.assertIn(f'"city": "{city}"', text)
        self.assertEqual(lines[-1]["finish_reason"], "stop")


class LifecycleTest(unittest.TestCase):
    """Startup and shutdown: stable bundle across restarts, stale and live
    sockets, SIGTERM."""

    def test_restart_gives_the_same_bundle_and_sigterm_removes_the_socket(self):
        if not (MODEL / "config.json").is_file():
            self.skipTest(f"{MODEL} is missing")
        with tempfile.TemporaryDirectory(prefix="pdb-life-") as tmp:
            shas = []
            for run in range(2):
                bundle_dir = os.path.join(tmp, f"bundles{run}")  # a fresh write each time
                sock = os.path.join(tmp, "engine.sock")
                if run == 1:  # leave a stale socket file behind: the adapter replaces it
                    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    stale.bind(sock)
                    stale.close()
                adapter = Adapter(tmp, bundle_dir=bundle_dir)
                try:
                    self.assertTrue(adapter.ready["ready"], adapter.log())
                    info = adapter.request({"op": "info"})[0]
                    shas.append((info["bundle_sha256"], Path(info["bundle_path"]).read_bytes()))
                    if run == 1:
                        # A second adapter on a live socket refuses to start.
                        other = Adapter(tmp, bundle_dir=bundle_dir)
                        self.assertEqual(other.ready["ready"], False)
                        self.assertIn("another process", other.ready["error"])
                        self.assertEqual(other.stop(signal_it=False), 1)  # exits on its own
                    if run == 0:
                        # SIGTERM in the middle of a generation still exits cleanly, the
                        # generation unfinished.
                        running = Running(adapter.socket, {"tokens": list(range(100, 190)),
                                                           "max_tokens": LONG}).started()
                        self.assertEqual(adapter.stop(), 0, adapter.log())
                        self.assertLess(len(running.finished()), LONG, "the generation ran to its end")
                finally:
                    code = adapter.stop()
                self.assertEqual(code, 0, adapter.log())
                self.assertFalse(os.path.exists(sock), "socket left behind after SIGTERM")
                self.assertIn("SIGTERM: shutting down", adapter.log())
            self.assertEqual(shas[0], shas[1])

    def test_a_sliding_window_model_is_described_and_kv_bits_it_cannot_take_are_refused(self):
        """A tiny random-weight llama with a sliding-window layer: the spec describes its
        RotatingKVCache (window, rows per token); asked to quantize that cache, which mlx-lm
        cannot do, the adapter must not start."""
        if not (MODEL / "config.json").is_file():
            self.skipTest(f"{MODEL} is missing")
        import shutil

        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm.models import llama

        with tempfile.TemporaryDirectory(prefix="pdb-sliding-") as tmp:
            model_dir = Path(tmp) / "model"
            model_dir.mkdir()
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copy(MODEL / name, model_dir / name)
            config = {
                "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 49152,
                "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 256,
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 32,
            }
            (model_dir / "config.json").write_text(json.dumps(config))
            model = llama.Model(llama.ModelArgs.from_dict(config))
            mx.save_safetensors(str(model_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))

            adapter = Adapter(tmp, model=model_dir)
            try:
                layers = adapter.request({"op": "info"})[0]["spec"]["layers"]
            finally:
                self.assertEqual(adapter.stop(), 0, adapter.log())
            self.assertEqual([(l["cache_class"], l["window"], l["kind"]) for l in layers],
                             [("RotatingKVCache", 32, "CACHE_KIND_ROWS"), ("KVCache", 0, "CACHE_KIND_ROWS")])
            self.assertEqual(layers[0]["tensors"][0]["shape"], ["1", "2", "1", "16"])

            adapter = Adapter(tmp, model=model_dir, extra=("--kv-bits", "4"), socket_name="kv4.sock")
            self.assertEqual(adapter.stop(signal_it=False), 1)
            self.assertFalse(adapter.ready["ready"])
            self.assertIn("cannot quantize a RotatingKVCache", adapter.ready["error"])
            self.assertFalse(os.path.exists(adapter.socket))


if __name__ == "__main__":
    unittest.main()
