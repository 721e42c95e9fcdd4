"""The kv route's worker side: vLLM's own K/V as the decoder's cache, with no MLX on the prefill box.

For decoders whose layers cache post-RoPE keys and values per token (``KVCache``,
``RotatingKVCache``, ``QuantizedKVCache``: what vLLM's paged cache holds, from the same weights),
nothing is recomputed. Per step:

1. ``begin_step`` (metadata bound, before the forward): admits new requests (their ``spec`` says
   every layer's tensors), and for each bridged request the step computes, the positions it needs
   become (block, offset) indices per KV cache group and a staging buffer ``[layers, 2, kv_heads,
   rows, head_dim]`` in the decoder's dtype, holding first the rows left over from earlier steps.
2. ``save_kv_layer`` (after each attention layer wrote its cache): the layer's new rows are read
   out of the paged cache into the staging buffer (`paged.py`) — on a side CUDA stream that waits
   for the layer's write, so the forward never waits on the bridge.
3. ``wait_for_save`` (after the forward): the whole blocks the staging buffer completes are laid out
   as the decoder's blocks (quantized on the GPU as MLX quantizes, `kv_quant.py`, by one Triton
   kernel where it gives the same bytes, `kv_quant_fused.py`), copied with one
   asynchronous copy into the ring (`ring.py`: memory shared with prefilld, page-locked once at
   start), and queued with the copy's event to the streamer, whose thread sends their frames when
   the copy is done (prefilld reads the bytes from the ring); the rest stays as the next step's
   carry. vLLM's stream waits only for the reads (vLLM may reuse a sliding
   window's blocks): the rest of the route's GPU work overlaps vLLM's sampling and next steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pdbridge_cache.proto import bridge_pb2, engine_pb2

from . import kv_quant, protocol
from .kv_quant_fused import Fused
from .link import RemoteLink
from .metadata import PdBridgeMetadata, StepProgress
from .paged import LayoutError, PagedRows
from .ring import PinnedRing, Slot
from .streamer import Streamer
from .worker import BridgeWorker, WorkerState

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("vllm.pdbridge_vllm")

_DTYPES = {bridge_pb2.DTYPE_F32: torch.float32, bridge_pb2.DTYPE_F16: torch.float16,
           bridge_pb2.DTYPE_BF16: torch.bfloat16}
_SIZES = {bridge_pb2.DTYPE_F32: 4, bridge_pb2.DTYPE_F16: 2, bridge_pb2.DTYPE_BF16: 2, bridge_pb2.DTYPE_U32: 4}
_PLAIN = ("keys", "values")
_QUANTIZE_BLOCKS = 8
_QUANTIZED = ("keys", "keys_scales", "keys_biases", "values", "values_scales", "values_biases")


class SpecError(Exception):
    """The decoder's spec asks for a cache the kv route cannot lay vLLM's K/V out as."""


@dataclass
class _Run:
    """Consecutive layers laid out alike: [first, end) of the decoder's layers, quantized or not."""
    first: int
    end: int
    bits: int = 0
    group_size: int = 0


class Layout:
    """The decoder's block, as the request's spec says, from rows ``[layers, 2, heads, rows, dim]``:
    each layer's keys then values ``[1, heads, rows, dim]`` in the decoder's dtype, or, quantized,
    each one's codes, scales and biases."""

    def __init__(self, spec: bridge_pb2.CacheSpec, heads: int, head_dim: int, layers: int,
                 quantizer: Fused | None = None):
        if len(spec.layers) != layers:
            raise SpecError(f"the decoder has {len(spec.layers)} layers, vLLM {layers}")
        self.dtype, self.rule = None, spec.decoder_code.device or kv_quant.CPU
        self.heads, self.head_dim = heads, head_dim
        self.runs: list[_Run] = []
        for layer in spec.layers:
            names = tuple(t.name for t in layer.tensors)
            if names not in (_PLAIN, _QUANTIZED) or (names == _QUANTIZED) != bool(layer.kv_bits):
                raise SpecError(f"layer {layer.index} ({layer.cache_class}) caches {list(names)}, not "
                                "keys and values per token")
            keys = layer.tensors[0]
            width = head_dim * layer.kv_bits // 32 if layer.kv_bits else head_dim
            if list(keys.shape) != [1, heads, 1, width]:
                raise SpecError(f"layer {layer.index}'s keys are {list(keys.shape)} per token; vLLM's "
                                f"cache holds {heads} heads of {head_dim}")
            dtype = _DTYPES.get(layer.tensors[1 if layer.kv_bits else 0].dtype)
            if dtype is None or self.dtype not in (None, dtype):
                raise SpecError(f"layer {layer.index}'s dtype is not one float type for every layer")
            self.dtype = dtype
            run = _Run(layer.index, layer.index + 1, layer.kv_bits, layer.kv_group_size)
            last = self.runs[-1] if self.runs else None
            if last and (last.bits, last.group_size) == (run.bits, run.group_size):
                last.end = run.end
            else:
                self.runs.append(run)
        self._spec = spec
        self._quantizer = quantizer or Fused()

    def headers(self, rows: int) -> tuple[list[engine_pb2.PluginTensor], int]:
        """The block's tensors for `rows` tokens, offsets in `lay_out`'s order, and its bytes."""
        out, at = [], 0
        for layer in self._spec.layers:
            for t in layer.tensors:
                shape = list(t.shape)
                shape[2] = rows
                nbytes = shape[1] * rows * shape[3] * _SIZES[t.dtype]
                out.append(engine_pb2.PluginTensor(layer=layer.index, name=t.name, dtype=t.dtype, shape=shape,
                                                   offset=at, nbytes=nbytes))
                at += nbytes
        return out, at

    def lay_out(self, rows: torch.Tensor, count: int, block_bytes: int) -> torch.Tensor:
        """`count` consecutive blocks of `rows` ([layers, 2, heads, count * R, dim]) as one uint8
        tensor [count, block_bytes], each block's bytes as `headers(R)` says."""
        blocks = rows.unflatten(3, (count, -1)).permute(3, 0, 1, 2, 4, 5)  # [count, layers, 2, heads, R, dim]
        out = torch.empty((count, block_bytes), dtype=torch.uint8, device=rows.device)
        at = 0
        for run in self.runs:
            part = blocks[:, run.first:run.end]
            if not run.bits:
                width = part[0].numel() * part.element_size()
                out[:, at:at + width].view(part.dtype).view(part.shape).copy_(part)
                at += width
                continue
            # A few blocks at a time: quantizing works in float32 (4x a bf16 block in temporaries).
            for lo in range(0, count, _QUANTIZE_BLOCKS):
                codes, scales, biases = self._quantizer.quantize(part[lo:lo + _QUANTIZE_BLOCKS], run.group_size,
                                                                 run.bits, self.rule)
                each = [t.view(torch.uint8).flatten(3) for t in (codes, scales, biases)]  # [blocks, n, 2, bytes]
                laid = torch.cat(each, dim=3).flatten(1)
                out[lo:lo + len(laid), at:at + laid.shape[1]].copy_(laid)
            at += laid.shape[1]
        return out


class _Profile:
    """``PDBRIDGE_KV_PROFILE=<dir>`` (the GPU bench): the steps of one bridged request, the
    ``PDBRIDGE_KV_PROFILE_REQUEST``-th (default 2: the first warms up), under torch's profiler, CPU
    and CUDA, the forward's kernels beside the route's, summarized into
    ``<dir>/kv_route_profile.txt``. Off otherwise."""

    def __init__(self):
        self.dir = os.environ.get("PDBRIDGE_KV_PROFILE")
        self.nth = int(os.environ.get("PDBRIDGE_KV_PROFILE_REQUEST", "2"))
        self.admitted = 0
        self.target: str | None = None
        self.profiler = None

    def admit(self, req_id: str) -> None:
        self.admitted += 1
        if self.dir and self.admitted == self.nth:
            self.target = req_id
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA])
            self.profiler.start()

    def finished(self, req_ids) -> None:
        if self.profiler is None or self.target not in req_ids:
            return
        torch.cuda.synchronize()
        self.profiler.stop()
        averages = self.profiler.key_averages()
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "kv_route_profile.txt"), "w") as out:
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                out.write(f"# by {key}\n{averages.table(sort_by=key, row_limit=40, max_name_column_width=60)}\n")
        self.profiler = None
        logger.info("pdbridge: the kv route's profile is in %s", self.dir)


@dataclass
class _Staged:
    """One request's part of a step: where its rows are read from and into."""
    st: WorkerState
    layout: Layout
    rows: torch.Tensor  # [layers, 2, heads, carried + new, dim]
    at: int  # where this step's rows start in `rows`
    index: list[tuple[torch.Tensor, torch.Tensor]]  # per KV cache group: (blocks, offsets); [] if none new
    prog: StepProgress
    layers_read: int = 0  # save_kv_layer calls that filled this step's rows


class KvWorker(BridgeWorker):
    """The kv route's worker: each layer's new rows out of vLLM's paged cache, per finished block
    to the streamer (no capture, no MLX)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, streamer_args: dict):
        super().__init__(streamer_args)
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        # layer name -> (decoder layer index, KV cache group, reader); filled by register_kv_caches.
        self._layers: dict[str, tuple[int, int, PagedRows]] = {}
        self._group_block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        self._kernel_block_sizes: list[int] = []
        self._layouts: dict[str, Layout] = {}
        self._step: list[_Staged] = []
        self._device: torch.device | None = None
        self._side: torch.cuda.Stream | None = None
        self._ring: PinnedRing | None = None
        self._profile = _Profile()
        self._quantizer = Fused()  # shared by the requests: it checks the kernel once per kind

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], has_work=None) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.models.utils import extract_layer_index

        if get_tensor_model_parallel_world_size() > 1:
            raise RuntimeError("pdbridge: the kv route reads whole heads on one rank; with tensor "
                               "parallelism run engine.route = \"reconstruct\"")
        modules = get_layers_from_vllm_config(self._vllm_config, Attention, list(kv_caches))
        group_of = {name: g for g, group in enumerate(self._kv_cache_config.kv_cache_groups)
                    for name in group.layer_names}
        kernel = {}
        for name, cache in kv_caches.items():
            reader = PagedRows(cache, modules.get(name))  # LayoutError: the route cannot run here
            self._layers[name] = (extract_layer_index(name), group_of[name], reader)
            kernel[group_of[name]] = cache.shape[2]
        self._kernel_block_sizes = [kernel.get(g, size) for g, size in enumerate(self._group_block_sizes)]
        self._device = next(iter(kv_caches.values())).device
        if self._device.type == "cuda":
            self._side = torch.cuda.Stream(self._device)
        # Page-locked for the copy engine on a GPU; on either device the memory prefilld reads.
        self._ring = PinnedRing(int(self._streamer_args["max_queued_mb"] * 2**20), pin=self._side is not None)
        self._streamer = Streamer([], link=RemoteLink.from_env(), ring=self._ring, **self._streamer_args)
        logger.info("pdbridge: the kv route reads %d layers' K/V (%s)", len(self._layers),
                    "side CUDA stream" if self._side else self._device.type)

    # ---- the step --------------------------------------------------------------------------------

    def begin_step(self, meta: PdBridgeMetadata | None) -> None:
        self._step = []
        if meta is None:
            return
        try:
            for new in meta.new_requests:
                self._admit_kv(new)
            with self._on_side():
                for prog in meta.progress:
                    st = self._reqs.get(prog.req_id)
                    if st is not None and not st.finished and not st.stream.failed:
                        self._stage(st, prog)
        except Exception:  # never take the engine down; affected requests fail individually
            self._step = []
            self._fail_all("the kv route's step set-up")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata=None) -> None:
        if not self._step or layer_name not in self._layers:
            return
        t0 = time.perf_counter()
        layer, group, reader = self._layers[layer_name]
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self._device))  # after the layer's write
        with self._on_side():
            for staged in self._step:
                if staged.index:
                    keys, values = reader.read(kv_layer, *staged.index[group])
                    staged.rows[layer, 0, :, staged.at:].copy_(keys.transpose(0, 1))
                    staged.rows[layer, 1, :, staged.at:].copy_(values.transpose(0, 1))
                    staged.layers_read += 1
        for staged in self._step:
            staged.st.stream.ms["capture"] += (time.perf_counter() - t0) * 1e3

    def wait_for_save(self, meta: PdBridgeMetadata | None) -> None:
        if self._step and self._side is not None:
            # The next forward may reuse the blocks the reads copied from (a sliding window's), so
            # it waits for them; not for what follows on the side stream (laying out, quantizing,
            # the copy to the host), which reads only the request's own rows and overlaps vLLM's
            # sampling and next steps.
            read = torch.cuda.Event()
            read.record(self._side)
            torch.cuda.current_stream(self._device).wait_event(read)
        try:
            with self._on_side():
                for staged in self._step:
                    self._emit(staged)
            if meta is not None:
                self._end(meta.finished)
        except Exception:
            self._fail_all("the kv route's step")
        finally:
            self._step = []

    # ---- per request -----------------------------------------------------------------------------

    def _end(self, finished: dict) -> None:
        for req_id in finished:
            self._layouts.pop(req_id, None)
        self._profile.finished(finished)
        super()._end(finished)

    def _admit_kv(self, new) -> None:
        st = self._admit(new)
        if st is None:
            return
        p = st.stream.params
        try:
            if p.route != bridge_pb2.ROUTE_KV or p.spec is None:
                raise SpecError("a vLLM started for the kv route takes only kv route requests with "
                                "the decoder's spec")
            any_reader = next(iter(self._layers.values()))[2]
            self._layouts[new.req_id] = Layout(p.spec, any_reader.heads, any_reader.head_dim, len(self._layers),
                                               self._quantizer)
            self._profile.admit(new.req_id)
        except (SpecError, LayoutError) as e:
            self._fail(st, protocol.BUNDLE_MISMATCH, f"kv route: {e}")

    def _stage(self, st: WorkerState, prog: StepProgress) -> None:
        p = st.params
        B = p.block_tokens
        sent_to = st.next_block * B  # rows before it have left
        have = max(st.captured, sent_to)  # rows [sent_to, have) are in the carry
        if prog.start > have:
            self._fail(st, protocol.LENGTH_MISMATCH,
                       f"positions [{have}, {prog.start}) were not computed by this request "
                       "(prefix-cache hit? run vLLM with --no-enable-prefix-caching)")
            return
        end = min(prog.end, p.end_block * B + p.tail_tokens)
        new = max(0, end - have)
        st.captured = max(st.captured, prog.end)  # a recompute after preemption restarts below it
        layout = self._layouts[prog.req_id]
        index = []
        if new:
            carried = have - sent_to
            rows = torch.empty((len(self._layers), 2, layout.heads, carried + new, layout.head_dim),
                               dtype=layout.dtype, device=self._device)
            if carried:
                rows[:, :, :, :carried].copy_(st.carry)
            st.carry = rows
            index = [self._index(table, g, have, have + new) for g, table in enumerate(prog.block_ids)]
        elif st.carry is None:
            st.carry = torch.empty((len(self._layers), 2, layout.heads, 0, layout.head_dim),
                                   dtype=layout.dtype, device=self._device)
        if new or prog.prompt_done:
            self._step.append(_Staged(st, layout, st.carry, st.carry.shape[3] - new, index, prog))

    def _index(self, table: list[int], group: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel block, offset) of positions [start, end) in `group`'s paged cache, on its device."""
        size, kernel = self._group_block_sizes[group], self._kernel_block_sizes[group]
        pos = torch.arange(start, end)
        within = pos % size
        blocks = torch.tensor(table, dtype=torch.long)[pos // size] * (size // kernel) + within // kernel
        both = torch.stack([blocks, within % kernel])
        if self._device.type == "cuda":
            both = both.pin_memory().to(self._device, non_blocking=True)
        return both[0], both[1]

    def _emit(self, staged: _Staged) -> None:
        """Sends the whole blocks the request's rows now complete; at the prompt's end its tail and
        `done`. What is left is the next step's carry."""
        st, prog = staged.st, staged.prog
        p, B = st.params, st.params.block_tokens
        if staged.index and staged.layers_read != len(self._layers):
            # A forward that skipped the connector (a replayed full CUDA graph): never ship rows
            # that were not read.
            self._fail(st, protocol.CAPTURE_MISSING, f"positions [{prog.start}, {prog.end}) were computed, but "
                       f"{staged.layers_read} of {len(self._layers)} layers' K/V reached the connector")
            return
        t0 = time.perf_counter()
        count = min(p.end_block - st.next_block, st.carry.shape[3] // B)
        if count > 0:
            self._send(st, st.next_block, staged.layout, st.carry[:, :, :, :count * B], count)
            st.next_block += count
            st.carry = st.carry[:, :, :, count * B:]
        st.stream.ms["capture"] += (time.perf_counter() - t0) * 1e3
        if not prog.prompt_done:
            return
        if st.captured != st.prompt_len:
            self._fail(st, protocol.LENGTH_MISMATCH, f"computed {st.captured} tokens, the prompt has {st.prompt_len}")
            return
        if p.tail_tokens:
            self._send(st, p.end_block, staged.layout, st.carry[:, :, :, :p.tail_tokens], 1, tail=True)
        self._streamer.submit_done(st.stream, st.captured)
        st.finished, st.carry = True, None
        self._layouts.pop(prog.req_id, None)

    def _send(self, st: WorkerState, first: int, layout: Layout, rows: torch.Tensor, count: int,
              tail: bool = False) -> None:
        headers, block_bytes = layout.headers(rows.shape[3] // count)
        payload = layout.lay_out(rows, count, block_bytes)
        # Every block into the ring: on a GPU one asynchronous copy, whose event the streamer waits
        # for; prefilld then reads them where they are.
        host, slot = self._in_ring(st, payload.shape)
        host.copy_(payload, non_blocking=self._side is not None)
        event = None
        if self._side is not None:
            event = torch.cuda.Event()
            event.record(self._side)
        self._streamer.submit_laid_out(st.stream, first, headers, host, event, tail, slot)

    def _in_ring(self, st: WorkerState, shape: torch.Size) -> tuple[torch.Tensor, Slot | None]:
        """Room for a payload in the ring (waiting while it is full: backpressure, the request's
        `ring_wait`), and its slot."""
        taken = self._ring.take(shape.numel())
        if taken is None:
            logger.warning("pdbridge: a step's %d MB of blocks exceed the ring (max_queued_mb %d): "
                           "sent through the socket from memory of their own, which stalls the step",
                           shape.numel() >> 20, self._ring.size >> 20)
            return torch.empty(shape, dtype=torch.uint8, pin_memory=self._side is not None), None
        slot, flat, waited_s = taken
        st.stream.ms["ring_wait"] += waited_s * 1e3
        return flat.view(shape), slot

    def _on_side(self):
        return torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()
