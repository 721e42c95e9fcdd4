"""The plugin's streamer without an engine (MLX only): what the step loop queues leaves on the
request's socket in order, as the blocks the decoder's cache path computes, with every stage's time
in `done`; a request whose socket fails drops its remaining work while others go on; the frames
are proto/engine.proto's."""

from __future__ import annotations

import io
import os
import socket
import tempfile
import threading
import unittest
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch

from google.protobuf import json_format
from pdbridge_cache.proto import bridge_pb2, engine_pb2
from pdbridge_testkit import REPO
from pdbridge_testkit.decoder import decoder_bundle
from pdbridge_testkit.prefill import kind
from pdbridge_vllm import handoff, protocol, reconstruct, spans
from pdbridge_vllm.ring import PinnedRing
from pdbridge_vllm.streamer import STAGES, BridgeParams, RequestStream, Streamer

B = 16  # tokens per block
# What is under test is the threads and queues, not a model: the smallest generated one.
MODEL = REPO / "models" / "tiny-llama3-mlx"
GOLDEN = REPO / "proto" / "golden"


class Listener:
    """prefilld's side of the plugin socket: every connection's messages, read to its end."""

    def __init__(self, path: str):
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen()
        self.connections: list[list] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        conn, _ = self.server.accept()
        messages = []
        self.connections.append(messages)
        with conn, conn.makefile("rb") as f:
            while (msg := protocol.read_frame(f)) is not None:
                messages.append(msg)

    def wait(self) -> list:
        self.thread.join(timeout=120)
        self.server.close()
        return self.connections[0]


class StreamerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="pdb-streamer-")
        cls.bundle, cls.sha = decoder_bundle(Path(cls.tmp.name), MODEL)
        cls.path = reconstruct.load(cls.bundle, cls.sha)
        cls.layers = cls.path.layers
        rng = np.random.default_rng(0)
        cls.hidden = rng.standard_normal((4 * B, len(cls.layers), cls.path.hidden_size), dtype=np.float32)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def request(self, name: str, num_blocks: int) -> tuple[RequestStream, str]:
        sock = str(Path(self.tmp.name) / f"{name}.sock")
        params = BridgeParams(request_id=name, socket=sock, bundle_path=self.bundle, bundle_sha256=self.sha,
                              block_tokens=B, first_block=0, num_blocks=num_blocks)
        return RequestStream(params), sock

    def submit_whole(self, streamer: Streamer, stream: RequestStream, blocks: int) -> None:
        """A request's whole life as the step loop queues it: start, its blocks in one call, done."""
        streamer.submit_start(stream)
        streamer.submit_blocks(stream, 0, self.hidden[:blocks * B])
        streamer.submit_done(stream, blocks * B)

    def test_blocks_leave_in_order_as_computed_with_every_stages_time(self):
        streamer = Streamer(self.layers, handoff="auto", max_queued_mb=0.001, max_sending_mb=0.001)
        stream, sock = self.request("in-order", 4)
        listener = Listener(sock)
        streamer.submit_start(stream)
        # Two calls of two blocks each; the tiny budgets make every queue wait on the one after it.
        streamer.submit_blocks(stream, 0, torch.from_numpy(self.hidden[:2 * B]))
        streamer.submit_blocks(stream, 2, self.hidden[2 * B:])
        streamer.submit_done(stream, 4 * B)
        messages = listener.wait()
        streamer.close()
        self.assertEqual([kind(h) for h, _ in messages], ["block"] * 4 + ["done"])
        self.assertEqual([h.block.index for h, _ in messages[:4]], [0, 1, 2, 3])
        for k, (frame, payload) in enumerate(messages[:4]):
            want_headers, want_parts = reconstruct.wire(reconstruct.block(self.path, self.hidden[k * B:(k + 1) * B], k * B))
            self.assertEqual(list(frame.block.tensors), want_headers, f"block {k}")
            self.assertEqual(frame.block.payload_bytes, len(payload), f"block {k}")
            self.assertEqual(payload, b"".join(map(bytes, want_parts)), f"block {k}")
        done = messages[-1][0].done
        self.assertEqual((done.num_tokens, done.blocks_emitted), (4 * B, 4))
        for stage in ("to_mlx", "reconstruct", "to_host", "send"):
            self.assertGreater(getattr(done.timings, f"{stage}_ms"), 0, stage)

    def test_laid_out_blocks_stay_in_the_ring_until_prefilld_releases_them(self):
        ring = PinnedRing(1 << 12, pin=False)
        streamer = Streamer([], ring=ring)
        stream, sock = self.request("in-ring", 2)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(sock)
        server.listen()
        slot, flat, _ = ring.take(2 * 64)
        host = flat.view(2, 64)
        host.copy_(torch.arange(128, dtype=torch.uint8).view(2, 64))
        tensors = [engine_pb2.PluginTensor(layer=0, name="keys", dtype=bridge_pb2.DTYPE_U8, shape=[64], nbytes=64)]
        streamer.submit_laid_out(stream, 3, tensors, host, None, slot=slot)
        streamer.submit_done(stream, 2 * B)
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as f:
            frames = []
            while (msg := protocol.read_frame(f)) is not None:  # the plugin stops sending after done
                frames.append(msg[0])
            named, blocks, done = frames[0].ring, frames[1:3], frames[3]
            self.assertEqual((kind(frames[0]), named.size, done.done.blocks_emitted), ("ring", ring.size, 2))
            self.assertEqual([(b.block.index, b.block.ring_offset, b.block.payload_bytes) for b in blocks],
                             [(3, slot.start, 64), (4, slot.start + 64, 64)])
            with open(f"/proc/{os.getpid()}/fd/{named.fd}", "rb") as shared:  # prefilld's view of it
                shared.seek(slot.start)
                self.assertEqual(shared.read(128), bytes(range(128)))
            self.assertFalse(slot.released, "the blocks are prefilld's until it releases them")
            for b in blocks:
                release = engine_pb2.PluginRelease(ring_offset=b.block.ring_offset).SerializeToString()
                conn.sendall(len(release).to_bytes(4, "little") + release)
            waiter = threading.Thread(target=ring.take, args=(ring.size,))  # all of it: once both came back
            waiter.start()
            waiter.join(timeout=30)
            self.assertFalse(waiter.is_alive(), "both releases give the slot back")
        server.close()
        streamer.close()

    def test_a_block_lent_to_a_connection_that_never_opens_comes_back(self):
        ring = PinnedRing(1 << 12, pin=False)
        streamer = Streamer([], ring=ring)
        stream, _ = self.request("ring-nobody-listens", 1)  # its socket does not exist
        slot, flat, _ = ring.take(64)
        tensors = [engine_pb2.PluginTensor(layer=0, name="keys", dtype=bridge_pb2.DTYPE_U8, shape=[64], nbytes=64)]
        streamer.submit_laid_out(stream, 0, tensors, flat.view(1, 64), None, slot=slot)
        streamer.submit_done(stream, B)
        waiter = threading.Thread(target=ring.take, args=(ring.size,))  # all of it: once the slot is back
        waiter.start()
        waiter.join(timeout=30)
        streamer.close()
        self.assertFalse(waiter.is_alive(), "a block no connection took is released")
        self.assertTrue(stream.failed)

    def test_a_failed_socket_drops_its_request_and_the_next_one_is_served(self):
        streamer = Streamer(self.layers)
        lost, _ = self.request("nobody-listens", 2)  # its socket does not exist
        self.submit_whole(streamer, lost, 2)
        served, sock = self.request("served", 1)
        listener = Listener(sock)
        self.submit_whole(streamer, served, 1)
        messages = listener.wait()
        streamer.close()
        self.assertTrue(lost.failed and lost.closed)
        self.assertEqual([kind(h) for h, _ in messages], ["block", "done"])

    def test_a_bad_bundle_is_told_as_an_error_and_ends_the_stream(self):
        streamer = Streamer(self.layers)
        stream, sock = self.request("bad-bundle", 1)
        stream.params.bundle_sha256 = "00" * 32
        listener = Listener(sock)
        self.submit_whole(streamer, stream, 1)
        messages = listener.wait()
        streamer.close()
        self.assertEqual([(kind(h), h.error.failure) for h, _ in messages], [("error", protocol.BUNDLE_MISMATCH)])

    def test_a_traced_requests_stages_are_spans_under_prefillds_and_an_untraced_one_has_none(self):
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        exported = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exported))
        trace.set_tracer_provider(provider)  # what vLLM does with --otlp-traces-endpoint
        trace_id, parent_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
        for name, traceparent in (("untraced", ""), ("traced", f"00-{trace_id:032x}-{parent_id:016x}-01")):
            streamer = Streamer(self.layers)
            stream, sock = self.request(name, 2)
            stream.params.traceparent = traceparent
            stream.trace = spans.parent(traceparent)
            listener = Listener(sock)
            self.submit_whole(streamer, stream, 2)
            listener.wait()
            streamer.close()
            if name == "untraced":
                self.assertEqual(exported.get_finished_spans(), ())
        finished = exported.get_finished_spans()
        names = sorted(s.name for s in finished)
        self.assertEqual(names, ["pdbridge.reconstruct", "pdbridge.send", "pdbridge.send", "pdbridge.send",
                                 "pdbridge.to_host", "pdbridge.to_host", "pdbridge.to_mlx"])
        for s in finished:
            self.assertEqual((s.context.trace_id, s.parent.span_id), (trace_id, parent_id), s.name)
        sent = sorted((s.attributes["pdbridge.frame"], s.attributes["pdbridge.block"])
                      for s in finished if s.name == "pdbridge.send")
        self.assertEqual(sent, [("block", 0), ("block", 1), ("done", 0)])


class FrameTest(unittest.TestCase):
    def test_every_stage_the_streamer_times_is_a_field_of_the_done_frame(self):
        fields = [f.name for f in engine_pb2.PluginTimings.DESCRIPTOR.fields]
        self.assertEqual(fields, [f"{stage}_ms" for stage in STAGES])

    def test_the_golden_frames_survive_the_wire(self):
        """proto/golden's frames, which prefilld's reader is held to as well, written as the
        plugin writes them and read back: the same frames, a block's payload after it."""
        stream = io.BytesIO()
        sent = []
        for name in ("PluginFrame.json", "PluginFrame.done.json", "PluginFrame.error.json"):
            frame = json_format.Parse((GOLDEN / name).read_text(), engine_pb2.PluginFrame())
            payload = bytes(range(256)) * (frame.block.payload_bytes // 256)
            stream.write(protocol.encode_header(frame) + payload)
            sent.append((frame, payload))
        stream.seek(0)
        got = []
        while (frame := protocol.read_frame(stream)) is not None:
            got.append(frame)
        self.assertEqual(got, sent)
        self.assertEqual([kind(f) for f, _ in got], ["block", "done", "error"])


class HandoffTest(unittest.TestCase):
    def test_without_a_gpu_auto_takes_the_host_and_device_is_refused(self):
        self.assertIsInstance(handoff.choose("auto"), handoff.HostHandoff)
        self.assertEqual(handoff.choose("auto").name, handoff.HOST)
        with self.assertRaises(handoff.HandoffError):
            handoff.choose("device")
        with self.assertRaises(ValueError):
            handoff.choose("fast")

    def test_the_host_way_keeps_every_bit(self):
        h = handoff.HostHandoff()
        captured = torch.randn(7, 3, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        arrived = h.to_mlx(captured)
        self.assertEqual(arrived.dtype, mx.bfloat16)
        self.assertEqual(bytes(h.to_host(arrived)), captured.view(torch.int16).numpy().tobytes())
        self.assertEqual(bytes(h.to_host(h.to_mlx(captured.float()))), captured.float().numpy().tobytes())


if __name__ == "__main__":
    unittest.main(verbosity=2)
