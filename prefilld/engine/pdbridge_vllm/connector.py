"""`PdBridgeConnector`: the vLLM v1 KV connector that makes the decoder's cache during vLLM's prefill.

Load it with ``--kv-transfer-config '{"kv_connector": "PdBridgeConnector", "kv_connector_module_path":
"pdbridge_vllm.connector", "kv_role": "kv_producer", "kv_connector_extra_config": {...}}'``. A thin
facade, as vLLM's own connectors are shaped: it asserts its role and delegates to the scheduler side
(`scheduler.py`, in the engine core) or to the worker side of its route, with what they share in
`metadata.py`. The route (``route`` in the extra config, prefilld's ``engine.route``) is fixed
when vLLM starts:

* ``reconstruct`` (`capture_worker.py`): vLLM runs the ``extract_hidden_states`` drafter capturing
  the residual stream entering every layer (or, under pipeline parallelism, each stage's model gives
  its own layers' inputs, ``--additional-config '{"pdbridge_capture": "stages"}'``); the streamer
  computes the decoder's cache from them with the decoder's own mlx-lm modules.
* ``kv`` (`kv_worker.py`): no capture; each layer's new K/V rows of a bridged request are read out
  of vLLM's paged cache right after the layer writes them, laid out (and quantized) as the
  decoder's cache, and copied to pinned host memory. No MLX on the prefill box.

Every request that carries ``kv_transfer_params.pdbridge`` is bridged; all others are plain vLLM.
Blocks leave per engine step, as chunked prefill completes them; the step that completes the prompt
ends the request's stream (``done``, or ``error``); one the engine finishes earlier gets
``error/aborted``. No timers. The socket framing is in `protocol.py`.

Extra config (``kv_connector_extra_config``; prefilld passes its ``[engine.plugin]`` table):
``route`` ("reconstruct"), ``max_queued_mb`` (256, the kv route's 8192: work copied out of the step
loop and waiting for the streamer — past it the step loop waits), ``socket_timeout_s`` (60), ``streamer_cpus``
("all", a comma list, or null to leave the thread's affinity alone), ``max_sending_mb`` (256;
finished blocks waiting for the socket). The reconstruct route's: ``mlx_streams`` (2; MLX streams
— on CPU, threads — that reconstruct layers in parallel; bit-identical for any count),
``blocks_per_call`` (8; whole blocks a step completes that are reconstructed in one call, where the
cache keeps a row per token: bit-identical to one call per block on the CPU, and what a GPU's rate
depends on), ``dense_weights`` (false; dequantize the decoder's weights once, for a GPU, see
`reconstruct.load`), ``handoff`` ("auto"; how states reach MLX: "host", or "device" on a CUDA GPU
shared with MLX's CUDA backend, see `handoff.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from . import models
from .capture_worker import CaptureWorker
from .kv_worker import KvWorker
from .metadata import PdBridgeMetadata
from .scheduler import BridgeScheduler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

RECONSTRUCT, KV = "reconstruct", "kv"


def route_of(vllm_config: VllmConfig) -> str:
    route = vllm_config.kv_transfer_config.get_from_extra_config("route", RECONSTRUCT)
    if route not in (RECONSTRUCT, KV):
        raise ValueError(f"pdbridge: route {route!r} is neither {RECONSTRUCT!r} nor {KV!r}")
    return route


class PdBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only: never loads external tokens, never delays freeing a request's blocks."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._scheduler: BridgeScheduler | None = None
        self._worker: CaptureWorker | KvWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = BridgeScheduler()
            return
        extra = self._kv_transfer_config.get_from_extra_config
        kv = route_of(vllm_config) == KV
        # What waits for the streamer: the kv route's laid-out blocks in pinned host memory (room
        # for a 128K-token prompt's 4-bit cache of an 8B model, 4.8 GB), the reconstruct route's
        # captured states where the engine holds them (on a GPU, its memory).
        streamer_args = dict(max_queued_mb=float(extra("max_queued_mb", 8192 if kv else 256)),
                             socket_timeout_s=float(extra("socket_timeout_s", 60.0)),
                             cpus=extra("streamer_cpus", "all"),
                             max_sending_mb=float(extra("max_sending_mb", 256)))
        if kv:
            self._worker = KvWorker(vllm_config, kv_cache_config, streamer_args)
            return
        group = self._find_cache_kv_group_id(kv_cache_config)
        block_size = (kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
                      if kv_cache_config is not None else vllm_config.cache_config.block_size)
        streamer_args.update(mlx_streams=int(extra("mlx_streams", 2)),
                             dense_weights=bool(extra("dense_weights", False)),
                             handoff=str(extra("handoff", "auto")))
        self._worker = CaptureWorker(vllm_config, kv_cache_config, group, block_size,
                                     max(1, int(extra("blocks_per_call", 8))), streamer_args)

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
        # The drafter's hidden-states cache keeps a token's states together (vLLM's layout for it);
        # the kv route reads whatever layout the attention backend keeps.
        if route_of(vllm_config) == KV or models.stage_route(vllm_config):
            return None
        return "LBNHC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # A step replayed from a full CUDA graph would skip save_kv_layer: the kv route reads every
        # layer between graph pieces.
        return (extra_config or {}).get("route") == KV

    # ============================== scheduler side ==============================

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None, "build_connector_meta on a worker"
        return self._scheduler.build_meta(scheduler_output)

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
        assert self._scheduler is not None, "request_finished on a worker"
        return self._scheduler.request_finished(request)

    # ============================== worker side ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches, self._has_bridge_work)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.begin_step(self._bridge_meta())  # before the forward (the kv route sets up its reads)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._bridge_meta())

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # nothing is ever sent asynchronously after a request finishes

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()

    def _bridge_meta(self) -> PdBridgeMetadata | None:
        """This step's metadata when it has bridge work; None otherwise."""
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, PdBridgeMetadata) and meta.has_work() else None

    def _has_bridge_work(self) -> bool:
        return self._bridge_meta() is not None
