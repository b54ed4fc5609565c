"""Bounds checking: the registered region (and key) holding each block, a whole batch at once."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from kvbeam.errors import RegionError
from kvbeam.transport.blocks import AddressArray

KeyArray = npt.NDArray[np.uint32]


class RegionTable:
    """Immutable set of non-overlapping ``(addr, length, key)`` regions.

    Lookups sort nothing per call: region starts are sorted once, and each
    block finds its candidate region with one ``np.searchsorted`` over the batch.
    """

    def __init__(self, regions: Iterable[tuple[int, int, int]], name: str) -> None:
        ordered = sorted((int(a), int(n), int(k)) for a, n, k in regions)
        self.name = name
        self._starts = np.array([a for a, _, _ in ordered], dtype=np.uint64)
        self._ends = np.array([a + n for a, n, _ in ordered], dtype=np.uint64)
        self._keys = np.array([k for _, _, k in ordered], dtype=np.uint32)
        self._start_list = [a for a, _, _ in ordered]
        for (a0, n0, _), (a1, _, _) in itertools.pairwise(ordered):
            if a0 + n0 > a1:
                raise RegionError(f"{name} regions overlap: [{a0:#x}, {a0 + n0:#x}) and "
                                  f"[{a1:#x}, ...); register each byte once")

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def arrays(self) -> tuple[AddressArray, AddressArray, KeyArray]:
        """The regions as the compiled blocks helper reads them (transport/_blocks.c):
        starts (ascending), ends and keys."""
        return self._starts, self._ends, self._keys

    def lookup(self, addrs: AddressArray, lengths: AddressArray) -> KeyArray:
        """Key of the region holding each ``[addr, addr + length)``; RegionError if any has none."""
        if len(addrs) == 0:
            return np.zeros(0, dtype=np.uint32)
        idx = np.searchsorted(self._starts, addrs, side="right").astype(np.int64) - 1
        safe = np.maximum(idx, 0)
        if len(self._starts) == 0:
            ok = np.zeros(len(addrs), dtype=bool)
            keys = np.zeros(len(addrs), dtype=np.uint32)
        else:
            end = self._ends[safe]
            # ``end - addrs`` may wrap where addrs > end; the first term masks those out.
            ok = (idx >= 0) & (addrs <= end) & (lengths <= end - addrs)
            keys = self._keys[safe]
        if not bool(ok.all()):
            bad = np.flatnonzero(~ok)
            i = int(bad[0])
            raise RegionError(
                f"{len(bad)} of {len(addrs)} blocks fall outside the {self.name} regions "
                f"({len(self)} registered{self._span()}); first: block {i} at "
                f"{int(addrs[i]):#x} length {int(lengths[i])}; nothing was posted")
        return keys

    def first_key(self) -> int:
        """The key of the lowest region (0 if none)."""
        return int(self._keys[0]) if len(self._keys) else 0

    def contains(self, addr: int, length: int) -> bool:
        """Scalar form of :meth:`lookup` for one block (the TCP receiver's check)."""
        i = bisect.bisect_right(self._start_list, addr) - 1
        return i >= 0 and length >= 0 and addr + length <= int(self._ends[i])

    def _span(self) -> str:
        if not len(self):
            return ""
        return f", spanning [{int(self._starts[0]):#x}, {int(self._ends.max()):#x})"
