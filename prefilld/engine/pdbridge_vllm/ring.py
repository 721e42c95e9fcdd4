"""Page-locked host memory for the kv route, taken once at start.

Pinning memory is slow (page-locking ~300 MB takes about as long as vLLM's whole 8K prefill on an
H100), and torch's caching host allocator pins anew whenever a step's payload outgrows what it
holds; so the kv route copies each step's blocks into one ring of pinned memory instead, pinned
when vLLM starts. Slots are handed out in order and come back when their last frame has been sent
(in any order: a failed request's slot comes back early). A full ring makes the step loop wait
(backpressure: the link is slower than the prefill), and the wait is reported as the request's
``ring_wait`` stage.
"""

from __future__ import annotations

import collections
import threading
import time

import torch


class Slot:
    """One payload's bytes in the ring; `release` (idempotent) gives them back."""

    def __init__(self, ring: PinnedRing, start: int, end: int):
        self._ring, self.start, self.end = ring, start, end
        self.released = False

    def release(self) -> None:
        self._ring._release(self)


class PinnedRing:
    def __init__(self, nbytes: int, pin: bool = True):
        self.size = nbytes
        self._buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
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
            slot.released = True
            while self._live and self._live[0].released:
                self._live.popleft()
            self._cv.notify_all()
