"""An engine's pools in shareable memory (memfds), described the way attach sends them.

:class:`EnginePools` allocates a side's pools in kvbeam's layout (one memfd per
allocation of :func:`~kvbeam.pools.layout.build_side_layout`). An engine with its own
allocation describes it with :class:`EngineBuffers` instead (any fds, several buffers
per fd, any offsets: only each buffer's length and item length must be the layout's),
and :class:`SharedMemory` moves ordinary CPU tensors into memfds for that. Torch is
imported only by the methods that return or take tensors.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbeam.pools.layout import BufferLayout, SideLayout, build_side_layout
from kvbeam.pools.shm import create_memfd, map_shared, unmap
from kvbeam.pools.spec import SideConfig
from kvbeam.proto.attach_codec import BufferRef

if TYPE_CHECKING:
    import torch


@dataclass
class EngineBuffers:
    """What attach sends: the fds and, per component (positional), each buffer's place."""

    fds: list[int]
    components: list[list[BufferRef]] = field(default_factory=list)


class EnginePools:
    """A side's pools allocated in memfds, in kvbeam's layout. Close when done (the
    daemon keeps its own mapping until it detaches)."""

    def __init__(self, config: SideConfig) -> None:
        self.config = config
        self.layout: SideLayout = build_side_layout(config)
        self.fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        try:
            for t in self.layout.tensors:
                fd = create_memfd(t.name, t.nbytes)
                self.fds.append(fd)
                self._maps.append(map_shared(fd, t.nbytes))
        except BaseException:
            self.close()
            raise

    def buffer_array(self, buf: BufferLayout) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The buffer's bytes as a writable ``uint8`` numpy view (no copy, no torch)."""
        return np.frombuffer(self._maps[buf.tensor], dtype=np.uint8, count=buf.nbytes,
                             offset=buf.offset)

    def buffer_view(self, buf: BufferLayout) -> torch.Tensor:
        """The buffer's bytes as a writable ``uint8`` tensor (no copy)."""
        import torch

        return torch.frombuffer(self._maps[buf.tensor], dtype=torch.uint8, count=buf.nbytes,
                                offset=buf.offset)

    def allocation_view(self, tensor: int) -> torch.Tensor:
        """Allocation ``tensor``'s whole memfd mapping as a ``uint8`` tensor (no copy):
        what a staging buffer pins (page-aligned, one registration per mapping)."""
        import torch

        return torch.frombuffer(self._maps[tensor], dtype=torch.uint8)

    def fill_pattern(self, seed: int) -> None:
        """Fill every allocation with a deterministic pattern of ``seed`` (tests, demos)."""
        rng = np.random.default_rng(seed)
        for m in self._maps:
            np.frombuffer(m, dtype=np.uint8)[:] = rng.integers(0, 256, len(m), dtype=np.uint8)

    def buffers(self) -> EngineBuffers:
        """The attach description: every buffer at its place in the memfds."""
        return EngineBuffers(list(self.fds), [
            [BufferRef(b.tensor, b.offset, b.nbytes, b.item_len) for b in comp.buffers]
            for comp in self.layout.components])

    def close(self) -> None:
        """Unmap and close the fds (the memory lives on while the daemon maps it; a
        mapping a view still uses goes with its last view)."""
        unmap(self._maps)
        for fd in self.fds:
            os.close(fd)
        self._maps, self.fds = [], []

    def __enter__(self) -> EnginePools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SharedMemory:
    """Moves an engine's CPU tensors into memfds so they can be attached.

    :meth:`share` copies a tensor into a new memfd and returns the memfd-backed tensor
    that replaces it (like ``share_memory_()``, the address changes: use the returned
    tensor from now on); :meth:`ref` describes a shared tensor's bytes for attach.
    """

    def __init__(self) -> None:
        self.fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._by_ptr: dict[int, int] = {}

    def share(self, tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
        """A memfd-backed copy of a CPU ``tensor`` (same dtype and shape)."""
        import torch

        src = tensor.detach().contiguous()
        nbytes = src.numel() * src.element_size()
        fd = create_memfd(name, nbytes)
        mm = map_shared(fd, nbytes)
        out = torch.frombuffer(mm, dtype=src.dtype).view(src.shape)
        out.copy_(src)
        self.fds.append(fd)
        self._maps.append(mm)
        self._by_ptr[int(out.data_ptr())] = len(self.fds) - 1
        return out

    def ref(self, tensor: torch.Tensor, item_len: int) -> BufferRef:
        """The attach description of a tensor :meth:`share` returned (all its bytes)."""
        index = self._by_ptr.get(int(tensor.data_ptr()))
        if index is None:
            raise ValueError("not a tensor SharedMemory.share returned")
        return BufferRef(index, 0, tensor.numel() * tensor.element_size(), item_len)

    def close(self) -> None:
        """Close the fds (tensors returned by :meth:`share` keep their mappings)."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []
