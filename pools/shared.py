"""A side whose pools live in an engine's shared memory, mapped by the daemon.

:class:`MappedSide` has :class:`~kvbeam.pools.allocate.AllocatedSide`'s interface
(buffer addresses and views, regions to register, buffer infos), so the cores,
the digests and the plans use it unchanged. Its layout's "tensors" are the
mappings (one per fd the engine sent) and its buffers sit at the engine's own
offsets, which need not be the ones :func:`~kvbeam.pools.layout.build_side_layout`
would choose: only lengths and item lengths must match.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
from collections.abc import Sequence

from kvbeam.pools.allocate import AllocatedSide, host_arrays
from kvbeam.pools.layout import BufferLayout, ComponentLayout, SideLayout, TensorLayout

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one buffer of the expected layout lives: mapping ``mapping`` at ``offset``."""

    mapping: int
    offset: int


def placed_layout(expected: SideLayout, placements: Sequence[Sequence[Placement]],
                  sizes: Sequence[int]) -> SideLayout:
    """``expected`` with each buffer moved to its placement; one tensor per mapping."""
    tensors = tuple(TensorLayout(f"engine.fd{i}", n) for i, n in enumerate(sizes))

    def place(comp: ComponentLayout, where: Sequence[Placement]) -> ComponentLayout:
        bufs: list[BufferLayout] = [dataclasses.replace(b, tensor=p.mapping, offset=p.offset)
                                    for b, p in zip(comp.buffers, where, strict=True)]
        return dataclasses.replace(comp, buffers=tuple(bufs))

    comps = [place(c, p) for c, p in zip(expected.components, placements, strict=True)]
    return dataclasses.replace(expected, tensors=tensors, kv=comps[0], states=tuple(comps[1:]))


class MappedSide(AllocatedSide):
    """An engine's pools, mapped here; after deregistration, :meth:`take_maps` and
    :func:`kvbeam.pools.shm.unmap` release them."""

    def __init__(self, layout: SideLayout, maps: Sequence[mmap.mmap]) -> None:
        # Not AllocatedSide.__init__: nothing is allocated, the memory is the engine's.
        self.layout = layout
        self.device = "cpu"
        self.on_host = True
        self.cuda_tensors = []
        self._maps = list(maps)
        self.arrays = host_arrays(self._maps)
        self._addrs = None

    @property
    def mapped_bytes(self) -> int:
        """Bytes mapped (0 once the mappings were taken)."""
        return sum(len(m) for m in self._maps)

    def take_maps(self) -> list[mmap.mmap]:
        """Give up the mappings (the side is unusable afterwards); unmap them with
        :func:`~kvbeam.pools.shm.unmap` once every other reference to this side is dropped."""
        maps, self._maps = self._maps, []
        self.arrays = []
        self._addrs = None
        return maps

