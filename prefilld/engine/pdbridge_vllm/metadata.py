"""What the connector's scheduler side (`scheduler.py`) tells its worker side each step: vLLM's
``KVConnectorMetadata``, built in the engine core and bound in the worker before the forward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

PARAMS_KEY = "pdbridge"


def bridge_params(kv_transfer_params: Any) -> Any:
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
    block_ids: list[list[int]]  # the request's whole block table, per KV cache group
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

    def has_work(self) -> bool:
        return bool(self.new_requests or self.progress or self.finished)
