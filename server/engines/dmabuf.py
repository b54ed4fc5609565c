"""The daemon side of ``memory_kind: dmabuf``: an engine's device memory as dma-buf fds.

An engine with its KV on a GPU may attach it directly (GPUDirect) instead of staging
it through host memory: each allocation exported as a dma-buf fd
(:mod:`kvbeam.engine.dmabuf`), sent like a memfd. What the daemon can do with it
depends on its transport, and every refusal is one line naming the device, its
driver, the kind and what to do instead (attach a staged host buffer,
:mod:`kvbeam.engine.staging`):

- integrity on: refused. The daemon cannot read device memory, and device-side digests
  are not implemented: Success would be reported on bytes nobody verified. Running both
  daemons with ``--integrity false`` is the operator's choice to move them unverified.
- TCP: the daemon moves bytes with the CPU, so it maps the dma-buf (``mmap``): a
  CPU-mappable one (udmabuf, DRM dumb buffers) works; a GPU's is refused, naming the
  error.
- RDMA: nothing is mapped. Each fd is registered with ``ibv_reg_dmabuf_mr``
  (:mod:`kvbeam.transport.verbs.dmabuf_mr`) at an **iova the daemon reserved**: an
  address range mapped ``PROT_NONE`` (no memory, any CPU access faults), one per fd, so a
  dma-buf region has an address no other region has and the plans, the region checks
  and the handshake treat it like any region. Not the offset (pyverbs' choice: every
  dma-buf would start at 0 and the blocks would need (MR, offset) pairs), not the
  engine's device address (unique only inside the engine's process: it could coincide
  with one of the daemon's own mappings). A device that cannot register dma-buf
  (rdma_rxe never will) is refused with its errno.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass

from kvbeam.errors import AttachError, TransportError
from kvbeam.pools.shm import filesystem_type
from kvbeam.transport.base import Access, Registration, Transport
from kvbeam.transport.endpoint import DmaBufRegion, Region

log = logging.getLogger(__name__)

#: statfs ``f_type`` of a dma-buf fd (linux/magic.h DMA_BUF_MAGIC, "DMAB").
DMA_BUF_MAGIC = 0x444D4142
#: What every dma-buf refusal offers instead.
STAGED_FALLBACK = ("attach host memory and stage the KV through it instead "
                   "(kvbeam.engine.staging, docs/gpu.md)")
INTEGRITY_REFUSED = ("memory_kind dmabuf: this daemon's integrity check is on, and it cannot "
                     "read device memory to digest it (device-side digests are not "
                     "implemented): Success would mean unverified bytes; " + STAGED_FALLBACK +
                     ", or run both daemons with --integrity false to move them unverified")
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
#: PROT_NONE (linux/mman.h; Python's mmap module does not name it).
_PROT_NONE = 0


def rdma_driver(device: str) -> str:
    """The kernel driver of RDMA device ``device``, for refusals: rxe and siw (software
    devices, named so by default) by name, a NIC by its sysfs driver link."""
    for prefix, driver in (("rxe", "rdma_rxe"), ("siw", "siw")):
        if device.startswith(prefix):
            return driver
    try:
        return os.path.basename(os.readlink(f"/sys/class/infiniband/{device}/device/driver"))
    except OSError:
        return "unknown driver"


@dataclass(frozen=True)
class DmabufMemory:
    """What a dma-buf attach keeps until its registration: one fd (a duplicate the
    daemon owns) and the region it is addressed as, per mapping."""

    fds: tuple[int, ...]
    regions: tuple[Region, ...]

    def close(self) -> None:
        """Close the duplicates (an MR and a mapping hold the dma-buf themselves)."""
        for fd in self.fds:
            os.close(fd)


class DmabufAccess:
    """How this daemon takes dma-buf memory: ``transport`` and its ``integrity`` flag."""

    def __init__(self, transport: Transport, integrity: bool) -> None:
        self.transport = transport
        self.integrity = integrity
        self.device = str(getattr(getattr(transport, "device", None), "name", "")) or "tcp"

    def where(self) -> str:
        """The transport and device, for refusals: ``RDMA device rxe0 (driver rdma_rxe)``."""
        if self.transport.kind != "rdma":
            return f"the {self.transport.kind} transport"
        return f"RDMA device {self.device} (driver {rdma_driver(self.device)})"

    def check_allowed(self) -> None:
        """Refuse before any fd is looked at when integrity is on."""
        if self.integrity:
            raise AttachError(INTEGRITY_REFUSED, "memory_kind")

    @staticmethod
    def size(fd: int, field: str, used_by: str) -> int:
        """Size of a dma-buf fd; refuses anything else, naming ``field`` and its buffers."""
        what = f"{field} ({used_by})"
        try:
            fs_type = filesystem_type(fd)
        except OSError as exc:
            raise AttachError(f"{what}: cannot inspect the fd: {exc}", field) from None
        if fs_type != DMA_BUF_MAGIC:
            raise AttachError(f"{what}: not a dma-buf (statfs type {fs_type:#x}): memory_kind "
                              "dmabuf takes dma-buf fds (cuMemGetHandleForAddressRange, "
                              "udmabuf); a memfd is memory_kind host_shm", field)
        size = os.lseek(fd, 0, os.SEEK_END)
        os.lseek(fd, 0, os.SEEK_SET)
        if size <= 0:
            raise AttachError(f"{what}: the dma-buf is empty", field)
        return size

    def map(self, fd: int, size: int, field: str) -> mmap.mmap:
        """TCP: the dma-buf mapped read-write (refused when it cannot be). RDMA: a
        ``PROT_NONE`` reservation of ``size`` bytes, whose address is the fd's iova."""
        if self.transport.kind == "rdma":
            return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS |
                             _MAP_NORESERVE, prot=_PROT_NONE)
        try:
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise AttachError(
                f"memory_kind dmabuf: {self.where()} moves bytes with the CPU and cannot map "
                f"{field} (mmap: {exc.strerror}, errno {exc.errno}; a GPU's dma-buf is not "
                f"CPU-mappable): use RDMA with a NIC that registers dma-buf, or "
                f"{STAGED_FALLBACK}", field) from None

    def register(self, memory: DmabufMemory, access: Access) -> Registration:
        """Register the attached dma-bufs: TCP the mappings (plain regions), RDMA each fd
        at its region's iova; a device that refuses is answered in one line."""
        if self.transport.kind != "rdma":
            return self.transport.register(list(memory.regions), access)
        regions = [DmaBufRegion(fd, 0, r.length, r.addr)
                   for fd, r in zip(memory.fds, memory.regions, strict=True)]
        try:
            return self.transport.register_dmabuf(regions, access)
        except TransportError as exc:
            raise AttachError(f"memory_kind dmabuf: {self.where()} cannot register dma-buf "
                              f"memory ({exc}); {STAGED_FALLBACK}", "memory_kind") from None
