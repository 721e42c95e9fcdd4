#!/usr/bin/env python3
"""Timing reconstruction beside a prefill on CUDA streams.

`cuda_time` times a callable with CUDA events (warm-up, repeats, no host sync inside a timed
region); `Bufs` holds the double-buffered capture, packed output and pinned host staging; the
`run_*` functions are what `reconstruct_overhead.py` times: reconstruction alone (with or without
its D2H), the D2H alone, the capture copies alone, and all of it overlapped with the prefill, the
streams synchronised only by CUDA events.
"""

from __future__ import annotations

import statistics

import torch

from llama_prefill import CACHE_DTYPE, MODEL_DTYPE, Cfg, chunks_of
from recon_kernels import reconstruct


def cuda_time(fn, reps, warmup, stream):
    times = []
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            fn()
            b.record(stream)
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    return times


def med(xs):
    return statistics.median(xs) if xs else None


class Bufs:
    """Double-buffered capture (device), packed output (device) and pinned host staging. The
    packed buffers are flat so that a chunk of nb blocks views them as one contiguous
    [L, nb, 2, n_kv, B, hd] tensor (a strided pinned destination would make torch copy through
    a temporary, synchronously)."""

    def __init__(self, cfg: Cfg, chunk: int, device):
        self.cfg = cfg
        nb = chunk // cfg.block
        L = cfg.layers
        self.cap = [torch.randn(L, chunk, cfg.hidden, device=device, dtype=MODEL_DTYPE)
                    for _ in range(2)]
        n = L * nb * 2 * cfg.kv_out * cfg.block
        self._out = [torch.empty(n, device=device, dtype=CACHE_DTYPE) for _ in range(2)]
        self._host = [torch.empty(n, dtype=CACHE_DTYPE, pin_memory=True) for _ in range(2)]

    def _view(self, flat, nb):
        c = self.cfg
        return flat[: c.layers * nb * 2 * c.kv_out * c.block].view(
            c.layers, nb, 2, c.n_kv, c.block, c.head_dim)

    def out(self, slot, nb):
        return self._view(self._out[slot], nb)

    def host(self, slot, nb):
        return self._view(self._host[slot], nb)


def run_recon_serial(cfg, bundle, variant, bufs, T, C, cos, sin, d2h):
    """Reconstruct every chunk on the current stream; with d2h, copy each chunk to pinned memory
    on the same stream (serial: compute, then copy)."""
    for s, c in chunks_of(T, C):
        nb = c // cfg.block
        out = bufs.out(0, nb)
        reconstruct(cfg, bundle, variant, bufs.cap[0][:, :c], s, out, cos, sin)
        if d2h:
            bufs.host(0, nb).copy_(out, non_blocking=True)


def run_d2h_only(cfg, bufs, T, C):
    for i, (s, c) in enumerate(chunks_of(T, C)):
        nb = c // cfg.block
        bufs.host(i % 2, nb).copy_(bufs.out(i % 2, nb), non_blocking=True)


def run_capture_only(cfg, model, bufs, T, C):
    for s, c in chunks_of(T, C):
        for l in range(cfg.layers):
            bufs.cap[0][l, :c].copy_(model.embed[:c])


def run_overlapped(cfg, model, bundle, variant, bufs, T, C, streams, gran, d2h_log):
    """Prefill (main stream, with capture) + reconstruction (side stream) + D2H per layer (copy
    stream). gran='chunk': the side stream starts a chunk once the prefill step that computed it
    ends (what vLLM's extract_hidden_states route offers: states arrive per step).
    gran='layer': it starts layer l of a chunk as soon as the prefill captured layer l's input."""
    main, side, copy = streams
    ev_rec, ev_d2h = [], []
    for i, (s, c) in enumerate(chunks_of(T, C)):
        slot, nb = i % 2, c // cfg.block
        cap, out, host = bufs.cap[slot][:, :c], bufs.out(slot, nb), bufs.host(slot, nb)
        if i >= 2:
            main.wait_event(ev_rec[i - 2])          # capture slot free again
        lev = [torch.cuda.Event() for _ in range(cfg.layers)] if gran == "layer" else None
        model.forward_chunk(s, c, capture=cap, layer_events=lev)
        step_done = torch.cuda.Event()
        step_done.record(main)
        done = [torch.cuda.Event() for _ in range(cfg.layers)]
        with torch.cuda.stream(side):
            if i >= 2:
                side.wait_event(ev_d2h[i - 2])      # output slot copied out
            if gran == "layer":
                before = lambda l, lev=lev: side.wait_event(lev[l])  # noqa: E731
            else:
                side.wait_event(step_done)
                before = None
            reconstruct(cfg, bundle, variant, cap, s, out, model.cos, model.sin, before=before,
                        after=lambda l, done=done: done[l].record(side))
        layer_bytes = c * 2 * cfg.kv_out * CACHE_DTYPE.itemsize
        with torch.cuda.stream(copy):
            for l in range(cfg.layers):
                copy.wait_event(done[l])
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record(copy)
                host[l].copy_(out[l], non_blocking=True)
                b.record(copy)
                d2h_log.append((a, b, layer_bytes))
        ev_rec.append(done[-1])
        ev_d2h.append(b)
    main.wait_event(ev_d2h[-1])
