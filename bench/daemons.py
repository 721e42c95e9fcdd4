"""Starting decoded and prefilld for a benchmark, and watching their processes.

`Daemons` runs both release binaries on free loopback ports with a fresh store under a run
folder, on a model pair `models/<model>-mlx` (decoder) + `models/<model>-hf` (prefill), and stops
them (with everything their engines started) on exit. `Sampler` records the peak resident set of
each process role while a block of code runs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK_TOKENS = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children of every thread, recursively)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = [int(k) for k in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


class Sampler:
    """Peak RSS per role while running: decoded, adapter, prefilld, vllm (tree)."""

    def __init__(self, decoded: int, prefilld: int):
        self.decoded, self.prefilld = decoded, prefilld
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict[str, float]:
        vllm = descendants(self.prefilld)
        return {
            "decoded": rss_mb(self.decoded),
            "mlx_adapter": sum(rss_mb(p) for p in descendants(self.decoded)),
            "prefilld": rss_mb(self.prefilld),
            "vllm": sum(rss_mb(p) for p in vllm),
        }

    def _run(self):
        while not self._stop.is_set():
            for role, mb in self.sample().items():
                self.peak[role] = max(self.peak.get(role, 0.0), mb)
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def configs(run: Path, ports: dict, model: str, max_len: int, decoder: str = "", prefill_dtype: str = "float32",
            decoder_model: str | None = None) -> tuple[Path, Path]:
    """`decoder`: extra `[engine]` keys for decoded (dtype, kv_bits, …, then possibly `[engine.env]`);
    `decoder_model`: the decoder's model folder under models/ (default `<model>-mlx`)."""
    decoded = f"""
[server]
grpc_listen = "127.0.0.1:{ports['decoded_grpc']}"
admin_listen = "127.0.0.1:{ports['decoded_admin']}"
[log]
format = "json"
[store]
dir = "{run}/store"
block_tokens = {BLOCK_TOKENS}
budget_bytes = 17179869184
push_idle_timeout = "3600s"
[engine]
python = "{ROOT}/.venv/bin/python"
adapter_dir = "{ROOT}/decoded/engine"
model = "{ROOT}/models/{decoder_model or model + '-mlx'}"
socket = "{run}/engine.sock"
start_timeout = "600s"
{decoder}
[front]
listen = "127.0.0.1:{ports['front']}"
model_name = "{model}"
prefilld = "http://127.0.0.1:{ports['prefilld_grpc']}"
min_bridge_tokens = {BLOCK_TOKENS}
prefill_deadline_base = "600s"
prefill_deadline_per_1k_tokens = "60s"
request_timeout = "7200s"
"""
    prefilld = f"""
[server]
grpc_listen = "127.0.0.1:{ports['prefilld_grpc']}"
admin_listen = "127.0.0.1:{ports['prefilld_admin']}"
[log]
format = "json"
[engine]
python = "{ROOT}/.venv/bin/python"
plugin_dir = "{ROOT}/prefilld/engine"
model = "{ROOT}/models/{model}-hf"
dtype = "{prefill_dtype}"
max_model_len = {max_len}
plugin_socket = "{run}/plugin.sock"
bundle_dir = "{run}/bundles"
start_timeout = "900s"
[engine.env]
VLLM_CPU_KVCACHE_SPACE = "4"
VLLM_CPU_NUM_OF_RESERVED_CPU = "1"
[[decoders]]
addr = "http://127.0.0.1:{ports['decoded_grpc']}"
[stream]
deadline_per_1k_tokens = "60s"
"""
    (run / "decoded.toml").write_text(decoded)
    (run / "prefilld.toml").write_text(prefilld)
    return run / "decoded.toml", run / "prefilld.toml"


def wait_ready(admin_port: int, proc: subprocess.Popen, name: str, limit_s: float = 1200) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"{name} not ready after {limit_s} s")


def open_files(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


class Daemons:
    """decoded + prefilld on `model`, ready on entry, stopped on exit."""

    def __init__(self, model: str, run_dir: str, max_len: int, decoder: str = "", prefill_dtype: str = "float32",
                 decoder_model: str | None = None):
        self.run = (ROOT / run_dir).resolve()
        subprocess.run(["rm", "-rf", str(self.run)], check=True)
        self.run.mkdir(parents=True)
        self.ports = {
            k: free_port() for k in ("decoded_grpc", "decoded_admin", "front", "prefilld_grpc", "prefilld_admin")
        }
        self.tomls = configs(self.run, self.ports, model, max_len, decoder, prefill_dtype, decoder_model)
        self.procs: dict[str, subprocess.Popen] = {}
        self.front = f"http://127.0.0.1:{self.ports['front']}"
        self.decoded_log = self.run / "decoded.log"

    def __enter__(self) -> "Daemons":
        try:
            for name, toml in zip(("decoded", "prefilld"), self.tomls):
                log = open(self.run / f"{name}.log", "wb")
                self.procs[name] = subprocess.Popen(
                    [str(ROOT / "target" / "release" / name), "--config", str(toml)],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )
            wait_ready(self.ports["decoded_admin"], self.procs["decoded"], "decoded")
            wait_ready(self.ports["prefilld_admin"], self.procs["prefilld"], "prefilld")
        except BaseException:
            self.__exit__()
            raise
        return self

    def sampler(self) -> Sampler:
        return Sampler(self.procs["decoded"].pid, self.procs["prefilld"].pid)

    def __exit__(self, *exc):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
            # Anything an engine left in the daemon's session is ended too.
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
