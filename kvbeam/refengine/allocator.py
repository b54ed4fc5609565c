"""The engine's own allocator: shuffled free lists, so a request's pages are fragmented.

kvbeam never chooses where a request's state lives: the engine does. This allocator
hands out page ids, SWA pages, ring rows and state items from free lists shuffled by
a seed, so two engines (prefill and decode) hold the same request at different,
out-of-order indices, and a transfer must honour every index list element by element.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvbeam.errors import PlanError
from kvbeam.pools.spec import PoolSpec
from kvbeam.pools.types import IndexKind

IndexArray = npt.NDArray[np.int64]
C128 = 128


class FreeList:
    """A pool of ids ``0..n-1`` handed out in a seeded random order."""

    def __init__(self, name: str, n: int, rng: np.random.Generator) -> None:
        self.name = name
        self._free = [int(i) for i in rng.permutation(n)]

    def take(self) -> int:
        """One free id; refuses when the pool is exhausted."""
        if not self._free:
            raise PlanError(f"reference engine: no free {self.name} left")
        return self._free.pop()

    def give(self, i: int) -> None:
        """Return an id to the pool."""
        self._free.append(i)


@dataclass
class Allocation:
    """Where one request lives in the engine's pools.

    ``kv_pages[p]`` is the page id of logical page ``p``; ``swa_pages`` maps a logical
    page to its SWA page (paged mode: the engine's full-to-SWA mapping); ``ring`` are
    the request's ``ring_size`` ring rows (unified mode: position ``pos`` lives in
    ``ring[pos % ring_size]``); ``c4_item`` and ``c128_item`` are its state items.
    """

    kv_pages: list[int] = field(default_factory=list)
    swa_pages: dict[int, int] = field(default_factory=dict)
    ring: list[int] = field(default_factory=list)
    c4_item: int = -1
    c128_item: int = -1


class Allocator:
    """Free lists for every index kind of one pool spec (the draft shares the target's)."""

    def __init__(self, spec: PoolSpec, seed: int) -> None:
        self.spec = spec
        rng = np.random.default_rng(seed)
        self.pages = FreeList("KV pages", spec.full_pages, rng)
        self.swa = FreeList("SWA pages", spec.num_req_slots * spec.swa_pages_per_request, rng)
        self.rows = FreeList("ring rows", spec.swa_pages, rng)
        self.c4 = FreeList("C4 state items", spec.num_req_slots, rng)
        c128_items = spec.num_req_slots * (1 if spec.online_c128 else spec.c128_ring_size // C128)
        self.c128 = FreeList("C128 state items", c128_items, rng)

    def new(self) -> Allocation:
        """A request's fixed allocations (ring rows, state items); pages come with positions."""
        a = Allocation(c4_item=self.c4.take(), c128_item=self.c128.take())
        if self.spec.unified_kv:
            a.ring = [self.rows.take() for _ in range(self.spec.ring_size)]
        return a

    def cover(self, a: Allocation, seq_len: int) -> None:
        """Make positions ``[0, seq_len)`` addressable; free SWA pages left behind the window."""
        ps = self.spec.page_size
        n = -(-seq_len // ps)
        while len(a.kv_pages) < n:
            a.kv_pages.append(self.pages.take())
        if self.spec.unified_kv:
            return
        first = max(0, seq_len - self.spec.sliding_window) // ps
        for p in [p for p in a.swa_pages if p < first]:
            self.swa.give(a.swa_pages.pop(p))
        for p in range(first, n):
            if p not in a.swa_pages:
                a.swa_pages[p] = self.swa.take()

    def release(self, a: Allocation) -> None:
        """Return everything a request holds."""
        for p in a.kv_pages:
            self.pages.give(p)
        for s in a.swa_pages.values():
            self.swa.give(s)
        for r in a.ring:
            self.rows.give(r)
        self.c4.give(a.c4_item)
        self.c128.give(a.c128_item)

    def index_lists(self, a: Allocation, seq_len: int) -> dict[IndexKind, IndexArray]:
        """The request's index lists per kind, in the semantics kvbeam moves.

        Element ``i`` of a source list goes to element ``i`` of the destination list:
        KV pages of logical pages ``0..n-1``; SWA pages of the window's logical pages;
        one ring row per window position ``max(0, L - window) .. L - 1``; the C4 state
        item; the C128 state item (empty when ``L % 128 == 0``).
        """
        spec, ps = self.spec, self.spec.page_size
        empty = np.zeros(0, dtype=np.int64)
        n = -(-seq_len // ps)
        start = max(0, seq_len - spec.sliding_window)
        out = {
            IndexKind.KV_PAGES: np.array(a.kv_pages[:n], dtype=np.int64),
            IndexKind.SWA_PAGES: empty,
            IndexKind.SWA_RING_ROWS: empty,
            IndexKind.REQ_SLOT: np.array([a.c4_item] if seq_len else [], dtype=np.int64),
            IndexKind.C128_STATE: np.array(
                [a.c128_item] if seq_len % C128 else [], dtype=np.int64),
        }
        if spec.unified_kv:
            ring = np.array(a.ring, dtype=np.int64)
            out[IndexKind.SWA_RING_ROWS] = ring[np.arange(start, seq_len) % spec.ring_size]
        else:
            out[IndexKind.SWA_PAGES] = np.array(
                [a.swa_pages[p] for p in range(start // ps, n)], dtype=np.int64)
        return out
