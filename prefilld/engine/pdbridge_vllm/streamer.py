"""The plugin's background threads: reconstruct blocks with MLX and stream them to prefilld.

The engine's step loop only gathers captured hidden states (a copy, so vLLM may free or reuse its
blocks at once; on a GPU it stays there, the streamer moves it) and queues them here. One thread
hands them to MLX and computes each block (`reconstruct`, through the `handoff` chosen at start);
a second writes finished blocks to the socket. So prefill of the next chunk overlaps
reconstruction of the last one, which overlaps the transfer of the one before. Both queues are
bounded in bytes: when prefilld or MLX falls behind, the step loop waits (backpressure) instead of
holding the whole prompt's hidden states in memory.

MLX work stays on the one reconstruction thread (bundle loads included), which also keeps MLX's
per-thread stream state in one place. The kv route's blocks arrive laid out (`kv_worker.py`): the
thread only waits for their copy to pinned memory, and never imports MLX. A request's messages
leave in the order they were queued.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import json_format
from pdbridge_cache.proto import bridge_pb2, engine_pb2

from . import protocol, spans
from .link import LinkError, RemoteLink
from .ring import Lent, PinnedRing, Slot

logger = logging.getLogger("vllm.pdbridge_vllm")

# What a request's blocks carry (`payload` of its params).
CACHE, LAYER_INPUTS = "cache", "layer_inputs"
# The stages a request's `done` reports the time of (`RequestStream.ms`; `PluginTimings` has a
# "<stage>_ms" field for each).
STAGES = ("capture", "to_mlx", "reconstruct", "to_host", "send", "ring_wait")


@dataclass
class BridgeParams:
    """The request's ``kv_transfer_params["pdbridge"]``: an ``engine_pb2.PluginParams`` in proto3
    JSON (proto/engine.proto documents every field), validated; a key or value the schema does not
    name is refused. What binds the plugin's arithmetic to the decoder is the bundle, held to ``bundle_sha256`` (the
    spec fingerprint is prefilld's to check, at the handshake)."""

    request_id: str
    socket: str
    bundle_path: str
    bundle_sha256: str
    block_tokens: int
    first_block: int
    num_blocks: int
    # Rows after the last block (the prompt's tail, all but its last token), sent as block
    # `end_block` for the one request that asked; never a stored block.
    tail_tokens: int = 0
    # The first block whose hidden states are captured: `first_block`, or 0 for a decoder with a
    # recurrent layer, whose state after a block scans every block before it. Blocks before
    # `first_block` (the decoder has them) only advance the state; they are not sent.
    from_block: int | None = None
    # What a block carries: the decoder's cache, or its layers' inputs (the decoder computes the
    # cache itself, exact on its own backend).
    payload: str = CACHE
    # prefilld's span of the request when it is traced (W3C traceparent), else "".
    traceparent: str = ""
    # How the blocks are made (`bridge_pb2.Route`; unset: reconstructed), and for the kv route the
    # decoder's spec, whose layers' tensors the blocks hold.
    route: int = bridge_pb2.ROUTE_UNSPECIFIED
    spec: Any = None

    @classmethod
    def parse(cls, raw: Any) -> BridgeParams:
        if not isinstance(raw, dict):
            raise ValueError("pdbridge params must be an object")
        try:
            m = json_format.ParseDict(raw, engine_pb2.PluginParams())
        except json_format.ParseError as e:
            raise ValueError(f"bad pdbridge params: {e}") from None
        p = cls(request_id=m.request_id, socket=m.socket, bundle_path=m.bundle_path,
                bundle_sha256=m.bundle_sha256, block_tokens=m.block_tokens, first_block=m.first_block,
                num_blocks=m.num_blocks, tail_tokens=m.tail_tokens,
                from_block=m.from_block if m.HasField("from_block") else m.first_block,
                payload=LAYER_INPUTS if m.payload == bridge_pb2.PAYLOAD_LAYER_INPUTS else CACHE,
                traceparent=m.traceparent, route=m.route, spec=m.spec if m.HasField("spec") else None)
        if not (p.request_id and p.socket and p.bundle_path):
            raise ValueError("request_id, socket and bundle_path are required")
        if p.block_tokens <= 0:
            raise ValueError("block_tokens must be > 0")
        if not 0 <= p.from_block <= p.first_block:
            raise ValueError("from_block must be in [0, first_block]")
        if not 0 <= p.tail_tokens < p.block_tokens:
            raise ValueError("tail_tokens must be in [0, block_tokens)")
        return p

    @property
    def end_block(self) -> int:
        return self.first_block + self.num_blocks


@dataclass
class RequestStream:
    """One request's stream to prefilld. `failed`/`closed` are set by the streamer thread and read
    by the step loop (a stale read only costs one wasted gather)."""

    params: BridgeParams
    # Milliseconds per stage: capture (step loop: gathering states), to_mlx (the states into MLX),
    # reconstruct (MLX computing blocks), to_host (blocks out of MLX), send (the socket).
    ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    blocks_emitted: int = 0
    # The decoder's recurrent layers' states after the blocks reconstructed so far (streamer).
    states: dict | None = None
    failed: bool = False
    closed: bool = False
    # The request's connection (opened by the first message); False once it failed.
    sock: socket.socket | None | bool = field(default=None, repr=False)
    # The ring's blocks the connection holds (`ring.Lent`), from its first block in the ring.
    lent: Any = field(default=None, repr=False)
    # What the request's spans continue (`spans.parent`); None: not traced.
    trace: Any = field(default=None, repr=False)

    def __post_init__(self):
        self.trace = spans.parent(self.params.traceparent)


class _BoundedQueue:
    """FIFO bounded in bytes of queued hidden states, counting the item being worked on. An item
    is always admitted into an empty queue, so one block larger than the budget cannot deadlock."""

    def __init__(self, max_bytes: int):
        self._max = max_bytes
        self._items: collections.deque = collections.deque()
        self._bytes = 0
        self._cv = threading.Condition()

    def put(self, item, nbytes: int = 0) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._bytes == 0 or self._bytes + nbytes <= self._max)
            self._items.append((item, nbytes))
            self._bytes += nbytes
            self._cv.notify_all()

    def get(self):
        """(item, nbytes); call `release(nbytes)` once the item's memory is no longer needed."""
        with self._cv:
            self._cv.wait_for(lambda: self._items)
            return self._items.popleft()

    def release(self, nbytes: int) -> None:
        with self._cv:
            self._bytes -= nbytes
            self._cv.notify_all()


class Streamer:
    """Queues + threads. `submit_*` are called from the engine's step loop and never raise for
    per-request problems: those become `error` messages on the request's stream."""

    def __init__(self, capture_layer_ids: list[int], max_queued_mb: float = 256,
                 socket_timeout_s: float = 60.0, cpus: str | None = "all", mlx_streams: int = 2,
                 max_bundles: int = 2, dense_weights: bool = False,
                 stage: tuple[int, int] | None = None, handoff: str = "auto",
                 max_sending_mb: float = 256, link: RemoteLink | None = None, ring: PinnedRing | None = None):
        self._capture_layer_ids = list(capture_layer_ids)
        # prefilld's stage listener when this stage runs on another box; None: the request's socket.
        self._link = link
        # The kv route's ring, which prefilld maps when it runs on this box (no `link`).
        self._ring = ring
        # (index, count) of this pipeline stage, which captures and sends only its own layers'
        # part of every block; prefilld assembles a block from every stage's part. None: all.
        self._stage = stage
        self._num_mlx_streams = max(1, mlx_streams)
        self._mlx_streams: list | None = None  # created on the reconstruction thread
        self._handoff_kind = handoff
        self._handoff = None  # chosen on the reconstruction thread (it imports MLX)
        self._queue = _BoundedQueue(int(max_queued_mb * 2**20))
        # Finished messages waiting for the socket, bounded in payload bytes.
        self._outbox = _BoundedQueue(int(max_sending_mb * 2**20))
        self._socket_timeout_s = socket_timeout_s
        self._cpus = cpus
        # sha256 -> the decoder's CachePath, least recently used first.
        self._bundles: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._max_bundles = max_bundles
        self._dense_weights = dense_weights
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    # ---- step-loop side -------------------------------------------------------------------------

    def submit_start(self, stream: RequestStream) -> None:
        """Load/validate the bundle early, so a bad bundle fails before any prefill work is wasted."""
        self._put(("start", stream, None))

    def submit_blocks(self, stream: RequestStream, first_index: int, hidden, tail: bool = False) -> None:
        """`hidden`: [rows, n_captured, hidden_size], the captured residual stream of consecutive
        whole blocks from `first_index` (or of the tail), as a numpy array or a torch tensor in the
        engine's dtype, on the host or the GPU (handed to MLX on the reconstruction thread, off the
        step loop, once the GPU has written it). Waits while the queue is over budget: backpressure."""
        from .handoff import ready_event

        nbytes = (hidden.nbytes if isinstance(hidden, np.ndarray)
                  else hidden.numel() * hidden.element_size())
        self._put(("blocks", stream, (first_index, hidden, ready_event(hidden), tail)), nbytes)

    def submit_laid_out(self, stream: RequestStream, first_index: int, tensors: list, payload, event,
                        tail: bool = False, slot: Slot | None = None) -> None:
        """Consecutive blocks already laid out as the decoder's (the kv route): `payload` a uint8
        torch tensor [blocks, bytes] on the host, which a GPU copy still fills until `event` (None:
        ready); each block's frame names `tensors`. `slot`: the payload's place in the ring, released
        once its bytes are no longer needed (sent, released by prefilld, or dropped). Waits while the
        queue is over budget."""
        self._put(("laid_out", stream, (first_index, tensors, payload, event, tail, slot)), payload.numel())

    def submit_done(self, stream: RequestStream, num_tokens: int) -> None:
        self._put(("done", stream, num_tokens))

    def submit_error(self, stream: RequestStream, failure: int, message: str) -> None:
        stream.failed = True
        self._put(("error", stream, (failure, message)))

    def close(self) -> None:
        if self._threads:
            self._queue.put(None)  # the reconstruction thread passes it on to the sender
            for thread in self._threads:
                thread.join(timeout=10)

    def _put(self, item, nbytes: int = 0) -> None:
        with self._lock:
            if not self._threads:
                self._threads = [threading.Thread(target=run, name=name, daemon=True)
                                 for name, run in (("pdbridge-reconstruct", self._run),
                                                   ("pdbridge-sender", self._run_sender))]
                for thread in self._threads:
                    thread.start()
        self._queue.put(item, nbytes)

    # ---- reconstruction thread ------------------------------------------------------------------

    def _run(self) -> None:
        self._widen_affinity()
        while True:
            item, nbytes = self._queue.get()
            if item is None:
                self._outbox.put(None)
                return
            try:
                self._handle(*item)
            finally:
                self._queue.release(nbytes)

    def _handle(self, kind: str, stream: RequestStream, arg) -> None:
        if stream.closed:  # the request already failed; drop its remaining work
            if kind == "laid_out" and arg[-1] is not None:
                arg[-1].release()
            return
        try:
            if kind == "start":
                self._bundle(stream)
            elif kind == "blocks":
                self._emit_blocks(stream, *arg)
            elif kind == "laid_out":
                self._emit_laid_out(stream, *arg)
            elif kind == "done":
                self._emit_done(stream, arg)
            elif kind == "error":
                self._fail(stream, *arg)
        except _StreamFailed:
            pass
        except Exception as e:  # never let the thread die: one request fails, others go on
            logger.exception("pdbridge: %s for %s failed", kind, stream.params.request_id)
            self._fail(stream, protocol.INTERNAL, f"{type(e).__name__}: {e}")

    def _widen_affinity(self) -> None:
        # vLLM pins the worker's main thread (and so threads it starts) to its OMP cores; MLX work
        # on those cores would stall the forward. MLX creates its own CPU threads lazily on first
        # use, i.e. on this thread, so they inherit this affinity.
        if self._cpus is None or not hasattr(os, "sched_setaffinity"):
            return
        before = os.sched_getaffinity(0)
        try:
            cpus = (set(range(os.cpu_count() or 1)) if self._cpus == "all"
                    else {int(c) for c in str(self._cpus).split(",") if c.strip()})
            os.sched_setaffinity(0, cpus)  # pid 0 = this thread on Linux
        except (OSError, ValueError) as e:
            logger.warning("pdbridge: cannot set streamer affinity to %s: %s", self._cpus, e)
        logger.info("pdbridge: streamer thread CPUs %s -> %s", sorted(before),
                    sorted(os.sched_getaffinity(0)))

    def _streams(self) -> list:
        if self._mlx_streams is None:
            import mlx.core as mx

            self._mlx_streams = [mx.new_stream(mx.default_device())
                                 for _ in range(self._num_mlx_streams)]
        return self._mlx_streams

    def _handoff_for(self):
        if self._handoff is None:
            from . import handoff

            self._handoff = handoff.choose(self._handoff_kind)
        return self._handoff

    def _bundle(self, stream: RequestStream):
        from . import reconstruct  # imports MLX, on this thread only

        p = stream.params
        key = p.bundle_sha256.lower() or p.bundle_path
        path = self._bundles.get(key)
        if path is None:
            try:
                path = reconstruct.load(self._bundle_file(p), p.bundle_sha256 or None, self._dense_weights)
            except reconstruct.BundleError as e:
                self._fail(stream, e.failure, str(e))
                raise _StreamFailed from None
            except LinkError as e:
                self._fail(stream, protocol.BUNDLE_UNREADABLE, str(e))
                raise _StreamFailed from None
            if self._stage is not None:  # this stage's part of the decoder's layers
                path = path.restricted(self._capture_layer_ids)
                if not path.layers:
                    self._fail(stream, protocol.BUNDLE_MISMATCH, f"the decoder has none of pipeline "
                               f"stage {self._stage[0]}'s layers {self._capture_layer_ids}")
                    raise _StreamFailed
            missing = [lay for lay in path.layers if lay not in self._capture_layer_ids]
            if missing:
                self._fail(stream, protocol.BUNDLE_MISMATCH,
                           f"bundle layers {missing} are not captured by the engine "
                           f"(capture ids {self._capture_layer_ids})")
                raise _StreamFailed
            self._bundles[key] = path
            while len(self._bundles) > self._max_bundles:
                self._bundles.popitem(last=False)
        self._bundles.move_to_end(key)
        return path

    def _emit_blocks(self, stream: RequestStream, first_index: int, hidden, event, tail: bool) -> None:
        from . import reconstruct

        path = self._bundle(stream)
        if hidden.shape[2] != path.hidden_size:
            self._fail(stream, protocol.BUNDLE_MISMATCH,
                       f"captured hidden size {hidden.shape[2]} != the decoder's {path.hidden_size}")
            return
        with _clock(stream, "to_mlx", block=first_index):
            hidden = reconstruct.captured_states(hidden, self._capture_layer_ids, path.layers,
                                                 self._handoff_for(), event)
        B = stream.params.block_tokens
        count = 1 if tail else hidden.shape[0] // B
        if stream.params.payload == LAYER_INPUTS:
            if path.recurrent:
                self._fail(stream, protocol.BAD_PARAMS, "layer inputs cannot carry a recurrent state: the "
                           "decoder would need every block before the first it is sent")
                return
            for k in range(count):
                self._send_block(stream, first_index + k, reconstruct.layer_inputs(path, hidden[k * B:(k + 1) * B]), tail)
            return
        if tail or path.per_block or count == 1:
            for k in range(count):
                self._emit_block(stream, path, first_index + k, hidden[k * B:(k + 1) * B], tail)
            return
        try:
            with _clock(stream, "reconstruct", block=first_index, blocks=count):
                rows = reconstruct.blocks(path, hidden, first_index * B, B, self._streams())
        except Exception as e:
            self._fail(stream, protocol.RECONSTRUCT_FAILED, f"blocks from {first_index}: {e}")
            return
        for k, block_rows in enumerate(rows):
            self._send_block(stream, first_index + k, block_rows, tail=False)

    def _emit_block(self, stream: RequestStream, path, block_index: int, hidden, tail: bool) -> None:
        from . import reconstruct

        if stream.states is None:
            stream.states = path.new_states()
        # A block the decoder already has: reconstructed only to carry the state on.
        known = block_index < stream.params.first_block
        try:
            with _clock(stream, "reconstruct", block=block_index, blocks=1):
                rows = reconstruct.block(path, hidden, offset=block_index * stream.params.block_tokens,
                                         streams=self._streams(), states=stream.states, only_states=known)
        except Exception as e:
            self._fail(stream, protocol.RECONSTRUCT_FAILED, f"block {block_index}: {e}")
            raise _StreamFailed from None
        if not known:
            self._send_block(stream, block_index, rows, tail)

    def _send_block(self, stream: RequestStream, block_index: int, rows: list, tail: bool) -> None:
        from . import reconstruct

        with _clock(stream, "to_host", block=block_index):
            tensors, payload = reconstruct.wire(rows, self._handoff_for())
        self._send_frame_block(stream, block_index, tensors, payload, tail)

    def _emit_laid_out(self, stream: RequestStream, first_index: int, tensors: list, payload, event,
                       tail: bool, slot: Slot | None) -> None:
        try:
            if event is not None:
                with _clock(stream, "to_host", block=first_index):
                    event.synchronize()
            blocks, size = payload.shape
            if slot is not None and self._link is None:  # prefilld maps the ring: only frames leave
                slot.split(blocks)
                for k in range(blocks):
                    self._send_frame_block(stream, first_index + k, tensors, [], tail, lent=(slot.start + k * size, slot))
            else:
                for k in range(blocks):
                    view = memoryview(payload[k].numpy()).cast("B")
                    last = k == blocks - 1  # the sender sends in order: the last frame frees all
                    self._send_frame_block(stream, first_index + k, tensors, [view], tail,
                                           on_sent=slot.release if last and slot is not None else None)
            slot = None
        finally:
            if slot is not None:  # not handed to the sender
                slot.release()

    def _send_frame_block(self, stream: RequestStream, block_index: int, tensors: list, payload: list,
                          tail: bool, on_sent=None, lent: tuple[int, Slot] | None = None) -> None:
        """One block's frame and its payload, or (`lent`) its offset in the ring and the slot prefilld
        releases it from."""
        block = engine_pb2.PluginBlock(index=block_index, payload_bytes=sum(t.nbytes for t in tensors),
                                       tensors=tensors, ring_offset=lent[0] if lent else None)
        self._send(stream, self._frame(stream, block=block), payload, on_sent, lent)
        stream.blocks_emitted += not tail  # the tail is not one of the request's blocks

    def _emit_done(self, stream: RequestStream, num_tokens: int) -> None:
        # The sender fills in the timings when it sends it: its own socket time is the last.
        done = engine_pb2.PluginDone(num_tokens=num_tokens, blocks_emitted=stream.blocks_emitted)
        self._send(stream, self._frame(stream, done=done))
        self._send(stream, None)  # then close

    def _fail(self, stream: RequestStream, failure: int, message: str) -> None:
        stream.failed = True
        if stream.closed:  # its end is already queued: nothing may follow it
            return
        logger.warning("pdbridge: request %s failed: %s: %s", stream.params.request_id,
                       engine_pb2.PluginFailure.Name(failure), message)
        error = engine_pb2.PluginError(failure=failure, message=message)
        self._send(stream, self._frame(stream, error=error))
        self._send(stream, None)

    def _frame(self, stream: RequestStream, **frame) -> engine_pb2.PluginFrame:
        stage, stages = self._stage or (0, 0)
        return engine_pb2.PluginFrame(request_id=stream.params.request_id, stage=stage, stages=stages, **frame)

    def _send(self, stream: RequestStream, frame: engine_pb2.PluginFrame | None, payload=(), on_sent=None,
              lent: tuple[int, Slot] | None = None) -> None:
        """Queues a frame (None: close the stream) for the sender thread; the closing one marks
        the stream closed at once, so no later work for it is queued. `on_sent` is called once the
        sender is done with the frame (sent or dropped); a `lent` block's slot is prefilld's once
        its frame is sent, released here if it is dropped."""
        if frame is None:
            stream.closed = True
        self._outbox.put((stream, frame, payload, on_sent, lent), sum(len(p) for p in payload))

    def _bundle_file(self, p: BridgeParams) -> str:
        """Where the request's bundle is on this box: prefilld's path on its own box; on another,
        this box's copy, fetched from prefilld on first use."""
        if self._link is None:
            return p.bundle_path
        if not p.bundle_sha256:
            raise LinkError("a stage on another box needs the bundle's SHA-256 to fetch it")
        return str(self._link.bundle(p.bundle_sha256.lower(), self._socket_timeout_s))

    # ---- sender thread ----------------------------------------------------------------------------

    def _run_sender(self) -> None:
        while True:
            item, nbytes = self._outbox.get()
            try:
                if item is None:
                    return
                stream, frame, payload, _, lent = item
                if frame is None:
                    self._close(stream)
                elif stream.sock is not False:  # False: its connection failed; drop the rest
                    if frame.HasField("done"):
                        frame.done.timings.CopyFrom(engine_pb2.PluginTimings(
                            **{f"{stage}_ms": round(ms, 3) for stage, ms in stream.ms.items()}))
                    if self._write(stream, frame, payload, lent):
                        lent = None
                if lent is not None:  # dropped, or no connection took it: prefilld never had it
                    lent[1].release()
            finally:
                if item is not None and item[3] is not None:  # the frame's bytes are free
                    item[3]()
                self._outbox.release(nbytes)

    def _write(self, stream: RequestStream, frame: engine_pb2.PluginFrame, payload,
               lent: tuple[int, Slot] | None = None) -> bool:
        """Sends a frame. A `lent` block's slot is handed to the connection's `Lent` before anything
        is sent (the first such block names the ring), which then releases it whatever happens;
        returns whether it was handed over (not when the connection could not be opened)."""
        handed = False
        with _clock(stream, "send", frame=frame.WhichOneof("frame") or "", block=frame.block.index):
            try:
                if stream.sock is None:  # lazily: the first message opens the request's connection
                    stream.sock = self._connect(stream.params.socket)
                if lent is not None:
                    naming = stream.lent is None
                    if naming:
                        stream.lent = Lent(self._ring, stream.sock)
                    stream.lent.lend(*lent)
                    handed = True
                    if naming:
                        protocol.send_frame(stream.sock, stream.lent.naming())
                protocol.send_frame(stream.sock, frame, payload)
            except OSError as e:
                # Nowhere left to report it; prefilld sees the connection fail or never open.
                where = f"{self._link.host}:{self._link.port}" if self._link else stream.params.socket
                logger.error("pdbridge: link %s for %s: %s", where, stream.params.request_id, e)
                stream.failed = stream.closed = True
                self._close(stream)
                stream.sock = False
        return handed

    def _connect(self, unix_path: str) -> socket.socket:
        if self._link is not None:
            return self._link.connect(self._socket_timeout_s)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self._socket_timeout_s)
        try:
            s.connect(unix_path)
        except OSError:
            s.close()
            raise
        return s

    @staticmethod
    def _close(stream: RequestStream) -> None:
        """Ends the request's connection; one that holds ring blocks only stops sending (prefilld
        ends it once it has released them: the ring's bytes are never reused while it reads them)."""
        stream.closed = True
        if stream.lent is not None:
            stream.lent.close()
        elif stream.sock:
            try:
                stream.sock.close()
            except OSError:
                pass
        stream.sock = None


@contextlib.contextmanager
def _clock(stream: RequestStream, stage: str, **attributes):
    """Adds the time of the block to the request's `stage`; a span of it when the request is traced."""
    t0 = time.perf_counter()
    try:
        with spans.span(stream.trace, stage, **attributes):
            yield
    finally:
        stream.ms[stage] += (time.perf_counter() - t0) * 1e3


class _StreamFailed(Exception):
    """The request's stream is closed; stop working on this item."""
