"""Prefill speed with the plugin off vs on, and request → done latency (real engines).

    flock /tmp/pdb-heavy.lock .venv/bin/python prefilld/engine/tests/bench_prefill.py [--tokens 600 2048]

Servers, one at a time: plain vLLM and vLLM + plugin (defaults: 2 MLX streams), each with the
default token budget (4096: a prompt is one step) and with 256 (chunked prefill, blocks leave per
step). Per prompt length, after a warm-up: 3 plain requests, then (plugin) 3 bridged requests.
Prefill time = HTTP latency of a max_tokens=1 completion; first block / done = POST → that event.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from pdbridge_testkit.decoder import decoder_bundle
from pdbridge_testkit.prefill import Receiver, VllmServer, prompt_tokens
from pdbridge_testkit.prefill import timings as timings_of

B = 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[600, 2048])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pdb-bench-"))
    bundle, sha = decoder_bundle(tmp)
    rx = Receiver(tmp / "plugin.sock")
    prompts = {n: prompt_tokens(n) for n in args.tokens}
    configs = [(f"plugin {'on' if plugin else 'off'}, budget {budget}", plugin, budget)
               for budget in (4096, 256) for plugin in (False, True)]
    rows, seq = [], 0
    for label, plugin, budget in configs:
        srv = VllmServer(tmp / f"vllm-{len(rows)}.log", plugin=plugin,
                                 extra_args=["--max-num-batched-tokens", str(budget)])
        start_s = srv.start()
        try:
            for n, toks in prompts.items():
                srv.complete(toks)  # warm-up
                plain = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    srv.complete(toks)
                    plain.append(time.perf_counter() - t0)
                row = {"config": label, "tokens": n, "start_s": start_s,
                       "prefill_s": statistics.median(plain)}
                if plugin:
                    http, first, done, timings = [], [], [], None
                    for i in range(args.reps + 1):  # first one warms MLX and the bundle cache
                        seq += 1
                        rid = f"bench-{seq}"
                        p = {"request_id": rid, "socket": rx.path, "bundle_path": bundle,
                             "bundle_sha256": sha, "block_tokens": B,
                             "first_block": 0, "num_blocks": (n - 1) // B}
                        t0 = time.perf_counter()
                        srv.complete(toks, {"pdbridge": p})
                        t_http = time.perf_counter() - t0
                        msgs = rx.wait_final(rid)
                        assert msgs[-1][1].HasField("done"), msgs[-1][1]
                        if i:
                            http.append(t_http)
                            first.append(msgs[0][0] - t0)
                            done.append(msgs[-1][0] - t0)
                            timings = timings_of(msgs[-1][1])
                    row.update(bridged_prefill_s=statistics.median(http),
                               first_block_s=statistics.median(first),
                               done_s=statistics.median(done), timings_ms=timings)
                rows.append(row)
                print(row, flush=True)
        finally:
            srv.stop()
    print("\n| config | tokens | plain req prefill | tok/s | bridged req prefill | tok/s "
          "| POST→first block | POST→done |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["tokens"]
        b = (f"{r['bridged_prefill_s']:.3f} s | {n / r['bridged_prefill_s']:.0f} "
             f"| {r['first_block_s']:.2f} s | {r['done_s']:.2f} s" if "done_s" in r
             else "– | – | – | –")
        print(f"| {r['config']} | {n} | {r['prefill_s']:.3f} s | {n / r['prefill_s']:.0f} | {b} |")
    rx.close()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
