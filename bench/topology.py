#!/usr/bin/env python3
"""Real topologies (issue 15): vLLM spread over processes, several prefillers, several decoders.

Every row runs the release daemons on loopback with real engines and bridges cold prompts (real
text, a unique tag each: nothing is in a store), greedy, then asks the same decoder for each prompt
natively; a row passes when every answer says `bridged`, pushed every whole block once, and equals
the native answer token for token.

  tp1             one prefilld, vLLM in one process: the baseline for tp2, same model.
  tp2             vLLM with `--tensor-parallel-size 2` (two worker processes, a core each). Every rank
                  holds the whole residual stream after its all-reduce, so rank 0 alone
                  reconstructs and streams; per rank, the reconstruction time the plugin reports.
  pp1, pp2        the test model in one process, and in two pipeline stages (`pipeline_parallel_size
                  = 2`, a core each, vLLM compiled): each stage reconstructs its own layers and
                  sends its part of every block; per stage, the reconstruction time it reports.
  two_prefillers  two prefilld instances behind one decoder (`[[front.prefillers]]`); the prompts
                  fire at once and spread over both by in-flight load.
  two_decoders    one prefilld pushing to two decoders of 256- and 128-token blocks; each decoder's
                  prompt fires at once and lands in its own store only.
  pp2_two_hosts,  pp2 and tp2 with vLLM over two hosts: this one (prefilld, vLLM's API server, the
  tp2_two_hosts   decoder) and a network namespace joined to it by a veth pair, where `prefilld node
                  --rank 1` starts vLLM's other worker (vLLM's own multi-node launch, `[engine.nodes]`).
                  Every daemon speaks mutual TLS (`engine.nodes` needs it). Under pipeline parallelism
                  the other host's stage fetches the bundle from prefilld's stage listener and sends
                  its part of every block there over TLS; under tensor parallelism rank 0 on this host
                  streams, as in tp2. Needs root (`ip netns`).

tp rows use the generated Llama 3 checkpoint (4 attention heads: the test model's 9 do not split
over two ranks; its 2 layers are too few for two stages, each of which needs two); the others use
the test model. On this rig every process shares two cores, so
TTFT is how the topologies behave here, not how fast they are on their own machines.

    bench/topology.sh [--prompt-tokens 1024] [--prompts 4] [--rows tp1,tp2,pp1,pp2,two_prefillers,two_decoders]

Writes bench/results/topology.json, keeping the rows of a previous run that this run does not
measure (each row says when it ran); prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

# bench/'s own modules: Python puts a script's folder first on its path.
from daemons import ROOT, Topology
from front_door import Client, EngineLog, Prompts, check, timed
from runs import log, run_rows

MAX_TOKENS = 32
MAX_LEN = 8192
PARALLEL = {"tp2": 'extra_args = ["--tensor-parallel-size", "2"]', "pp2": "pipeline_parallel_size = 2"}
PARALLEL |= {f"{row}_two_hosts": keys for row, keys in PARALLEL.items()}
# The other host of the two-host rows: its namespace, and both ends of the link.
OTHER = {"netns": "pdb-bench-other", "iface": "pdbbenchb", "addr": "10.231.251.2"}
HERE = {"iface": "pdbbencha", "addr": "10.231.251.1"}


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def other_host():
    """A network namespace joined to this one by a veth pair, removed on exit."""
    def remove():
        subprocess.run(["ip", "link", "del", HERE["iface"]], capture_output=True)
        subprocess.run(["ip", "netns", "del", OTHER["netns"]], capture_output=True)

    remove()
    ns = OTHER["netns"]
    ip("netns", "add", ns)
    try:
        ip("link", "add", HERE["iface"], "type", "veth", "peer", "name", OTHER["iface"])
        ip("link", "set", OTHER["iface"], "netns", ns)
        ip("addr", "add", f"{HERE['addr']}/24", "dev", HERE["iface"])
        ip("link", "set", HERE["iface"], "up")
        ip("-n", ns, "addr", "add", f"{OTHER['addr']}/24", "dev", OTHER["iface"])
        for link in (OTHER["iface"], "lo"):
            ip("-n", ns, "link", "set", link, "up")
        yield
    finally:
        remove()


def free_port_on(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def tls(certs: Path, name: str, peers: list[str]) -> str:
    return (f'\n[tls]\ncert = "{certs}/{name}.pem"\nkey = "{certs}/{name}.key"\nca = "{certs}/ca.pem"\n'
            f"peers = {json.dumps(peers)}\n")


@contextlib.contextmanager
def on_two_hosts(topology: Topology):
    """Rewrites `topology`'s configs for vLLM over this host and the other (`[engine.nodes]`, mutual
    TLS between every daemon) and runs `prefilld node` there while the rows run."""
    with other_host():
        run, certs = topology.run, topology.run / "certs"
        subprocess.run([str(ROOT / "target/release/pdbridge"), "certs", "--out", str(certs),
                        "prefill-a", "prefill-b", "mac-1"], check=True, capture_output=True)
        decoded, prefilld = topology.tomls["decoded-0"], topology.tomls["prefilld-0"]
        decoded.write_text(decoded.read_text().replace('prefilld = "http://', 'prefilld = "https://')
                           + tls(certs, "mac-1", ["prefill-a"]))
        port = topology.ports["decoded-0"]["grpc"]
        text = prefilld.read_text().replace(f'addr = "http://127.0.0.1:{port}"\n',
                                            f'addr = "https://127.0.0.1:{port}"\nname = "mac-1"\n')
        master_port, stage_port = (free_port_on(HERE["addr"]) for _ in range(2))
        nodes = (f'\n[engine.nodes]\ncount = 2\nhead = "{HERE["addr"]}"\nhead_identity = "prefill-a"\n'
                 f'master_port = {master_port}\nstage_listen = "{HERE["addr"]}:{stage_port}"\n'
                 'stage_peers = ["prefill-b"]\n')

        def host(core: int, where: dict, name: str) -> str:
            env = f'VLLM_CPU_OMP_THREADS_BIND = "{core}"\nGLOO_SOCKET_IFNAME = "{where["iface"]}"\n' \
                  f'VLLM_HOST_IP = "{where["addr"]}"\n'
            return text.replace('VLLM_CPU_OMP_THREADS_BIND = "0|1"\n', env) + nodes + tls(certs, name, ["mac-1"])

        prefilld.write_text(host(0, HERE, "prefill-a"))
        node = run / "node-1"
        node.mkdir()
        (node / "prefilld.toml").write_text(
            host(1, OTHER, "prefill-b").replace(f'"{run}/prefilld-0/bundles"', f'"{node}/bundles"'))
        proc = subprocess.Popen(
            ["ip", "netns", "exec", OTHER["netns"], str(ROOT / "target/release/prefilld"), "node",
             "--config", str(node / "prefilld.toml"), "--rank", "1"],
            stdout=open(node / "node.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()


def at_once(calls: list) -> list:
    """Runs the calls on threads released together; their results in order."""
    results = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i: int) -> None:
        barrier.wait()
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def answer(row: dict, native: dict, decoder: int) -> dict:
    """One prompt's record: bridged vs native on decoder `decoder`."""
    verdict = row["verdict"] or {}
    timings = verdict.get("timings_ms", {})
    return {
        "tag": row["prompt_tag"], "prompt_tokens": row["prompt_tokens"], "decoder": decoder,
        "rejected": check(row, "bridged") or check(native, "native"),
        "same_answer": row["text"] == native["text"],
        "bridged_ttft_s": row["ttft_s"], "native_ttft_s": native["ttft_s"],
        "prefillers": verdict.get("prefillers", []), "blocks": verdict.get("blocks"),
        "block_tokens": verdict.get("block_tokens"),
        "reconstruct_ms": timings.get("prefill_reconstruct"), "prefill_ms": timings.get("prefill_prefill"),
        # Pipeline stages each report their own (the plain figure is then the slowest stage's).
        "reconstruct_ms_per_stage": [timings[k] for k in sorted(timings) if k.startswith("prefill_reconstruct_stage")],
    }


def run_row(name: str, args, text: str) -> dict:
    setting = contextlib.nullcontext()
    if name in ("tp1", "tp2", "tp2_two_hosts"):
        topology = Topology("tiny-llama3", f"var/bench-topology/{name}", MAX_LEN, parallel=PARALLEL.get(name, ""),
                            fronts=('prefilld_name = "prefill-a"\n',) if name.endswith("_two_hosts") else ())
    elif name in ("pp1", "pp2", "pp2_two_hosts"):
        topology = Topology("smollm2", f"var/bench-topology/{name}", MAX_LEN, parallel=PARALLEL.get(name, ""),
                            fronts=('prefilld_name = "prefill-a"\n',) if name.endswith("_two_hosts") else ())
    elif name == "two_prefillers":
        topology = Topology("smollm2", f"var/bench-topology/{name}", MAX_LEN, prefillers=2)
    elif name == "two_decoders":
        topology = Topology("smollm2", f"var/bench-topology/{name}", MAX_LEN, decoders=(256, 128))
    else:
        raise SystemExit(f"unknown row {name}")
    if name.endswith("_two_hosts"):
        setting = on_two_hosts(topology)
    started, started_utc = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with setting, topology:
        ready_s = time.monotonic() - started
        decoders = range(sum(name.startswith("decoded") for name in topology.ports))
        clients = [Client(topology.front_url(i)) for i in decoders]
        logs = [EngineLog(topology.log(f"decoded-{i}")) for i in decoders]
        prompts = [Prompts(clients[i], text, f"topology {name} {i}") for i in decoders]
        records = []
        for n in range(args.prompts):
            if name[:2] in ("tp", "pp"):
                batch = [(0, prompts[0].make(args.prompt_tokens))]
            # Prompts answered at once differ in length: decoded's log names a request's engine
            # stages by its prompt length.
            elif name == "two_prefillers":  # two prompts at once into the one decoder
                batch = [(0, prompts[0].make(args.prompt_tokens + 16 * j)) for j in range(2)]
            else:  # a prompt into each decoder at once
                batch = [(i, prompts[i].make(args.prompt_tokens + 16 * i)) for i in decoders]
            bridged = at_once([lambda i=i, p=p: timed(clients[i], logs[i], p, "auto", MAX_TOKENS) for i, p in batch])
            for (i, prompt), row in zip(batch, bridged):
                native = timed(clients[i], logs[i], prompt, "native", MAX_TOKENS)
                records.append(answer(row, native, i))
                r = records[-1]
                log(f"  {name} prompt {n}: decoder {i}, {r['prompt_tokens']} tokens, prefillers {r['prefillers']}, "
                    f"same answer {r['same_answer']}, TTFT bridged {r['bridged_ttft_s']:.2f} s "
                    f"native {r['native_ttft_s']:.2f} s" + (f", REJECTED {r['rejected']}" if r["rejected"] else ""))
    result = {
        "row": name,
        "started_utc": started_utc,
        "daemons": sorted(topology.ports),
        "engine": PARALLEL.get(name, ""),
        "ready_s": round(ready_s, 1),
        "bridged": all(not r["rejected"] for r in records),
        "same_answer": all(r["same_answer"] for r in records),
        "bridged_ttft_s_median": statistics.median(r["bridged_ttft_s"] for r in records),
        "native_ttft_s_median": statistics.median(r["native_ttft_s"] for r in records),
        "prompts": records,
    }
    if name == "two_prefillers":
        result["prefillers_used"] = sorted({p for r in records for p in r["prefillers"]})
    if name[:2] in ("tp", "pp"):
        reconstruct = [r["reconstruct_ms"] for r in records if r["reconstruct_ms"] is not None]
        if name.startswith("pp2"):  # each stage reconstructs its own layers
            per_stage = [r["reconstruct_ms_per_stage"] for r in records]
            result["reconstruct_ms_per_rank_median"] = [statistics.median(ms) for ms in zip(*per_stage)]
        else:  # the emitting rank alone; tp2's other rank streams nothing
            ranks = 2 if name.startswith("tp2") else 1
            result["reconstruct_ms_per_rank_median"] = [statistics.median(reconstruct)] + [0.0] * (ranks - 1)
        result["prefill_ms_median"] = statistics.median(r["prefill_ms"] for r in records if r["prefill_ms"])
    return result


def table(rows: list[dict]) -> str:
    out = ["| row | bridged | same answer | TTFT bridged (median) | TTFT native (median) | reconstruct ms per rank |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        per_rank = ", ".join(f"{ms:.0f}" for ms in r.get("reconstruct_ms_per_rank_median", [])) or "-"
        out.append(f"| {r['row']} | {r['bridged']} | {r['same_answer']} | {r['bridged_ttft_s_median']:.2f} s | "
                   f"{r['native_ttft_s_median']:.2f} s | {per_rank} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--rows", default="tp1,tp2,pp1,pp2,two_prefillers,two_decoders")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "topology.json"))
    args = p.parse_args()
    setup = {"prompt_tokens": args.prompt_tokens, "prompts": args.prompts, "max_tokens": MAX_TOKENS,
             "temperature": 0, "stream": True}
    out = Path(args.out)
    kept = json.loads(out.read_text())["rows"] if out.exists() else []
    rows = run_rows("pd-bridge topologies (bench/topology.py)", args.rows.split(","),
                    lambda name, text: run_row(name, args, text), setup, args.out)
    measured = {r["row"] for r in rows}
    result = json.loads(out.read_text())
    result["rows"] = [r for r in kept if r["row"] not in measured] + rows
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result["rows"]))
    return 0 if all(r["bridged"] and r["same_answer"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
