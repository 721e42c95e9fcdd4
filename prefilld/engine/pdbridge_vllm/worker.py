"""What both routes' worker sides share: the bridged requests the worker knows, their streams to
prefilld (`streamer.py`), and how a request is admitted, failed and ended."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from . import protocol
from .metadata import NewBridgeRequest
from .streamer import BridgeParams, RequestStream, Streamer

logger = logging.getLogger("vllm.pdbridge_vllm")


@dataclass
class WorkerState:
    stream: RequestStream
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    captured: int = 0  # positions [0, captured) verified as captured
    next_block: int = 0
    finished: bool = False  # done or error queued; nothing more to do
    # The stage route: captured positions [next_block * block_tokens, captured), [T, layers, hidden]
    # pieces in order (nothing else keeps them after their step).
    held: list[torch.Tensor] = field(default_factory=list)
    # The kv route: the decoder's rows of positions [next_block * block_tokens, captured) not sent
    # yet, [layers, 2, heads, rows, head_dim] on vLLM's device.
    carry: torch.Tensor | None = None

    @property
    def params(self) -> BridgeParams:
        return self.stream.params


class BridgeWorker:
    """A route's worker side: `_admit` new requests, `_fail` them, `_end` those the engine
    finished. Nothing raises into vLLM's step loop for a per-request problem: it becomes that
    request's ``error`` message. Tensor-parallel rank 0 alone emits."""

    def __init__(self, streamer_args: dict):
        self._streamer_args = streamer_args
        self._is_tp_rank_zero = True
        self._reqs: dict[str, WorkerState] = {}
        self._streamer: Streamer | None = None

    def begin_step(self, meta) -> None:
        """The step's metadata is bound, before its forward (`meta`: None without bridge work)."""

    def shutdown(self):
        if self._streamer is not None:
            self._streamer.close()

    def _admit(self, new: NewBridgeRequest) -> WorkerState | None:
        """The request's state, or None when its parameters are refused (told on its socket when
        they name one) or its prompt is too short for them (told, and kept: it still ends)."""
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
            return None
        st = WorkerState(RequestStream(params), prompt_len=new.prompt_len, next_block=params.from_block)
        self._reqs[new.req_id] = st
        needed = params.end_block * params.block_tokens + params.tail_tokens
        if needed > new.prompt_len:
            self._fail(st, protocol.PROMPT_TOO_SHORT,
                       f"blocks [{params.first_block}, {params.end_block}) of {params.block_tokens} "
                       f"tokens and a tail of {params.tail_tokens} need {needed} tokens; the prompt "
                       f"has {new.prompt_len}")
            return None
        return st

    def _end(self, finished: dict[str, Any]) -> None:
        """Requests the engine finished: one whose prefill did not complete gets ``aborted``."""
        for req_id, raw in finished.items():
            st = self._reqs.pop(req_id, None)
            if st is None:  # finished before its first step: still owed an answer
                try:
                    st = WorkerState(RequestStream(BridgeParams.parse(raw)), prompt_len=0)
                except ValueError:
                    continue  # no usable socket to tell
            if not st.finished:
                self._fail(st, protocol.ABORTED,
                           f"the engine finished the request after {st.captured} captured tokens, "
                           "before its prefill completed")

    def _fail(self, st: WorkerState, failure: int, message: str) -> None:
        st.finished = True
        self._streamer.submit_error(st.stream, failure, message)

    def _fail_all(self, what: str) -> None:
        logger.exception("pdbridge: %s failed", what)
        for st in list(self._reqs.values()):
            if not st.finished:
                self._fail(st, protocol.INTERNAL, f"{what} raised; see engine log")
