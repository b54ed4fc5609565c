"""Which live reservation owns each destination item of decode's pools.

:func:`~kvbeam.pools.engine_indices.validate` checks one request's lists alone (each
index in range, none twice in a list). Two live reservations naming the same page
would have two prefills write into it, and one request's KV land in another's: an
engine's allocator bug, or a caller that does not own the pages it names. The book
refuses the second reservation with :class:`~kvbeam.errors.BadIndexList`, naming both
requests, the kind (and pool) and the item. Slot-based reservations are entered too,
so an engine list cannot take a slot's pages either. The draft pool's items are those
its buffers address: the draft's own list of a kind where given, else the target's
(:func:`~kvbeam.pools.plan.list_for`).

One owner array per (pool, kind), grown to the largest index seen: a claim and a
release are one call of the compiled owner book (pools/_owners.c), or where it was not
built a handful of numpy operations per list, whatever the request's length. Not
thread-safe on its own: the decode core calls it on the daemon's loop only.
"""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt

from kvbeam.compiled import helper_line, load_helper
from kvbeam.errors import BadIndexList
from kvbeam.pools.engine_indices import NOUNS
from kvbeam.pools.plan import list_for
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.ports import IndexLists

_Key = tuple[str, IndexKind]
_Lists = list[tuple[_Key, npt.NDArray[np.int64]]]


_HELPER, _HELPER_WHY = load_helper("kvbeam.pools._owners", "one call per claim", "numpy")
#: Whether claims and releases go through the compiled helper; the numpy path remains
#: for where it was not built and as its oracle (tests switch this off).
COMPILED = _HELPER is not None


def claims() -> str:
    """How this process enters decode's claims: the compiled helper, or numpy and why."""
    return helper_line(_HELPER, _HELPER_WHY, COMPILED, "numpy")


class PageBook:
    """Owners of decode's destination items: no item belongs to two live reservations."""

    def __init__(self) -> None:
        self._owners: dict[_Key, npt.NDArray[np.int64]] = {}  # 0: free, else a handle
        self._names: dict[int, str] = {}                      # handle -> request id
        self._held: dict[str, tuple[int, _Lists]] = {}
        self._handles = itertools.count(1)

    def claim(self, request_id: str, indices: IndexLists, draft: IndexLists, *,
              draft_pool: bool) -> None:
        """Enter a reservation's lists; BadIndexList if a live one holds any of their items.

        ``draft_pool``: the layout has a draft, whose items are entered too. Nothing is
        entered when the claim is refused.
        """
        given = {("target", k): v for k, v in indices.items()}
        if draft_pool:
            given.update({("draft", k): list_for(indices, draft, "draft", k)
                          for k in {*indices, *draft}})
        lists = [(key, arr) for key, arr in given.items() if len(arr)]
        handle = next(self._handles)
        if not (COMPILED and self._claim_compiled(request_id, lists, handle)):
            self._claim_numpy(request_id, lists, handle)
        self._names[handle] = request_id
        self._held[request_id] = (handle, lists)

    def _claim_compiled(self, request_id: str, lists: _Lists, handle: int) -> bool:
        """The claim in one call: True when entered, False when the helper cannot read a
        list in place (the numpy path then claims); BadIndexList, nothing entered, when a
        live reservation holds an item."""
        for key, _ in lists:
            if key not in self._owners:
                self._owners[key] = np.zeros(0, dtype=np.int64)
        while True:
            try:
                code, k, at = _HELPER.claim([self._owners[key] for key, _ in lists],
                                            [arr for _, arr in lists], handle)
            except (BufferError, ValueError):  # e.g. a strided list
                return False
            if code == 0:
                return True
            key, arr = lists[k]
            if code == 1:  # a list names an item past its owner array: grow it, again
                self._grow(key, at)
                continue
            self._refuse(request_id, key, arr, at)

    def _claim_numpy(self, request_id: str, lists: _Lists, handle: int) -> None:
        for key, arr in lists:
            owners = self._owners.get(key)
            if owners is None:
                continue
            inside = arr[arr < len(owners)]
            taken = np.flatnonzero(owners[inside]) if len(inside) else inside
            if len(taken):
                index = int(inside[int(taken[0])])
                self._refuse(request_id, key, arr, int(np.flatnonzero(arr == index)[0]))
        for key, arr in lists:
            self._grow(key, int(arr.max()) + 1)
            self._owners[key][arr] = handle

    def _grow(self, key: _Key, need: int) -> None:
        """Make ``key``'s owner array hold at least ``need`` items (doubling)."""
        owners = self._owners.get(key, np.zeros(0, dtype=np.int64))
        if need > len(owners):
            grown = np.zeros(max(need, 2 * len(owners)), dtype=np.int64)
            grown[:len(owners)] = owners
            owners = grown
        self._owners[key] = owners

    def _refuse(self, request_id: str, key: _Key, arr: npt.NDArray[np.int64],
                position: int) -> None:
        """Raise: item ``arr[position]`` of ``key`` is held by another live reservation."""
        pool, kind = key
        index = int(arr[position])
        other = self._names[int(self._owners[key][index])]
        label = kind.value if pool == "target" else f"draft {kind.value}"
        noun = NOUNS[kind].removesuffix("s")
        raise BadIndexList(
            f"decode: request {request_id}: {label} index {index} at position "
            f"{position} is held by live request {other}: two live reservations may "
            f"not name the same {noun} (the engine must give each request its own)",
            side="decode", kind=kind.value, pool=pool, position=position, index=index)

    def release(self, request_id: str) -> None:
        """Free a reservation's items (nothing when it holds none)."""
        entry = self._held.pop(request_id, None)
        if entry is None:
            return
        handle, lists = entry
        del self._names[handle]
        if COMPILED:
            try:
                _HELPER.release([self._owners[key] for key, _ in lists],
                                [arr for _, arr in lists], handle)
                return
            except (BufferError, ValueError):  # a list it cannot read in place: numpy frees
                pass
        for key, arr in lists:
            owners = self._owners[key]
            mine = arr[owners[arr] == handle]
            owners[mine] = 0

    def __len__(self) -> int:
        return len(self._held)
