"""Allocation of a side's pools as torch tensors (CPU here; CUDA where present).

Each :class:`~kvbeam.pools.layout.TensorLayout` becomes one flat ``uint8`` tensor;
buffers are byte ranges inside them. The :class:`AllocatedSide` owns the tensors:
memory registered with a transport must not outlive it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvbeam.pools.layout import BufferLayout, SideLayout
from kvbeam.transport.endpoint import Region

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BufferInfo:
    """sglang's buffer info triple: data pointer, byte length, item length."""

    data_ptr: int
    data_len: int
    item_len: int


class AllocatedSide:
    """A side's target and draft pools, allocated; keep it alive while regions are registered."""

    def __init__(self, layout: SideLayout, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        # zeros, not empty: touching every page now means registering the memory
        # later never faults in fresh pages under a pinned MR.
        self.tensors: list[torch.Tensor] = [
            torch.zeros(t.nbytes, dtype=torch.uint8, device=self.device) for t in layout.tensors
        ]
        self._addrs: list[int] | None = None
        log.info("allocated %d tensors, %.1f MiB on %s", len(self.tensors),
                 layout.total_bytes / 2**20, self.device)

    def buffer_addr(self, buf: BufferLayout) -> int:
        """Base address of a buffer."""
        return int(self.tensors[buf.tensor].data_ptr()) + buf.offset

    def buffer_addrs(self) -> list[int]:
        """Base addresses aligned with :attr:`SideLayout.flat_buffers` (a fresh list)."""
        # The tensors never move while the side lives: compute once (each call used to
        # cost one torch data_ptr() per buffer on every request's send path).
        if self._addrs is None:
            self._addrs = [self.buffer_addr(b) for b in self.layout.flat_buffers]
        return list(self._addrs)

    def buffer_view(self, buf: BufferLayout) -> torch.Tensor:
        """The buffer's bytes as a ``uint8`` view (no copy)."""
        return self.tensors[buf.tensor].narrow(0, buf.offset, buf.nbytes)

    def component_buf_infos(self, component: int) -> list[BufferInfo]:
        """(data pointer, byte length, item length) for each buffer of a component."""
        comp = self.layout.components[component]
        return [BufferInfo(self.buffer_addr(b), b.nbytes, b.item_len) for b in comp.buffers]

    def tensor_regions(self) -> list[Region]:
        """One region per allocation: what a transport registers (fewest memory regions)."""
        return [Region(int(t.data_ptr()), t.numel()) for t in self.tensors]

    def buffer_regions(self) -> list[Region]:
        """One region per flat buffer: what the handshake advertises to the peer."""
        return [Region(self.buffer_addr(b), b.nbytes) for b in self.layout.flat_buffers]

    def fill_pattern(self, seed: int) -> None:
        """Fill every tensor with a deterministic pattern, distinct per tensor and seed."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for t in self.tensors:
            t.copy_(torch.randint(0, 256, (t.numel(),), dtype=torch.uint8, generator=gen))
