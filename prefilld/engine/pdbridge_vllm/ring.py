"""The kv route's host memory, taken once at start and shared with prefilld: the ring.

Pinning memory is slow (page-locking ~300 MB takes about as long as vLLM's whole 8K prefill on an
H100), and torch's caching host allocator pins anew whenever a step's payload outgrows what it
holds; so the kv route copies each step's blocks into one ring, pinned when vLLM starts. The ring
is an in-memory file (a memfd) that prefilld maps too: a block's frame says where in the ring its
bytes are, and prefilld pushes them to the decoder from there, so no block crosses the socket.

Slots are handed out in order and come back when prefilld has released every block in them (in any
order: a failed request's slot comes back early). A full ring makes the step loop wait
(backpressure: the link is slower than the prefill), and the wait is reported as the request's
``ring_wait`` stage.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import socket
import threading
import time

import torch
from pdbridge_cache.proto import engine_pb2

from . import protocol

logger = logging.getLogger("vllm.pdbridge_vllm")


class Slot:
    """One payload's bytes in the ring. Each of its holders (one, unless `split`) releases it once;
    the bytes come back with the last release, and never twice."""

    def __init__(self, ring: PinnedRing, start: int, end: int):
        self._ring, self.start, self.end = ring, start, end
        self._holders = 1
        self.released = False

    def split(self, holders: int) -> None:
        """From now on `holders` hold the slot (a block each, which prefilld releases one by one)."""
        with self._ring._cv:
            self._holders = holders

    def release(self) -> None:
        self._ring._release(self)


class PinnedRing:
    def __init__(self, nbytes: int, pin: bool = True):
        self.size = nbytes
        # The descriptor prefilld maps the ring through (/proc/<this pid>/fd/<fd>).
        self.fd = os.memfd_create("pdbridge-ring", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self._map = mmap.mmap(self.fd, nbytes)
        self._buf = torch.frombuffer(self._map, dtype=torch.uint8)
        if pin:  # page-locked for the copy engine, as torch's pinned memory is
            status = torch.cuda.cudart().cudaHostRegister(self._buf.data_ptr(), nbytes, 0)
            if int(status) != 0:
                raise RuntimeError(f"pdbridge: cannot page-lock the {nbytes >> 20} MB ring: CUDA error {int(status)}")
        self._live: collections.deque[Slot] = collections.deque()
        self._cv = threading.Condition()

    def take(self, nbytes: int) -> tuple[Slot, torch.Tensor, float] | None:
        """A slot of `nbytes`, its bytes as a tensor, and the seconds waited for room; None when
        `nbytes` can never fit (the caller pins a buffer of its own)."""
        if nbytes > self.size:
            return None
        started = time.perf_counter()
        with self._cv:
            while (start := self._room(nbytes)) is None:
                self._cv.wait()
            slot = Slot(self, start, start + nbytes)
            self._live.append(slot)
        return slot, self._buf[slot.start:slot.end], time.perf_counter() - started

    def _room(self, nbytes: int) -> int | None:
        """Where `nbytes` fit after the newest slot, before the oldest live one."""
        if not self._live:
            return 0
        oldest, newest = self._live[0].start, self._live[-1].end
        if newest > oldest:  # live bytes in one run: room after them, or from the ring's start
            if newest + nbytes <= self.size:
                return newest
            return 0 if nbytes <= oldest else None
        return newest if newest + nbytes <= oldest else None  # wrapped: room between them

    def _release(self, slot: Slot) -> None:
        with self._cv:
            if slot.released:
                return
            slot._holders -= 1
            if slot._holders > 0:
                return
            slot.released = True
            while self._live and self._live[0].released:
                self._live.popleft()
            self._cv.notify_all()


class Lent:
    """The ring's blocks one connection to prefilld holds. A block's bytes are prefilld's from its
    frame until prefilld answers with its `PluginRelease`; prefilld ends the connection only once it
    holds none, so when the connection ends every block still lent comes back. A thread reads the
    answers; it owns the socket's closing (`close` only ends the sending side)."""

    def __init__(self, ring: PinnedRing, sock: socket.socket):
        self.ring, self._sock = ring, sock
        self._blocks: dict[int, Slot] = {}
        self._lock = threading.Lock()
        self._ended = False
        threading.Thread(target=self._read, name="pdbridge-ring-releases", daemon=True).start()

    def naming(self) -> engine_pb2.PluginFrame:
        """The frame that names the ring, sent before the connection's first block in it."""
        return engine_pb2.PluginFrame(ring=engine_pb2.PluginRing(fd=self.ring.fd, size=self.ring.size))

    def lend(self, offset: int, slot: Slot) -> None:
        """The block at `offset` (one of `slot`'s holders) is prefilld's once its frame is sent."""
        with self._lock:
            if not self._ended:
                self._blocks[offset] = slot
                return
        slot.release()  # the connection has ended: nobody will take it

    def close(self) -> None:
        """No more frames: prefilld answers what it holds, then ends the connection."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)

    def _read(self) -> None:
        try:
            for offset in protocol.read_releases(self._sock):
                with self._lock:
                    slot = self._blocks.pop(offset, None)
                if slot is not None:
                    slot.release()
        except (OSError, ValueError) as e:
            logger.warning("pdbridge: prefilld's ring answers: %s", e)
        finally:
            with self._lock:
                self._ended = True
                left, self._blocks = list(self._blocks.values()), {}
            for slot in left:
                slot.release()
            with contextlib.suppress(OSError):
                self._sock.close()
