"""The reconstruct route's worker side: captured layer inputs out of vLLM, to the streamer.

Each step, ``save_kv_layer`` records the step's slot mapping (of the drafter's hidden-states layer,
or on the stage route of a layer in the request's KV group): the proof that the step's tokens were
captured, and on the stage route which of the forward's rows is which request's position. Then
``wait_for_save`` (after the target and draft forwards, metadata bound) checks the step's tokens
were captured and, for every block ``b`` in ``[from_block, first_block + num_blocks)`` whose
``block_tokens`` tokens are now all captured (``from_block``: ``first_block``, or 0 when the
decoder keeps a recurrent state, which the blocks before ``first_block`` only advance), copies
their hidden states out of the paged cache (the stage route: out of the rows it kept from each
step) and queues them to the streamer thread (`streamer.py`), which computes the decoder's cache
with the decoder's own mlx-lm modules (`reconstruct.py`) — or, for a decoder that computes its own
(``payload: layer_inputs``), casts them to its activation dtype — and writes the block to
prefilld's unix socket. So blocks leave per engine step, as chunked prefill completes them. The
step whose metadata says the prompt is complete ends the stream: the captured length must equal
the prompt length, then ``done`` (or ``error``) follows the last block. A request the engine
finishes before that (abort, preemption limits) gets ``error/aborted``. No timers.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

import torch

from . import models, protocol, spans
from .link import RemoteLink
from .metadata import NewBridgeRequest, PdBridgeMetadata, StepProgress
from .streamer import Streamer
from .worker import BridgeWorker, WorkerState

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("vllm.pdbridge_vllm")


class CaptureWorker(BridgeWorker):
    """The reconstruct route's worker: captured hidden states per finished block to the streamer."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cache_group: int,
                 block_size: int, blocks_per_call: int, streamer_args: dict):
        super().__init__(streamer_args)
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._cache_kv_group_id = cache_group  # whose block table (and slot mapping) locates positions
        self._block_size = block_size
        self._blocks_per_call = blocks_per_call
        self._kv_cache: torch.Tensor | None = None  # the drafter route's hidden-states cache
        self._step_slots: torch.Tensor | None = None
        self._slot_layers: set[str] = set()  # layers whose slot mapping is the step's
        self._recorder = None  # the stage route's model (`models.Recorder`)
        self._step_inputs: list[torch.Tensor] | None = None  # its inputs of this step's forward
        self._has_work = lambda: False  # whether the step has bridge work (the connector's answer)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], has_work) -> None:
        # Tensor-parallel rank 0 emits; every rank holds the same hidden states.
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._has_work = has_work
        self._is_tp_rank_zero = get_tensor_model_parallel_rank() == 0
        stage = None
        if models.stage_route(self._vllm_config):
            capture_ids, stage = self._record_stage(kv_caches, has_work)
        elif self._vllm_config.speculative_config is not None:
            capture_ids = self._register_drafter_cache(kv_caches)
        else:
            raise RuntimeError(
                "pdbridge: the connector captures with the extract_hidden_states drafter "
                "(--speculative-config) or, under pipeline parallelism, on the stage route "
                f"(--additional-config '{json.dumps(models.STAGE_ROUTE)}'); this engine has neither")
        if self._is_tp_rank_zero:
            # On another box of prefilld's [engine.nodes], over TLS to its stage listener.
            self._streamer = Streamer(capture_ids, stage=stage, link=RemoteLink.from_env(), **self._streamer_args)

    def _register_drafter_cache(self, kv_caches: dict[str, torch.Tensor]) -> list[int]:
        """The drafter route: its hidden-states layer's paged cache. Returns the captured ids."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise RuntimeError(f"pdbridge: expected the drafter's one hidden-states layer, found {layers}")
        self._kv_cache = kv_caches[layers[0]]
        if self._kv_cache.shape[2] != self._block_size:
            raise RuntimeError(f"pdbridge: hidden-states block size {self._kv_cache.shape[2]} != "
                               f"its group's {self._block_size}")
        self._slot_layers = set(layers)
        draft_hf = self._vllm_config.speculative_config.draft_model_config.hf_config
        return list(draft_hf.eagle_aux_hidden_state_layer_ids)

    def _record_stage(self, kv_caches: dict[str, torch.Tensor], has_work) -> tuple[list[int], tuple[int, int]]:
        """The stage route: this pipeline stage's layers' inputs, from its model. Returns their ids
        and the stage (index, count)."""
        from vllm.distributed.parallel_state import get_pp_group

        recorder = models.recorder()
        if recorder is None or not recorder.captured_layers:
            arch = self._vllm_config.model_config.architectures
            raise RuntimeError(
                f"pdbridge: without the capture drafter (pipeline parallelism) each stage takes its "
                f"layers' inputs from the model, which {arch} cannot give; classes that can: "
                f"{sorted(models.STAGED)}")
        layers = list(recorder.captured_layers)
        if self._is_tp_rank_zero:
            recorder.want_stage_inputs(has_work)
        self._recorder = recorder
        group = self._kv_cache_config.kv_cache_groups[self._cache_kv_group_id]
        self._slot_layers = set(group.layer_names) & set(kv_caches)
        pp = get_pp_group()
        logger.info("pdbridge: pipeline stage %d of %d captures layers %s", pp.rank_in_group,
                    pp.world_size, layers)
        return layers, (pp.rank_in_group, pp.world_size)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        # Called after every attention layer; one layer's slot mapping is the step's (the
        # drafter's hidden-states layer: what was just written into its cache).
        if self._step_slots is None and layer_name in self._slot_layers and self._has_work():
            slots = getattr(attn_metadata, "slot_mapping", None)
            if slots is not None:
                self._step_slots = slots.clone()

    def wait_for_save(self, meta: PdBridgeMetadata | None) -> None:
        try:
            if self._is_tp_rank_zero and meta is not None:
                if self._recorder is not None:
                    self._step_inputs = self._recorder.take_stage_inputs()
                self._process_step(meta)
        except Exception:  # never take the engine down; affected requests fail individually
            self._fail_all("step processing")
        finally:
            self._step_slots = None
            self._step_inputs = None

    def _process_step(self, meta: PdBridgeMetadata) -> None:
        for new in meta.new_requests:
            self._register(new)
        for prog in meta.progress:
            st = self._reqs.get(prog.req_id)
            if st is not None and not st.finished:
                self._advance(st, prog)
        self._end(meta.finished)

    def _register(self, new: NewBridgeRequest) -> None:
        st = self._admit(new)
        if st is not None:
            self._streamer.submit_start(st.stream)  # loads the bundle before any prefill work

    def _advance(self, st: WorkerState, prog: StepProgress) -> None:
        if st.stream.failed:
            st.finished = True
            return
        st.block_ids = prog.block_ids[self._cache_kv_group_id]
        t0 = time.perf_counter()
        if prog.start > st.captured:
            # Skipped positions were never computed here, so never captured (e.g. a prefix-cache
            # hit): refuse rather than ship states this request did not produce.
            self._fail(st, protocol.LENGTH_MISMATCH,
                       f"positions [{st.captured}, {prog.start}) were not computed by this request "
                       "(prefix-cache hit? run vLLM with --no-enable-prefix-caching)")
            return
        if prog.end > prog.start:
            if not self._was_captured(st, prog.start, prog.end):
                self._fail(st, protocol.CAPTURE_MISSING,
                           f"positions [{prog.start}, {prog.end}) were computed but their hidden "
                           "states were not captured this step")
                return
            # max(): a recompute after preemption restarts at 0 over already-verified positions.
            st.captured = max(st.captured, min(prog.end, st.prompt_len))

        # The blocks this step completed leave together, up to `blocks_per_call`: the streamer
        # reconstructs them in one call where the cache allows (a GPU's rate is set by tokens per call).
        B = st.params.block_tokens
        while st.next_block < st.params.end_block and (st.next_block + 1) * B <= st.captured:
            count = min(self._blocks_per_call, st.params.end_block - st.next_block,
                        st.captured // B - st.next_block)
            with spans.span(st.stream.trace, "capture", block=st.next_block, blocks=count):
                hidden = self._gather(st, st.next_block * B, (st.next_block + count) * B)
            st.stream.ms["capture"] += (time.perf_counter() - t0) * 1e3
            self._streamer.submit_blocks(st.stream, st.next_block, hidden)  # may wait: backpressure
            st.next_block += count
            t0 = time.perf_counter()
        st.stream.ms["capture"] += (time.perf_counter() - t0) * 1e3

        if prog.prompt_done:
            if st.captured != st.prompt_len:
                self._fail(st, protocol.LENGTH_MISMATCH,
                           f"captured {st.captured} tokens, the prompt has {st.prompt_len}")
            elif st.next_block != st.params.end_block:  # unreachable given _register's check
                self._fail(st, protocol.INTERNAL, f"emitted up to block {st.next_block} only")
            else:
                if st.params.tail_tokens:
                    start = st.params.end_block * B
                    tail = self._gather(st, start, start + st.params.tail_tokens)
                    self._streamer.submit_blocks(st.stream, st.params.end_block, tail, tail=True)
                self._streamer.submit_done(st.stream, st.captured)
                st.finished = True

    def _slots(self, st: WorkerState, start: int, end: int) -> torch.Tensor:
        bs = self._block_size
        pos = torch.arange(start, end, dtype=torch.long)
        table = torch.tensor(st.block_ids, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def _was_captured(self, st: WorkerState, start: int, end: int) -> bool:
        """Whether this step captured positions [start, end); the stage route keeps the new ones."""
        if self._step_slots is None:
            return False
        written = self._step_slots.to(device="cpu", dtype=torch.long)
        wanted = self._slots(st, start, end)
        if self._recorder is None:  # the drafter wrote them into its paged cache
            return bool(torch.isin(wanted, written).all())
        if not self._step_inputs or not len(written):
            return False
        # The forward's row of each wanted slot (slots are unique within a step).
        order = torch.argsort(written)
        rows = order[torch.searchsorted(written[order], wanted).clamp(max=len(written) - 1)]
        if not bool((written[rows] == wanted).all()):
            return False
        keep = max(start, st.captured, st.next_block * st.params.block_tokens) - start
        if keep < len(rows):
            st.held.append(torch.stack([x[rows[keep:]] for x in self._step_inputs], dim=1).to("cpu"))
        return True

    def _gather(self, st: WorkerState, start: int, end: int) -> torch.Tensor:
        """Positions [start, end): [T, n_captured, hidden] in the engine's dtype, copied out of the
        paged hidden-states cache on its device (so vLLM may free or reuse the blocks right after;
        the streamer moves the copy into MLX) or, on the stage route, taken from the rows held on
        the host since their steps."""
        if self._recorder is not None:
            held = torch.cat(st.held) if len(st.held) > 1 else st.held[0]
            n = end - start  # `held` starts at `start`: blocks leave in order
            st.held = [held[n:].clone()] if n < len(held) else []
            return held[:n]
        slots = self._slots(st, start, end).to(self._kv_cache.device)
        bs = self._block_size
        return self._kv_cache[slots // bs, :, slots % bs]  # advanced indexing copies, on the cache's device
