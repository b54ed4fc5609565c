"""Allocation of a side's pools: host memory viewed with numpy (no torch), torch on CUDA.

Each :class:`~kvbeam.pools.layout.TensorLayout` becomes one flat allocation; buffers
are byte ranges inside them. On the host each allocation is its own page-aligned
anonymous mapping that never moves, viewed as a ``uint8`` numpy array (an engine's
attached pools are memfd mappings instead: :mod:`kvbeam.pools.shared`). The daemon
never imports torch for it (``import torch`` costs about a minute per process under
qemu TCG); torch is imported only for ``--device cuda`` and by :meth:`buffer_view`,
the reference engine's typed-tensor edge. The :class:`AllocatedSide` owns the memory:
memory registered with a transport must not outlive it.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbeam.pools.layout import BufferLayout, SideLayout
from kvbeam.transport.endpoint import Region

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: A pool allocation seen from the host: flat ``uint8`` bytes.
Bytes = np.ndarray[Any, np.dtype[np.uint8]]


def _zeroed_map(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private anonymous memory, page-aligned, every page written.

    The memory torch's CPU allocator gave large pools before (glibc maps them the same
    way), so registration and RDMA see the same kind of pages (THP-eligible, unlike
    shmem); only the owner's process maps it.
    """
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Written, not just mapped: touching every page now means registering the memory
    # later never faults in fresh pages under a pinned MR.
    np.frombuffer(m, dtype=np.uint8)[:] = 0
    return m


def host_arrays(maps: Sequence[mmap.mmap]) -> list[Bytes]:
    """One flat ``uint8`` array over each mapping."""
    # frombuffer shares the mapping (no copy); the mmap refuses to close while a view of
    # it lives, so a late reader can never touch unmapped memory.
    return [np.frombuffer(m, dtype=np.uint8) for m in maps]


class AllocatedSide:
    """A side's target and draft pools, allocated; keep it alive while regions are registered."""

    def __init__(self, layout: SideLayout, device: str = "cpu") -> None:
        self.layout = layout
        self.device = str(device)
        #: The host allocations as flat ``uint8`` arrays, one per layout tensor (CPU only).
        self.arrays: list[Bytes] = []
        #: The CUDA allocations (``--device cuda`` only; empty on the host).
        self.cuda_tensors: list[torch.Tensor] = []
        self._maps: list[mmap.mmap] = []
        self.on_host = self.device.partition(":")[0] == "cpu"
        if self.on_host:
            self._maps = [_zeroed_map(t.nbytes) for t in layout.tensors if t.nbytes]
            it = iter(host_arrays(self._maps))
            self.arrays = [next(it) if t.nbytes else np.zeros(0, np.uint8)
                           for t in layout.tensors]
        else:
            import torch  # only here: the host path never pays for it

            self.cuda_tensors = [torch.zeros(t.nbytes, dtype=torch.uint8, device=self.device)
                                 for t in layout.tensors]
        self._addrs: list[int] | None = None
        log.info("allocated %d tensors, %.1f MiB on %s", len(layout.tensors),
                 layout.total_bytes / 2**20, self.device)

    def _base(self, tensor: int) -> int:
        if not self.on_host:
            return int(self.cuda_tensors[tensor].data_ptr())
        return int(self.arrays[tensor].ctypes.data)

    def _length(self, tensor: int) -> int:
        if not self.on_host:
            return int(self.cuda_tensors[tensor].numel())
        return len(self.arrays[tensor])

    def buffer_addr(self, buf: BufferLayout) -> int:
        """Base address of a buffer."""
        return self._base(buf.tensor) + buf.offset

    def buffer_addrs(self) -> list[int]:
        """Base addresses aligned with :attr:`SideLayout.flat_buffers` (a fresh list)."""
        # The allocations never move while the side lives: compute once (the send path
        # asks on every request).
        if self._addrs is None:
            self._addrs = [self.buffer_addr(b) for b in self.layout.flat_buffers]
        return list(self._addrs)

    def buffer_array(self, buf: BufferLayout) -> Bytes:
        """The buffer's bytes as a writable ``uint8`` numpy view (no copy, no torch)."""
        if not self.on_host:
            raise ValueError(f"pools on {self.device}: no host view of buffer {buf.name}")
        return self.arrays[buf.tensor][buf.offset:buf.offset + buf.nbytes]

    def buffer_view(self, buf: BufferLayout) -> torch.Tensor:
        """The buffer's bytes as a ``uint8`` tensor (no copy; imports torch)."""
        import torch

        if not self.on_host:
            return self.cuda_tensors[buf.tensor].narrow(0, buf.offset, buf.nbytes)
        return torch.from_numpy(self.buffer_array(buf))

    def tensor_regions(self) -> list[Region]:
        """One region per allocation: what a transport registers (fewest memory regions)."""
        return [Region(self._base(i), self._length(i)) for i in range(len(self.layout.tensors))]

    def fill_pattern(self, seed: int) -> None:
        """Fill every allocation with a deterministic pattern, distinct per allocation and seed."""
        gen = np.random.default_rng(seed).bit_generator
        for i in range(len(self.layout.tensors)):
            n = self._length(i)
            if not self.on_host:
                import torch

                self.cuda_tensors[i].copy_(torch.from_numpy(_pattern(gen, n)))
                continue
            for start in range(0, n, _FILL_CHUNK):
                stop = min(n, start + _FILL_CHUNK)
                self.arrays[i][start:stop] = _pattern(gen, stop - start)


#: Bytes generated at once by :meth:`AllocatedSide.fill_pattern` (bounds its temporary).
_FILL_CHUNK = 8 << 20


def _pattern(gen: np.random.BitGenerator, n: int) -> Bytes:
    """The next ``n`` pattern bytes: raw 64-bit draws, about twice as fast as
    ``integers(0, 256)`` (a daemon fills hundreds of MB at start, slow under TCG)."""
    raw: Bytes = gen.random_raw(-(-n // 8)).view(np.uint8)
    return raw[:n]
