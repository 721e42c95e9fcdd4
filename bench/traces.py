#!/usr/bin/env python3
"""What tracing costs (issue 32): bridged requests traced and not, side by side on one rig.

One prefilld and one decoder on the generated Llama 3, both with `[telemetry]` (and so vLLM, which
prefilld starts with the same collector), exporting to an OTLP/gRPC receiver in this process (built
on the published OTLP protobufs). The daemons' `sample_ratio` is 0: a request is recorded only when
its client sends a sampled W3C `traceparent`, so the same rig serves both kinds. Per length
(--lengths) and repeat (--repeats), after one unmeasured request of each kind: two cold prompts (a
unique tag each) bridged one after the other, one traced and one not, the traced one first on even
repeats. Per length: TTFT of each
(median) and their ratio, the spans each traced request yields by service once its trace has
arrived, and the spans recorded for untraced requests, by service (none expected: they carry no
`traceparent` and the daemons' sample ratio is 0).

    bench/traces.sh [--lengths 1024,2048,4096,7000] [--repeats 6]

Writes bench/results/traces.json; prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

# bench/'s own modules: Python puts a script's folder first on its path.
from daemons import ROOT, Topology, free_port
from front_door import Client, EngineLog, Prompts, timed
from runs import log, run_rows

MODEL = "tiny-llama3"
MAX_TOKENS = 8
MAX_LEN = 8192
EXPORT_DELAY = "200ms"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Every span received, as (trace id, service.name, span name)."""

    def __init__(self):
        self.spans: list[tuple[str, str, str]] = []
        self.changed = threading.Condition()

    def Export(self, request, context):
        with self.changed:
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                for scope in resource_spans.scope_spans:
                    self.spans.extend((s.trace_id.hex(), service, s.name) for s in scope.spans)
            self.changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, complete, timeout_s: float = 60) -> collections.Counter:
        """The trace's spans by service once `complete` holds of its span names (or at the timeout)."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while True:
                names = [(service, name) for t, service, name in self.spans if t == trace_id]
                if complete(names) or time.monotonic() > deadline:
                    return collections.Counter(service for service, _ in names)
                self.changed.wait(timeout=max(deadline - time.monotonic(), 0.01))


def serve_collector() -> tuple[Collector, grpc.Server, int]:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return collector, server, port


def whole(names: list[tuple[str, str]]) -> bool:
    """A bridged chat's trace has arrived: the engine's spans come last (the answer's end)."""
    return {("decoded", "front.request"), ("decoded", "engine.generate"), ("prefilld", "prefill"),
            ("vllm", "llm_request")} <= set(names)


def ask(client: Client, prompt: dict, kind: str, traced_ids: set[str]) -> tuple[dict, str]:
    """One bridged request, with a sampled traceparent of a new trace when `kind` is "traced"."""
    trace_id = os.urandom(16).hex()
    headers = {}
    if kind == "traced":
        traced_ids.add(trace_id)
        headers["traceparent"] = f"00-{trace_id}-{os.urandom(8).hex()}-01"
    return timed(client, EngineLog(None), prompt, "bridge", MAX_TOKENS, headers), trace_id


def measure(length: int, args, text: str, collector: Collector, port: int) -> dict:
    telemetry = f'otlp_endpoint = "http://127.0.0.1:{port}"\nsample_ratio = 0.0\nexport_delay = "{EXPORT_DELAY}"'
    with Topology(MODEL, f"var/bench-traces/{length}", MAX_LEN, telemetry=telemetry) as topology:
        client = Client(topology.front_url())
        prompts = Prompts(client, text, f"traces {length}")
        # Unmeasured: vLLM's first prefills and each exporter's first connection.
        for kind in ("traced", "untraced"):
            ask(client, prompts.make(length), kind, set())
        records, first_span, traced_ids = [], len(collector.spans), set()
        for repeat in range(args.repeats):
            order = ("traced", "untraced") if repeat % 2 == 0 else ("untraced", "traced")
            for kind in order:
                row, trace_id = ask(client, prompts.make(length), kind, traced_ids)
                spans = collector.trace(trace_id, whole) if kind == "traced" else collections.Counter()
                records.append({"repeat": repeat, "kind": kind, "prompt_tokens": row["prompt_tokens"],
                                "ttft_s": row["ttft_s"], "outcome": (row["verdict"] or {}).get("outcome"),
                                "error": row["error"], "spans": dict(spans)})
                r = records[-1]
                log(f"  {length}: {kind} {r['prompt_tokens']} tokens, {r['outcome']}, TTFT {r['ttft_s']:.2f} s, "
                    f"spans {r['spans']}")
    return summary(length, records, collector.spans[first_span:], traced_ids)


def summary(length: int, records: list[dict], spans: list[tuple[str, str, str]], traced_ids: set[str]) -> dict:
    def ttft(kind: str) -> float:
        return statistics.median(r["ttft_s"] for r in records if r["kind"] == kind)

    traced = [r for r in records if r["kind"] == "traced"]
    services = sorted({s for r in traced for s in r["spans"]})
    return {
        "length": length,
        "requests": len(records),
        "errors": sum(r["error"] is not None or r["outcome"] != "bridged" for r in records),
        "ttft_s_traced_median": round(ttft("traced"), 3),
        "ttft_s_untraced_median": round(ttft("untraced"), 3),
        "ttft_ratio_traced_to_untraced": round(ttft("traced") / ttft("untraced"), 3),
        "spans_per_trace_median": {s: statistics.median(r["spans"].get(s, 0) for r in traced) for s in services},
        "untraced_requests_spans": dict(collections.Counter(service for t, service, _ in spans
                                                            if t not in traced_ids)),
        "requests_measured": records,
    }


def table(rows: list[dict]) -> str:
    out = ["| prompt tokens | TTFT traced (median) | TTFT untraced (median) | traced / untraced | "
           "spans per traced request |", "|---:|---:|---:|---:|---|"]
    for r in rows:
        spans = ", ".join(f"{s} {n:g}" for s, n in r["spans_per_trace_median"].items())
        out.append(f"| {r['length']} | {r['ttft_s_traced_median']:.2f} s | {r['ttft_s_untraced_median']:.2f} s | "
                   f"{r['ttft_ratio_traced_to_untraced']:.2f} | {spans} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,2048,4096,7000")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "traces.json"))
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    collector, server, port = serve_collector()
    setup = {"model": MODEL, "repeats": args.repeats, "max_tokens": MAX_TOKENS, "temperature": 0,
             "stream": True, "mode": "bridge", "sample_ratio": 0.0, "export_delay": EXPORT_DELAY,
             "block_tokens": 256}
    try:
        rows = run_rows("what tracing costs a bridged request (bench/traces.py)", [str(n) for n in lengths],
                        lambda name, text: measure(int(name), args, text, collector, port), setup, args.out)
    finally:
        server.stop(grace=None)
    print(table(rows))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
