"""How captured states reach MLX and finished blocks leave it: the one seam between the engine's
memory and MLX's.

Two ways, chosen once per streamer (``handoff`` in the plugin's config: ``auto``, ``host``,
``device``):

* ``host`` — the states are copied to the host (off the step loop, into pinned memory when they
  come from a GPU) and handed to MLX as host arrays; blocks are read back through MLX's buffer
  protocol. Any engine, any MLX backend.
* ``device`` — for vLLM on CUDA beside MLX's CUDA backend, in one process: MLX has no CUDA DLPack
  import, so the states are copied on the GPU straight into an MLX array's own memory (its address
  through the buffer protocol, wrapped for torch with ``__cuda_array_interface__``), and blocks are
  copied out of MLX's memory into pinned host buffers by the GPU's copy engine instead of CPU reads.
  It is checked against the host way on a probe before first use; ``auto`` takes it when that check
  passes and says in the log which way it runs.

Only import this module where MLX may run: it imports ``mlx.core``.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

logger = logging.getLogger("vllm.pdbridge_vllm")

HOST, DEVICE, AUTO = "host", "device", "auto"

# numpy has no bfloat16: tensors travel as their bit patterns (types torch copies: no uint16).
_BITS = {1: (mx.uint8, "|u1"), 2: (mx.int16, "<i2"), 4: (mx.int32, "<i4")}


class HandoffError(Exception):
    """The device way cannot run here; the message says why."""


def ready_event(hidden):
    """An event a GPU tensor's producer recorded (None for host memory): the streamer thread waits
    on it before reading the tensor, instead of the step loop waiting for the copy."""
    if getattr(hidden, "is_cuda", False):
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(hidden.device))
        return event
    return None


class HostHandoff:
    name = HOST

    def to_mlx(self, hidden, event=None) -> mx.array:
        """`hidden` (numpy, or a torch tensor anywhere) as an MLX array of the same dtype and values."""
        if isinstance(hidden, np.ndarray):
            return mx.array(hidden)
        import torch

        if hidden.is_cuda:
            host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
            stream = torch.cuda.current_stream(hidden.device)
            if event is not None:
                stream.wait_event(event)
            host.copy_(hidden, non_blocking=True)
            stream.synchronize()
            hidden = host
        if hidden.dtype == torch.bfloat16:
            return mx.array(hidden.view(torch.int16).numpy()).view(mx.bfloat16)
        if hidden.dtype in (torch.float32, torch.float16):
            return mx.array(hidden.numpy())
        return mx.array(hidden.float().numpy())

    def to_host(self, array: mx.array) -> memoryview:
        """An evaluated, contiguous MLX array's bytes (a view of MLX's buffer)."""
        if array.dtype == mx.bfloat16:
            array = array.view(mx.uint16)
        return memoryview(np.asarray(array)).cast("B")


class _CudaArray:
    """Device memory at `ptr` as torch sees it through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (ptr, False), "strides": None, "version": 3}


class DeviceHandoff(HostHandoff):
    name = DEVICE

    def __init__(self):
        import torch

        if not torch.cuda.is_available():
            raise HandoffError("torch sees no CUDA device")
        if mx.default_device() != mx.gpu:
            raise HandoffError(f"MLX computes on {mx.default_device()}, not a GPU")
        self._torch = torch
        self._probe()

    def _mlx_memory(self, array: mx.array, device) -> tuple[mx.array, object]:
        """`array` (evaluated) and a torch CUDA view of its memory, as raw element bits."""
        width = array.dtype.size
        if width not in _BITS:
            raise HandoffError(f"no bit type for {array.dtype}")
        mx_bits, typestr = _BITS[width]
        bits = array.view(mx_bits)
        host = np.asarray(bits)  # the buffer protocol gives the address CUDA sees too (unified memory)
        if not host.flags.c_contiguous or host.nbytes != array.nbytes:
            raise HandoffError(f"MLX memory of {array.shape} is not one contiguous buffer")
        view = self._torch.as_tensor(_CudaArray(host.ctypes.data, array.shape, typestr), device=device)
        return bits, view

    def to_mlx(self, hidden, event=None) -> mx.array:
        if not getattr(hidden, "is_cuda", False):
            return super().to_mlx(hidden, event)
        torch = self._torch
        dtype = {torch.bfloat16: mx.bfloat16, torch.float16: mx.float16, torch.float32: mx.float32}[hidden.dtype]
        out = mx.zeros(hidden.shape, dtype=dtype)
        mx.eval(out)
        bits, view = self._mlx_memory(out, hidden.device)
        stream = torch.cuda.current_stream(hidden.device)
        if event is not None:
            stream.wait_event(event)
        view.copy_(hidden.contiguous().view(view.dtype))
        stream.synchronize()
        return bits.view(dtype)

    def to_host(self, array: mx.array) -> memoryview:
        torch = self._torch
        _, view = self._mlx_memory(array, torch.device("cuda", torch.cuda.current_device()))
        host = torch.empty(view.shape, dtype=view.dtype, pin_memory=True)
        host.copy_(view, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return memoryview(host.numpy()).cast("B")

    def _probe(self) -> None:
        """Both directions on a probe, bit for bit against the host way."""
        torch = self._torch
        probe = torch.randn(64, 3, 40, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        host = HostHandoff()
        try:
            got = self.to_mlx(probe.cuda())
            mx.eval(got)
            arrived = bytes(host.to_host(got)) == bytes(host.to_host(host.to_mlx(probe)))
            doubled = got * 2
            mx.eval(doubled)
            left = bytes(self.to_host(doubled)) == bytes(host.to_host(doubled))
        except HandoffError:
            raise
        except Exception as e:  # an MLX or torch build that does not allow it
            raise HandoffError(f"{type(e).__name__}: {e}") from None
        if not (arrived and left):
            raise HandoffError(f"the probe's bits differ from the host way's (into MLX: {arrived}, out: {left})")


def choose(kind: str) -> HostHandoff:
    """The handoff `kind` names; `auto`: the device way where it passes its probe, else the host way."""
    if kind == HOST:
        return HostHandoff()
    if kind not in (DEVICE, AUTO):
        raise ValueError(f"handoff must be one of {HOST}, {DEVICE}, {AUTO}, not {kind!r}")
    try:
        chosen = DeviceHandoff()
    except HandoffError as e:
        if kind == DEVICE:
            raise
        logger.info("pdbridge: states reach MLX through the host (the device handoff: %s)", e)
        return HostHandoff()
    logger.info("pdbridge: states reach MLX on the GPU (device handoff, probe passed)")
    return chosen
