"""GPUDirect: an engine's CUDA KV exported as dma-buf fds and attached as ``memory_kind: dmabuf``.

Instead of staging (:mod:`kvbeam.engine.staging`), an engine whose NIC can read and
write GPU memory hands its daemon the GPU memory itself: each CUDA allocation its pools
live in is exported as a dma-buf fd (``cuMemGetHandleForAddressRange(...,
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`` on the allocation's base, from
``cuMemGetAddressRange``: the range must be the whole allocation, under CUDA's virtual
memory management the mapping's), sent over the attach socket like a memfd, each buffer
an offset into its allocation's fd. :func:`export_side` does it for kvbeam's own CUDA
pools (:class:`~kvbeam.pools.allocate.AllocatedSide` on ``cuda``), one fd per
allocation however many buffers share it.

The daemon registers the fds with ``ibv_reg_dmabuf_mr`` (RDMA) and refuses what it cannot
take in one line (:mod:`kvbeam.server.engines.dmabuf`): its integrity check on (it cannot read
device memory), a NIC that cannot register dma-buf, TCP (which needs to map it). The
calls go through NVIDIA's ``cuda-bindings`` (``cuda.bindings.driver``, or the older
``cuda.cuda``), imported only here. docs/gpu.md.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbeam.engine.memory import EngineBuffers
from kvbeam.errors import ConfigError
from kvbeam.proto.attach_codec import BufferRef

if TYPE_CHECKING:
    from kvbeam.pools.allocate import AllocatedSide

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DmaBuf:
    """One exported allocation: dma-buf ``fd`` of ``size`` bytes from device address
    ``base``; the caller owns (closes) the fd."""

    fd: int
    base: int
    size: int


def _driver() -> Any:
    """NVIDIA's driver API bindings (cuda-bindings 12.6+, or cuda-python's older name)."""
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError:
        try:
            return importlib.import_module("cuda.cuda")
        except ImportError as exc:
            raise ConfigError("dma-buf export needs NVIDIA's cuda-bindings (pip install "
                              f"cuda-bindings): {exc}") from None


def _check(drv: Any, result: Any, what: str) -> None:
    if int(result) != 0:
        _, text = drv.cuGetErrorString(result)
        name = text.decode() if isinstance(text, bytes) else str(text)
        raise ConfigError(f"dma-buf export: {what} failed: {name} (CUresult {int(result)})")


def dmabuf_supported(device: int = 0) -> str:
    """"" when CUDA device ``device`` can export dma-buf fds, else why not (one line)."""
    drv = _driver()
    err, value = drv.cuDeviceGetAttribute(
        drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, device)
    if int(err) != 0:
        return f"cuDeviceGetAttribute(DMA_BUF_SUPPORTED) failed (CUresult {int(err)})"
    if not value:
        return (f"CUDA device {device} cannot export dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_"
                "SUPPORTED is 0: it needs NVIDIA's open kernel modules and a kernel with "
                "dma-buf support)")
    return ""


def export_allocation(ptr: int) -> DmaBuf:
    """The CUDA allocation holding device address ``ptr``, exported as a dma-buf fd."""
    drv = _driver()
    err, base, size = drv.cuMemGetAddressRange(ptr)
    _check(drv, err, f"cuMemGetAddressRange({ptr:#x})")
    err, fd = drv.cuMemGetHandleForAddressRange(
        base, size, drv.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
    _check(drv, err, f"cuMemGetHandleForAddressRange({int(base):#x}, {int(size)})")
    return DmaBuf(int(fd), int(base), int(size))


def export_side(side: AllocatedSide) -> EngineBuffers:
    """kvbeam's CUDA pools as dma-buf fds: one per allocation, every buffer an offset in
    its allocation's fd. Attach the result with ``memory_kind="dmabuf"``; close its fds
    after the attach (the daemon holds its own)."""
    if side.on_host:
        raise ConfigError(f"dma-buf export: the pools are on {side.device}, not a GPU")
    why = dmabuf_supported(_device_index(side.device))
    if why:
        raise ConfigError(f"dma-buf export: {why}")
    exports: list[DmaBuf] = []
    places: list[tuple[int, int]] = []  # per layout tensor: (fd index, offset in its fd)
    try:
        for t in side.cuda_tensors:
            ptr = int(t.data_ptr())
            hit = next((i for i, e in enumerate(exports)
                        if e.base <= ptr < e.base + e.size), None)
            if hit is None:
                exports.append(export_allocation(ptr))
                hit = len(exports) - 1
            places.append((hit, ptr - exports[hit].base))
    except BaseException:
        for e in exports:
            os.close(e.fd)
        raise
    comps = [[BufferRef(places[b.tensor][0], places[b.tensor][1] + b.offset, b.nbytes,
                        b.item_len) for b in comp.buffers] for comp in side.layout.components]
    log.info("dma-buf export: %d allocation(s), %.1f MiB, as %d fd(s)", len(side.cuda_tensors),
             sum(e.size for e in exports) / 2**20, len(exports))
    return EngineBuffers([e.fd for e in exports], comps)


def _device_index(device: str) -> int:
    _, _, index = device.partition(":")
    if index:
        return int(index)
    import torch

    return int(torch.cuda.current_device())
