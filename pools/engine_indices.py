"""Index lists an engine chooses itself: parse them, validate them against a side's layout.

An engine (sglang, vLLM) allocates pages from its own free list and keeps its own
full-to-SWA mapping, so it names every item a request occupies: one list per index
kind (docs/indices.md). Before any byte moves, each side checks its lists against
its own layout and refuses a bad one with :class:`~kvbeam.errors.BadIndexList`
(INVALID_ARGUMENT) naming the side, the kind (and pool) and the first bad index:

- the kind is known and this layout has buffers of it (a draft list: the draft has);
- every kind the layout uses is given (no per-kind fall-back to slot-based lists,
  which would address items the engine may have handed to another request);
- each list has the length the request's ``seq_len`` needs
  (:func:`kvbeam.pools.indices.expected_lengths`); decode's page lists may be
  shorter (a cached prefix) where :data:`~kvbeam.pools.types.EXACT_MATCH_KINDS`
  allows it and the caller says so;
- every index is in ``[0, items)`` of every buffer the list addresses;
- no index appears twice in a list.

Every check is a handful of numpy operations: a 128k-token request's thousands of
pages cost no Python loop per index.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Union

import numpy as np
import numpy.typing as npt

from kvbeam.errors import BadIndexList, BadKvSkip
from kvbeam.pools.indices import INT64, expected_lengths, request_indices
from kvbeam.pools.layout import LayoutCache, SideLayout
from kvbeam.pools.spec import PoolSpec
from kvbeam.pools.types import EXACT_MATCH_KINDS, INDEX_KINDS, IndexKind

Lists = dict[IndexKind, npt.NDArray[np.int64]]
#: What a caller may hand in for one list: a sequence of ints or an integer array.
ListLike = Union[Sequence[int], npt.NDArray[np.integer]]  # noqa: UP007 (a runtime alias)

#: Lists up to this long are checked in plain Python, longer ones with numpy: measured
#: on the host, 128 items took 10-15 us in Python and 17-19 us with numpy, 256 items
#: 25 us against 19 us. A 128-token request's lists are 1-16 long, and 128 for a
#: unified-KV layout's SWA ring rows (docker/config/prefill.yaml).
_SMALL_LIST = 192

#: What one item of a kind is, for messages.
NOUNS = {
    IndexKind.KV_PAGES: "pages",
    IndexKind.SWA_PAGES: "SWA pages",
    IndexKind.SWA_RING_ROWS: "ring rows",
    IndexKind.REQ_SLOT: "C4 state items",
    IndexKind.C128_STATE: "C128 state items",
}


def parse_key(key: str) -> tuple[str, IndexKind]:
    """``"KIND"`` or ``"target.KIND"`` -> ("target", kind); ``"draft.KIND"`` -> ("draft", kind)."""
    pool, _, name = key.rpartition(".")
    pool = pool or "target"
    if pool not in ("target", "draft"):
        raise BadIndexList(f"index list {key!r}: unknown pool {pool!r} (target or draft)",
                           side="request", kind="", pool=pool)
    try:
        return pool, IndexKind(name)
    except ValueError:
        known = ", ".join(k.value for k in IndexKind)
        raise BadIndexList(f"index list {key!r}: unknown index kind {name!r} (known: {known})",
                           side="request", kind="", pool=pool) from None


def split_mapping(lists: Mapping[str, ListLike]) -> tuple[Lists, Lists]:
    """A ``{"KIND" | "draft.KIND": indices}`` mapping as (target, draft) arrays by kind."""
    target: Lists = {}
    draft: Lists = {}
    for key, values in lists.items():
        pool, kind = parse_key(key)
        (draft if pool == "draft" else target)[kind] = _array(values, key)
    return target, draft


#: The list of a kind a layout does not use: shared, so read-only.
_NO_INDICES = np.zeros(0, dtype=np.int64)
_NO_INDICES.flags.writeable = False


def _array(values: ListLike, label: str, side: str = "request") -> npt.NDArray[np.int64]:
    if type(values) is np.ndarray and values.dtype == INT64 and values.ndim == 1:
        # What the engine channel's frames and the wire codec give: taken as it is (a
        # numpy call costs microseconds in a daemon, whatever the list's length).
        return values  # type: ignore[return-value]  # its dtype is int64: checked above
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise BadIndexList(f"{side}: index list {label}: a flat list of integers is needed "
                           f"(got {arr.dtype} of shape {arr.shape})", side=side, kind=label)
    return arr.astype(np.int64, copy=False)


class _Shape:
    """What validation reads from a layout, computed once per layout (a few per daemon).

    Walking ~180 buffers per kind on every request cost more than the checks.
    """

    def __init__(self, layout: SideLayout) -> None:
        self.layout = layout
        self.used = self._kinds(None)
        self.draft_used = self._kinds("draft")
        self._addressed: dict[tuple[str, IndexKind, bool], int] = {}

    def _kinds(self, pool: str | None) -> dict[IndexKind, list[int]]:
        """The kinds a pool's buffers use (every pool's when None), with each buffer's items."""
        out: dict[IndexKind, list[int]] = {}
        for comp in self.layout.components:
            if pool is None or comp.pool == pool:
                for buf in comp.buffers:
                    out.setdefault(buf.index_kind, []).append(buf.items)
        return {k: out[k] for k in INDEX_KINDS if k in out}  # IndexKind order, for messages

    def items(self, pool: str, kind: IndexKind, draft_has_kind: bool) -> int:
        """Items of the smallest buffer a ``pool`` list of ``kind`` addresses.

        A target list also addresses the draft's buffers of its kind unless the draft
        has its own list: it must fit every buffer it addresses.
        """
        key = (pool, kind, draft_has_kind)
        if key not in self._addressed:
            out: list[int] = []
            for comp in self.layout.components:
                own = comp.pool == "draft" and draft_has_kind
                if (pool == "draft") == own:
                    out += [b.items for b in comp.buffers if b.index_kind is kind]
            self._addressed[key] = min(out, default=np.iinfo(np.int64).max)
        return self._addressed[key]


_SHAPES: LayoutCache[_Shape] = LayoutCache()


def _shape(layout: SideLayout) -> _Shape:
    return _SHAPES.get(layout, None, lambda: _Shape(layout))


def validate(side: str, spec: PoolSpec, layout: SideLayout, target: Mapping[IndexKind, ListLike],
             draft: Mapping[IndexKind, ListLike], seq_len: int, *,
             shorter_pages: bool = False, shorter_why: str = "") -> tuple[Lists, Lists]:
    """Check an engine's lists for ``side``; return (target, draft) ready to plan with.

    The target lists come back with every :class:`IndexKind`, the kinds this layout
    does not use as empty lists (the wire carries all kinds). ``shorter_pages``
    lets page kinds be shorter than ``seq_len`` needs (decode holding a prefix);
    ``shorter_why`` says why it is not allowed when it is not.
    """
    shape = _shape(layout)
    used, draft_used = shape.used, shape.draft_used
    for kind in target:
        if kind not in used:
            raise BadIndexList(f"{side}: this layout has no {kind.value} buffers (it uses "
                               f"{', '.join(k.value for k in used)})", side=side, kind=kind.value)
    if draft and layout.draft is None:
        raise BadIndexList(f"{side}: draft {next(iter(draft)).value} list given, but this side "
                           "has no draft pool", side=side, kind=next(iter(draft)).value,
                           pool="draft")
    for kind in draft:
        if kind not in draft_used:
            raise BadIndexList(f"{side}: the draft pool has no {kind.value} buffers (it uses "
                               f"{', '.join(k.value for k in draft_used)})", side=side,
                               kind=kind.value, pool="draft")
    missing = [k.value for k in INDEX_KINDS if k in used and k not in target]
    if missing:
        raise BadIndexList(f"{side}: index lists missing for {', '.join(missing)}: give every "
                           "kind the layout uses, or none for slot-based lists",
                           side=side, kind=missing[0])
    want = expected_lengths(spec, seq_len)
    out_t: Lists = dict.fromkeys(INDEX_KINDS, _NO_INDICES)
    out_d: Lists = {}
    for pool, given, out in (("target", target, out_t), ("draft", draft, out_d)):
        for kind, values in given.items():
            items = shape.items(pool, kind, kind in draft)
            label = kind.value if pool == "target" else f"draft {kind.value}"
            arr = _array(values, label, side)
            _check(side, pool, kind, label, arr, want[kind], items, seq_len,
                   shorter_pages and kind not in EXACT_MATCH_KINDS, shorter_why)
            out[kind] = arr
    return out_t, out_d


def _check(side: str, pool: str, kind: IndexKind, label: str, arr: npt.NDArray[np.int64],
           want: int, items: int, seq_len: int, shorter: bool, shorter_why: str) -> None:
    n = len(arr)
    if n != want and not (shorter and n < want):
        why = (f" (a shorter {kind.value} list needs {shorter_why})"
               if n < want and shorter_why and kind not in EXACT_MATCH_KINDS else "")
        raise BadIndexList(f"{side}: {label} has {n} indices; {seq_len} tokens need "
                           f"{'at most ' if shorter else ''}{want}{why}",
                           side=side, kind=kind.value, pool=pool)
    if n == 0:
        return
    if n <= _SMALL_LIST:
        # A small request's lists: plain Python is 5-10x cheaper than the numpy calls
        # below (each costs about a microsecond whatever its length). Only the verdict
        # is taken here; a bad list falls through to find and name the first offender.
        values = arr.tolist()
        if min(values) >= 0 and max(values) < items and len(set(values)) == n:
            return
    bad = np.flatnonzero((arr < 0) | (arr >= items))
    if len(bad):
        pos = int(bad[0])
        raise BadIndexList(f"{side}: {label} index {int(arr[pos])} at position {pos} is out of "
                           f"range: the pool has {items} {NOUNS[kind]} (valid 0..{items - 1})",
                           side=side, kind=kind.value, pool=pool, position=pos,
                           index=int(arr[pos]))
    order = np.argsort(arr, kind="stable")
    ordered = arr[order]
    dup = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(dup):
        # The stable sort keeps equal values in list order: (earlier, later) pairs.
        first = int(np.argmin(order[dup + 1]))
        pos, earlier = int(order[dup[first] + 1]), int(order[dup[first]])
        raise BadIndexList(f"{side}: {label} index {int(arr[pos])} at position {pos} repeats "
                           f"position {earlier}", side=side, kind=kind.value, pool=pool,
                           position=pos, index=int(arr[pos]))


def validate_prefix(side: str, spec: PoolSpec, layout: SideLayout, kind: IndexKind,
                    arr: npt.NDArray[np.int64], seq_len: int) -> None:
    """Check the first ``len(arr)`` indices of a target ``kind`` list an engine gives in
    pieces (one per chunk): no more than ``seq_len`` needs, each in range, none twice.
    The whole lists are checked by :func:`validate` once the last piece came."""
    shape = _shape(layout)
    if kind not in shape.used:
        raise BadIndexList(f"{side}: this layout has no {kind.value} buffers (it uses "
                           f"{', '.join(k.value for k in shape.used)})", side=side,
                           kind=kind.value)
    _check(side, "target", kind, kind.value, arr, expected_lengths(spec, seq_len)[kind],
           shape.items("target", kind, False), seq_len, True, "")


def slot_lists(spec: PoolSpec, layout: SideLayout, slot: int, seq_len: int) -> Lists:
    """Request slot ``slot``'s items (:func:`~kvbeam.pools.indices.request_indices`) as
    an engine names its own: a list of each kind ``layout`` uses, no other. What a gRPC
    Send's ``source_slot`` stands for; validated as any lists are.

    Raises:
        PlanError: ``slot`` or ``seq_len`` out of range, naming the value and the range.
    """
    used = _shape(layout).used
    return {k: v for k, v in request_indices(spec, slot, seq_len).items() if k in used}


def same_lists(a: Mapping[IndexKind, npt.NDArray[np.int64]],
               b: Mapping[IndexKind, npt.NDArray[np.int64]]) -> bool:
    """True when two sets of lists name the same kinds with equal lists."""
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def check_kv_skip(side: str, spec: PoolSpec, layout: SideLayout, kv_skip: int, seq_len: int,
                  *, lists: bool) -> int | None:
    """Check a request's ``kv_skip`` (its leading KV pages decode holds, which prefill
    does not write) on ``side``; return how many KV pages are left to move (None for
    ``kv_skip`` 0: the whole request, nothing to check).

    It has a meaning only for lists that may name the request's tail (``lists``: decode's
    engine lists, not its slot-based ones, which are the whole request's; prefill's
    source lists always, since kv_skip picks their tail) on a layout of KV pages alone,
    without a draft pool: a state component, an SWA list or a ring (DSV4) holds what the
    whole prefix computed, and a draft's own lists are not the target's pages.
    At least one page must be left to move: a request decode holds whole is declined
    (DECLINE), not reserved.

    Raises:
        BadKvSkip: naming ``kv_skip``, its value and what it was checked against.
    """
    if kv_skip == 0:
        return None
    if kv_skip < 0:
        raise BadKvSkip(f"{side}: kv_skip {kv_skip}: a count of leading KV pages, not "
                        "negative")
    if not lists:
        raise BadKvSkip(f"{side}: kv_skip {kv_skip} needs the engine's index lists (its "
                        "KV_PAGES from position kv_skip on): slot-based lists address the "
                        "whole request")
    other = [k.value for k in _shape(layout).used if k is not IndexKind.KV_PAGES]
    if other or layout.draft is not None:
        what = (f"{', '.join(other)} buffers" if other else "") + (
            f"{' and ' if other else ''}a draft pool" if layout.draft is not None else "")
        raise BadKvSkip(f"{side}: kv_skip {kv_skip} is only for a layout of KV pages alone; "
                        f"this one has {what}, whose items hold what the whole prefix "
                        "computed: give kv_skip 0 (move the whole request)")
    pages = expected_lengths(spec, seq_len)[IndexKind.KV_PAGES]
    if kv_skip >= pages:
        raise BadKvSkip(f"{side}: kv_skip {kv_skip} leaves no KV page of the request's "
                        f"{pages} ({seq_len} tokens, {spec.page_size} per page) to move: at "
                        f"most {pages - 1}; a request decode holds whole is declined "
                        "(DECLINE), not reserved")
    return pages - kv_skip
