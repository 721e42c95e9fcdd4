"""`PdBridgeConnector`: vLLM v1 KV connector that turns captured hidden states into the decoder's cache.

Load it with ``--kv-transfer-config '{"kv_connector": "PdBridgeConnector", "kv_connector_module_path":
"pdbridge_vllm.connector", "kv_role": "kv_producer"}'`` together with the ``extract_hidden_states``
speculative method capturing ids 0..L-1 (id i = the residual stream entering layer i): the drafter
route. Under pipeline parallelism vLLM is started without the drafter (its V1 runner cannot run one
there; ``--additional-config '{"pdbridge_capture": "stages"}'`` says so) and each stage's connector
takes its own layers' inputs from its model (`models.py`): the stage route, in which every stage
sends its layers' part of each block on its own connection and prefilld assembles the block.

Flow, per request that carries ``kv_transfer_params.pdbridge`` (all other requests: plain vLLM):

1. Scheduler side (engine core), every step, ``build_connector_meta``: for each pdbridge request
   scheduled in the step, the token range the step computes ``[start, end)``, the request's block
   table in the hidden-states KV group, and whether the step completes the prompt. New requests
   also carry their params and prompt length. When the engine finishes a request
   (``request_finished``), the next step's metadata says so.
2. Worker side, during the step: ``save_kv_layer`` records the step's slot mapping (of the drafter's
   hidden-states layer, or on the stage route of a layer in the request's KV group): the proof
   that the step's tokens were captured, and on the stage route which of the forward's rows is
   which request's position.
3. Worker side, ``wait_for_save`` (after the target and draft forwards, metadata bound): checks the
   step's tokens were captured, then, for every block ``b`` in ``[from_block, first_block +
   num_blocks)`` whose ``block_tokens`` tokens are now all captured (``from_block``: ``first_block``,
   or 0 when the decoder keeps a recurrent state, which the blocks before ``first_block`` only
   advance), copies their hidden states out of the paged cache (the stage route: out of the rows
   it kept from each step) and queues them to the streamer thread (`streamer.py`), which computes
   the decoder's cache with the decoder's own mlx-lm modules (`reconstruct.py`) — or, for a decoder
   that computes its own (``payload: layer_inputs``), casts them to its activation dtype — and
   writes the block to prefilld's unix socket. So
   blocks leave per engine step, as chunked prefill completes them.
4. The step whose metadata says the prompt is complete ends the stream: the captured length must
   equal the prompt length, then ``done`` (or ``error``) follows the last block. A request the
   engine finishes before that (abort, preemption limits) gets ``error/aborted``. No timers.

The socket framing is in `protocol.py`. Nothing here raises into vLLM's step loop for a per-request
problem; it becomes that request's ``error`` message.

Extra config (``kv_connector_extra_config``): ``max_queued_mb`` (256; captured hidden states copied
out and waiting for MLX/socket — past it the step loop waits), ``socket_timeout_s`` (60), ``streamer_cpus`` ("all", a
comma list, or null to leave the thread's affinity alone), ``mlx_streams`` (2; MLX streams —
on CPU, threads — that reconstruct layers in parallel; the result is bit-identical for any count),
``blocks_per_call`` (8; whole blocks a step completes that are reconstructed in one call, where the
cache keeps a row per token: bit-identical to one call per block on the CPU, and what a GPU's rate
depends on), ``dense_weights`` (false; dequantize the decoder's weights once — for a GPU, where the
cache cannot be the decoder's bits anyway; see `reconstruct.load`). prefilld passes its
``[engine.plugin]`` table here. ``handoff`` ("auto"; how states reach MLX and blocks leave it:
"host", or "device" — on a CUDA GPU shared with MLX's CUDA backend, copied on the GPU; "auto" takes
"device" where its probe passes, see `handoff.py`), ``max_sending_mb`` (256; finished blocks
waiting for the socket — past it reconstruction waits).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from . import models, protocol, spans
from .link import RemoteLink
from .streamer import BridgeParams, RequestStream, Streamer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.pdbridge_vllm")

PARAMS_KEY = "pdbridge"


def _bridge_params(kv_transfer_params: Any) -> Any:
    """The raw ``pdbridge`` entry of a request's kv_transfer_params, or None (inert request)."""
    if isinstance(kv_transfer_params, dict):
        return kv_transfer_params.get(PARAMS_KEY)
    return None


@dataclass
class NewBridgeRequest:
    req_id: str
    raw_params: Any  # validated on the worker, which can report errors on the request's socket
    prompt_len: int


@dataclass
class StepProgress:
    req_id: str
    block_ids: list[int]  # the request's whole block table in the hidden-states group
    start: int  # first position computed this step
    end: int  # positions [start, end) are computed (and captured) this step
    prompt_done: bool  # this step computes the prompt's last token


@dataclass
class PdBridgeMetadata(KVConnectorMetadata):
    new_requests: list[NewBridgeRequest] = field(default_factory=list)
    progress: list[StepProgress] = field(default_factory=list)
    # Requests the engine finished since the last step: req_id -> raw params (for requests the
    # worker never saw, e.g. aborted while waiting).
    finished: dict[str, Any] = field(default_factory=dict)


@dataclass
class _SchedState:
    prompt_len: int
    block_ids: list[int]
    prompt_done: bool = False


@dataclass
class _WorkerState:
    stream: RequestStream
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    captured: int = 0  # positions [0, captured) verified as captured
    next_block: int = 0
    finished: bool = False  # done or error queued; nothing more to do
    # The stage route: captured positions [next_block * block_tokens, captured), [T, layers, hidden]
    # pieces in order (nothing else keeps them after their step).
    held: list[torch.Tensor] = field(default_factory=list)

    @property
    def params(self) -> BridgeParams:
        return self.stream.params


class PdBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only: never loads external tokens, never delays freeing a request's blocks."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # The KV group whose block table (and slot mapping) locates a request's positions.
        self._cache_kv_group_id = self._find_cache_kv_group_id(kv_cache_config)
        self._block_size = (kv_cache_config.kv_cache_groups[self._cache_kv_group_id].kv_cache_spec.block_size
                            if kv_cache_config is not None else vllm_config.cache_config.block_size)
        self._is_tp_rank_zero = True
        self._kv_cache: torch.Tensor | None = None  # the drafter route's hidden-states cache
        extra = self._kv_transfer_config.get_from_extra_config
        self._blocks_per_call = max(1, int(extra("blocks_per_call", 8)))
        # Scheduler side.
        self._sched: dict[str, _SchedState] = {}
        self._finished: dict[str, Any] = {}
        # Worker side. The streamer starts once the captured layers are known (register_kv_caches).
        self._reqs: dict[str, _WorkerState] = {}
        self._step_slots: torch.Tensor | None = None
        self._slot_layers: set[str] = set()  # layers whose slot mapping is the step's
        self._recorder = None  # the stage route's model (`models.Recorder`)
        self._step_inputs: list[torch.Tensor] | None = None  # its inputs of this step's forward
        self._streamer: Streamer | None = None
        self._streamer_args = dict(max_queued_mb=float(extra("max_queued_mb", 256)),
                                   socket_timeout_s=float(extra("socket_timeout_s", 60.0)),
                                   cpus=extra("streamer_cpus", "all"),
                                   mlx_streams=int(extra("mlx_streams", 2)),
                                   dense_weights=bool(extra("dense_weights", False)),
                                   handoff=str(extra("handoff", "auto")),
                                   max_sending_mb=float(extra("max_sending_mb", 256)))

    @staticmethod
    def _find_cache_kv_group_id(kv_cache_config: KVCacheConfig | None) -> int:
        """The drafter route: its hidden-states group. The stage route: a full-attention group,
        whose block table holds every position of a request (a sliding window's frees them)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, HiddenStateCacheSpec

        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        for kind in (HiddenStateCacheSpec, FullAttentionSpec):
            found = [gid for gid, g in enumerate(groups) if type(g.kv_cache_spec) is kind]
            if found:
                return found[0]
        if len(groups) <= 1:
            return 0
        raise ValueError("pdbridge: no hidden-states or full-attention KV cache group to map a "
                         "step's rows to requests")

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # The drafter's hidden-states cache keeps a token's states together (vLLM's layout for it).
        return None if models.stage_route(vllm_config) else "LBNHC"

    # ============================== scheduler side ==============================

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PdBridgeMetadata(finished=self._finished)
        self._finished = {}
        gid = self._cache_kv_group_id
        start_of: dict[str, int] = {}

        for new in scheduler_output.scheduled_new_reqs:
            extra_args = new.sampling_params.extra_args if new.sampling_params else None
            raw = _bridge_params((extra_args or {}).get("kv_transfer_params"))
            if raw is None:
                continue
            self._sched[new.req_id] = _SchedState(new.prompt_len, list(new.block_ids[gid]))
            meta.new_requests.append(NewBridgeRequest(new.req_id, raw, new.prompt_len))
            start_of[new.req_id] = new.num_computed_tokens

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._sched.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:  # resumed requests get a fresh table, others an extension
                if req_id in cached.resumed_req_ids:
                    st.block_ids = list(new_ids[gid])
                else:
                    st.block_ids.extend(new_ids[gid])
            start_of[req_id] = cached.num_computed_tokens[i]

        block_state = scheduler_output.kv_connector_block_state
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            st = self._sched.get(req_id)
            if st is None or st.prompt_done or req_id not in start_of:
                continue
            if block_state is not None and (ids := block_state.get_block_ids(req_id)) is not None:
                st.block_ids = list(ids[gid])  # the authoritative table, when the engine offers it
            start = start_of[req_id]
            st.prompt_done = start + n >= st.prompt_len
            meta.progress.append(StepProgress(req_id, list(st.block_ids), start, start + n,
                                              st.prompt_done))
        return meta

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False  # store-only: never loads external tokens

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int):
        pass

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])  # block tables are not needed after a request

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        raw = _bridge_params(request.kv_transfer_params)
        st = self._sched.pop(request.request_id, None)
        if raw is None:
            return False, None  # plain vLLM request
        # The worker copies hidden states out during the step that computes them, so blocks are
        # never needed after this point: free them now.
        self._finished[request.request_id] = raw
        rid = raw.get("request_id") if isinstance(raw, dict) else None
        return False, {PARAMS_KEY: {"request_id": rid, "prompt_tokens": request.num_prompt_tokens,
                                    "prefill_complete": bool(st and st.prompt_done)}}

    # ============================== worker side ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Tensor-parallel rank 0 emits; every rank holds the same hidden states.
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._is_tp_rank_zero = get_tensor_model_parallel_rank() == 0
        stage = None
        if models.stage_route(self._vllm_config):
            capture_ids, stage = self._record_stage(kv_caches)
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

    def _record_stage(self, kv_caches: dict[str, torch.Tensor]) -> tuple[list[int], tuple[int, int]]:
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
            recorder.want_stage_inputs(self._has_bridge_work)
        self._recorder = recorder
        group = self._kv_cache_config.kv_cache_groups[self._cache_kv_group_id]
        self._slot_layers = set(group.layer_names) & set(kv_caches)
        pp = get_pp_group()
        logger.info("pdbridge: pipeline stage %d of %d captures layers %s", pp.rank_in_group,
                    pp.world_size, layers)
        return layers, (pp.rank_in_group, pp.world_size)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        # Called after every attention layer; one layer's slot mapping is the step's (the
        # drafter's hidden-states layer: what was just written into its cache).
        if self._step_slots is None and layer_name in self._slot_layers and self._has_bridge_work():
            slots = getattr(attn_metadata, "slot_mapping", None)
            if slots is not None:
                self._step_slots = slots.clone()

    def wait_for_save(self) -> None:
        try:
            if self._is_tp_rank_zero and self._has_bridge_work():
                if self._recorder is not None:
                    self._step_inputs = self._recorder.take_stage_inputs()
                self._process_step(self._get_connector_metadata())
        except Exception:  # never take the engine down; affected requests fail individually
            logger.exception("pdbridge: step processing failed")
            for st in list(self._reqs.values()):
                if not st.finished:
                    self._fail(st, protocol.INTERNAL, "step processing raised; see engine log")
        finally:
            self._step_slots = None
            self._step_inputs = None

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # nothing is ever sent asynchronously after a request finishes

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def shutdown(self):
        if self._streamer is not None:
            self._streamer.close()

    def _has_bridge_work(self) -> bool:
        if not self.has_connector_metadata():
            return False
        meta = self._get_connector_metadata()
        return isinstance(meta, PdBridgeMetadata) and bool(
            meta.new_requests or meta.progress or meta.finished)

    def _process_step(self, meta: PdBridgeMetadata) -> None:
        for new in meta.new_requests:
            self._register(new)
        for prog in meta.progress:
            st = self._reqs.get(prog.req_id)
            if st is not None and not st.finished:
                self._advance(st, prog)
        for req_id, raw in meta.finished.items():
            st = self._reqs.pop(req_id, None)
            if st is None:  # finished before its first step: still owed an answer
                try:
                    st = _WorkerState(RequestStream(BridgeParams.parse(raw)), prompt_len=0)
                except ValueError:
                    continue  # no usable socket to tell
            if not st.finished:
                self._fail(st, protocol.ABORTED,
                           f"the engine finished the request after {st.captured} captured tokens, "
                           "before its prefill completed")

    def _register(self, new: NewBridgeRequest) -> None:
        try:
            params = BridgeParams.parse(new.raw_params)
        except ValueError as e:
            logger.warning("pdbridge: request %s: %s", new.req_id, e)
            sock = new.raw_params.get("socket") if isinstance(new.raw_params, dict) else None
            if isinstance(sock, str):  # report it if there is anywhere to report it
                rid = str(new.raw_params.get("request_id", new.req_id))
                bad = BridgeParams(rid, sock, bundle_path="", bundle_sha256="", block_tokens=1,
                                   first_block=0, num_blocks=0)
                self._streamer.submit_error(RequestStream(bad), protocol.BAD_PARAMS, str(e))
            return
        st = _WorkerState(RequestStream(params), prompt_len=new.prompt_len,
                          next_block=params.from_block)
        self._reqs[new.req_id] = st
        needed = params.end_block * params.block_tokens + params.tail_tokens
        if needed > new.prompt_len:
            self._fail(st, protocol.PROMPT_TOO_SHORT,
                       f"blocks [{params.first_block}, {params.end_block}) of {params.block_tokens} "
                       f"tokens and a tail of {params.tail_tokens} need {needed} tokens; the prompt "
                       f"has {new.prompt_len}")
            return
        self._streamer.submit_start(st.stream)

    def _advance(self, st: _WorkerState, prog: StepProgress) -> None:
        if st.stream.failed:
            st.finished = True
            return
        st.block_ids = prog.block_ids
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

    def _slots(self, st: _WorkerState, start: int, end: int) -> torch.Tensor:
        bs = self._block_size
        pos = torch.arange(start, end, dtype=torch.long)
        table = torch.tensor(st.block_ids, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def _was_captured(self, st: _WorkerState, start: int, end: int) -> bool:
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

    def _gather(self, st: _WorkerState, start: int, end: int) -> torch.Tensor:
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

    def _fail(self, st: _WorkerState, failure: int, message: str) -> None:
        st.finished = True
        self._streamer.submit_error(st.stream, failure, message)
