"""The connector's scheduler side (in vLLM's engine core): which tokens of each bridged request a
step computes, with the request's block tables, for the worker side (`metadata.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .metadata import PARAMS_KEY, NewBridgeRequest, PdBridgeMetadata, StepProgress, bridge_params

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class _Request:
    prompt_len: int
    block_ids: list[list[int]]  # per KV cache group
    prompt_done: bool = False


class BridgeScheduler:
    """Store-only: never loads external tokens, never delays freeing a request's blocks (the
    worker copies what it needs out during the step that computes it)."""

    def __init__(self):
        self._requests: dict[str, _Request] = {}
        self._finished: dict[str, Any] = {}

    def build_meta(self, scheduler_output: SchedulerOutput) -> PdBridgeMetadata:
        meta = PdBridgeMetadata(finished=self._finished)
        self._finished = {}
        start_of: dict[str, int] = {}

        for new in scheduler_output.scheduled_new_reqs:
            extra_args = new.sampling_params.extra_args if new.sampling_params else None
            raw = bridge_params((extra_args or {}).get("kv_transfer_params"))
            if raw is None:
                continue
            self._requests[new.req_id] = _Request(new.prompt_len, [list(ids) for ids in new.block_ids])
            meta.new_requests.append(NewBridgeRequest(new.req_id, raw, new.prompt_len))
            start_of[new.req_id] = new.num_computed_tokens

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._requests.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:  # resumed requests get a fresh table, others an extension
                if req_id in cached.resumed_req_ids:
                    st.block_ids = [list(ids) for ids in new_ids]
                else:
                    for table, ids in zip(st.block_ids, new_ids):
                        table.extend(ids)
            start_of[req_id] = cached.num_computed_tokens[i]

        block_state = scheduler_output.kv_connector_block_state
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            st = self._requests.get(req_id)
            if st is None or st.prompt_done or req_id not in start_of:
                continue
            if block_state is not None and (ids := block_state.get_block_ids(req_id)) is not None:
                st.block_ids = [list(group) for group in ids]  # the authoritative tables, when offered
            start = start_of[req_id]
            st.prompt_done = start + n >= st.prompt_len
            meta.progress.append(StepProgress(req_id, [list(t) for t in st.block_ids], start, start + n,
                                              st.prompt_done))
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        raw = bridge_params(request.kv_transfer_params)
        st = self._requests.pop(request.request_id, None)
        if raw is None:
            return False, None  # plain vLLM request
        self._finished[request.request_id] = raw
        rid = raw.get("request_id") if isinstance(raw, dict) else None
        return False, {PARAMS_KEY: {"request_id": rid, "prompt_tokens": request.num_prompt_tokens,
                                    "prefill_complete": bool(st and st.prompt_done)}}
