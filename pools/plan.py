"""Transfer plans: for every buffer of every component, the coalesced (src, dst, length) blocks.

A block covers one run of indices that is contiguous on BOTH sides, so a request
whose pages are adjacent on prefill and on decode moves as one large write. All
work is numpy array arithmetic; nothing loops per token or per index.

Example: source buffers at 1000 and 2000, destination buffers at 3000 and 4000,
item lengths 16 and 32, source indices [1, 2], destination indices [3, 4] give the
blocks (1016, 3048, 32) and (2032, 4096, 64).

Paged pools at different tensor-parallel places (a prefill rank holding more KV heads
than the decode rank it writes) move a head window of each item
(:class:`~kvbeam.pools.paged.HeadWindow`): source bytes ``[page * item_s + off_s, + w)``
to destination bytes ``[page * item_d + off_d, + w)``, one block per page (pages do not
coalesce: the bytes between two windows are other heads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

from kvbeam.compiled import helper_line, load_helper
from kvbeam.errors import PlanError
from kvbeam.pools.indices import INT64
from kvbeam.pools.layout import BufferLayout, PoolGeometry, SideLayout
from kvbeam.pools.paged import HeadWindow, head_window
from kvbeam.pools.types import EXACT_MATCH_KINDS, IndexKind
from kvbeam.transport.blocks import Blocks

IndexLists = Mapping[IndexKind, npt.NDArray[np.int64]]

#: Index lists up to this long are scanned in plain Python (runs, bounds): each numpy
#: call costs a few microseconds, more than a short list's whole scan.
SHORT_LIST = 256
#: Plans of at most this many blocks are assembled in plain Python: a small request's
#: plan was a few dozen numpy calls per buffer group (355 us for a 128-token request
#: of docker/config/prefill.yaml, the largest single cost of its send step).
SMALL_PLAN_BLOCKS = 512


_PLANNER, _PLANNER_WHY = load_helper("kvbeam.pools._plan", "one call per plan",
                                     "Python and numpy")
#: Whether :func:`build_plan` uses the compiled planner: the Python and numpy paths
#: remain for where it was not built and as its oracle (tests switch this off).
COMPILED = _PLANNER is not None


def planner() -> str:
    """How this process builds plans: the compiled planner, or Python and numpy and why."""
    return helper_line(_PLANNER, _PLANNER_WHY, COMPILED, "Python and numpy")


def own_draft_list(draft: IndexLists | None, pool: str, kind: IndexKind) -> bool:
    """True when a ``pool`` buffer of ``kind`` is addressed by the draft's own list.

    The draft component uses the target's list of its kind unless the engine gave
    the draft a list of that kind (docs/indices.md).
    """
    return pool == "draft" and draft is not None and kind in draft


def list_for(indices: IndexLists, draft: IndexLists | None, pool: str,
             kind: IndexKind) -> npt.NDArray[np.int64]:
    """The list addressing a ``pool`` buffer of ``kind``: the draft's own, else the target's."""
    # ``draft`` is most often empty (no draft component): no call to find it has no list.
    src = draft if draft and own_draft_list(draft, pool, kind) else indices
    arr = src[kind]
    if type(arr) is np.ndarray and arr.dtype == INT64:  # the usual case: no numpy call
        return arr
    return np.asarray(arr, np.int64)


@dataclass(frozen=True)
class BufferPlan:
    """The blocks of one buffer: component position, buffer position within it, and name."""

    component: int
    buffer: int
    name: str
    items: int
    blocks: Blocks


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Every buffer's blocks, in positional order.

    ``blocks`` holds all of them as one batch; planned buffer ``i`` is
    ``heads[i]`` (component, buffer position, name), moves ``items[i]`` items and
    owns ``blocks[starts[i]:starts[i + 1]]``. The per-buffer view (:attr:`buffers`)
    is built only when asked for: the send path reads the whole batch, and a
    request plans ~180 buffers.
    """

    blocks: Blocks
    heads: tuple[tuple[int, int, str], ...]
    items: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]

    @cached_property
    def buffers(self) -> tuple[BufferPlan, ...]:
        """Each planned buffer's blocks (views of :attr:`blocks`), in positional order."""
        b, at = self.blocks, self.starts.tolist()
        return tuple(BufferPlan(ci, bi, name, items, b.slice(lo, hi))
                     for (ci, bi, name), items, lo, hi in zip(
                         self.heads, self.items.tolist(), at[:-1], at[1:], strict=True))

    @cached_property
    def total_bytes(self) -> int:
        """Bytes the plan moves."""
        return self.blocks.total_bytes

    @property
    def num_blocks(self) -> int:
        """Number of blocks (write work requests before slicing)."""
        return len(self.blocks)


@dataclass(frozen=True)
class Runs:
    """Runs of index pairs contiguous on both sides: start item on each side and length in items.

    Runs depend only on the index lists, not on the buffer, so a plan computes them
    once per index kind and reuses them for every buffer of that kind.
    """

    src_start: npt.NDArray[np.uint64]
    dst_start: npt.NDArray[np.uint64]
    count: npt.NDArray[np.uint64]

    @classmethod
    def of(cls, src_idx: npt.NDArray[np.int64], dst_idx: npt.NDArray[np.int64]) -> Runs:
        """Find the runs of paired index lists (same length)."""
        n = len(src_idx)
        if n == 0:
            z = np.zeros(0, dtype=np.uint64)
            return cls(z, z, z)
        if n <= SHORT_LIST:
            s, d = src_idx.tolist(), dst_idx.tolist()
            s_start, d_start, count = [s[0]], [d[0]], []
            run = 1
            for i in range(1, n):
                if s[i] == s[i - 1] + 1 and d[i] == d[i - 1] + 1:
                    run += 1
                else:
                    count.append(run)
                    s_start.append(s[i])
                    d_start.append(d[i])
                    run = 1
            count.append(run)
            # Through int64, as the vectorised path: a negative index wraps the same way
            # (the range check that follows refuses it).
            return cls(np.array(s_start, dtype=np.int64).astype(np.uint64),
                       np.array(d_start, dtype=np.int64).astype(np.uint64),
                       np.array(count, dtype=np.uint64))
        breaks = (np.diff(src_idx) != 1) | (np.diff(dst_idx) != 1)
        starts = np.flatnonzero(np.concatenate(([True], breaks)))
        runs = np.diff(np.append(starts, n))
        return cls(src_idx[starts].astype(np.uint64), dst_idx[starts].astype(np.uint64),
                   runs.astype(np.uint64))

    def blocks(self, src_base: int, dst_base: int, item_len: int) -> Blocks:
        """The runs as blocks of a buffer pair with the given bases and item length."""
        item = np.uint64(item_len)
        return Blocks(np.uint64(src_base) + self.src_start * item,
                      np.uint64(dst_base) + self.dst_start * item, self.count * item)


def coalesce(
    src_base: int,
    dst_base: int,
    item_len: int,
    src_idx: npt.NDArray[np.int64],
    dst_idx: npt.NDArray[np.int64],
) -> Blocks:
    """Blocks for paired index lists: one block per run contiguous on both sides."""
    return Runs.of(src_idx, dst_idx).blocks(src_base, dst_base, item_len)


def _bounds(idx: npt.NDArray[np.int64]) -> tuple[int, int]:
    """(min, max) of an index list; (0, -1) when empty so every range check passes."""
    if len(idx) <= SHORT_LIST:
        items = idx.tolist()
        return (min(items), max(items)) if items else (0, -1)
    return int(idx.min()), int(idx.max())


def _check_range(lo: int, hi: int, buf: BufferLayout, side: str) -> None:
    if lo < 0 or hi >= buf.items:
        bad = lo if lo < 0 else hi
        raise PlanError(
            f"{side} index {bad} out of range for buffer {buf.name} "
            f"({buf.items} items of {buf.item_len} bytes; valid 0..{buf.items - 1})"
        )


def _pair(
    kind: IndexKind, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64], name: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    if len(src) == len(dst):
        return src, dst
    if kind in EXACT_MATCH_KINDS:
        raise PlanError(
            f"index lists differ in length for {name} ({kind.value} needs an exact match): "
            f"source {len(src)}, destination {len(dst)}"
        )
    if len(dst) > len(src):
        raise PlanError(
            f"destination has more {kind.value} indices than the source for {name}: "
            f"source {len(src)}, destination {len(dst)}"
        )
    # Decode's prefix cache already holds the head of the request: send the tail.
    return src[len(src) - len(dst):], dst


def pair_index_lists(src: IndexLists, dst: IndexLists) -> tuple[
        dict[IndexKind, npt.NDArray[np.int64]], dict[IndexKind, npt.NDArray[np.int64]]]:
    """Pair each kind's source and destination lists the way :func:`build_plan` does.

    Returns the lists actually moved (the source's tail where decode holds a prefix);
    raises PlanError on a length mismatch.
    """
    s_out: dict[IndexKind, npt.NDArray[np.int64]] = {}
    d_out: dict[IndexKind, npt.NDArray[np.int64]] = {}
    for kind in src:
        s_out[kind], d_out[kind] = _pair(kind, np.asarray(src[kind], np.int64),
                                         np.asarray(dst[kind], np.int64), kind.value)
    return s_out, d_out


_Key = tuple[IndexKind, bool, bool]  # index kind; each side uses the draft's own list of it


@dataclass(frozen=True)
class _Shape:
    """What planning a layout pair needs beyond the index lists, computed once per pair.

    Jobs are the selected buffers in positional order. Everything here depends only
    on the two layouts, the component selection and which kinds each side's draft
    list has, so the send path reuses it for every request to the same peer.
    """

    src: SideLayout  # held so the ids in the cache key stay theirs
    dst: SideLayout
    n_flat: tuple[int, int]  # buffers on each side (what the address lists must match)
    jobs: tuple[tuple[int, int, BufferLayout, BufferLayout, str], ...]  # ci, bi, sb, db, pool
    heads: tuple[tuple[int, int, str], ...]  # ci, bi, name of each job
    flat: npt.NDArray[np.intp]  # each job's position in flat_buffers
    src_items: npt.NDArray[np.int64]
    dst_items: npt.NDArray[np.int64]
    key_of: npt.NDArray[np.intp]  # each job's position in ``keys``
    keys: tuple[_Key, ...]  # in order of first use
    first_job: tuple[int, ...]  # the first job of each key
    # (key pos, source item_len, destination item_len, head window or None: whole items)
    groups: tuple[tuple[int, int, int, HeadWindow | None, npt.NDArray[np.intp]], ...]
    windowed: npt.NDArray[np.bool_]  # each job moves a head window (one block per page)
    broken: tuple[int, str] | None  # the first job whose two sides disagree, and why

    @cached_property
    def job_table(self) -> npt.NDArray[np.int64]:
        """The jobs as the compiled planner reads them (pools/_plan.c): per job its flat
        position, key, item counts and lengths on each side, whether it moves a head
        window, and the window's offsets and width."""
        table = np.zeros((len(self.jobs), 10), dtype=np.int64)
        for key_pos, src_item, dst_item, window, jobs in self.groups:
            row = [0, key_pos, 0, 0, src_item, dst_item, window is not None,
                   *((window.src_offset, window.dst_offset, window.width) if window
                     else (0, 0, 0))]
            table[jobs] = row
        table[:, 0] = self.flat
        table[:, 2] = self.src_items
        table[:, 3] = self.dst_items
        return table

    @cached_property
    def key_heads(self) -> tuple[tuple[IndexKind, str, str], ...]:
        """Each key's kind, and the pool and buffer name of its first job (what pairing
        its lists needs and names in an error)."""
        return tuple((kind, self.jobs[j][4], self.jobs[j][2].name)
                     for (kind, _, _), j in zip(self.keys, self.first_job, strict=True))

    @cached_property
    def lists(self) -> _ShapeLists:
        """The arrays as Python lists (the path of small plans and short lists)."""
        return _ShapeLists(self.flat.tolist(), self.key_of.tolist(), self.src_items.tolist(),
                           self.dst_items.tolist(), self.windowed.tolist(),
                           [(k, ns, nd, w, js.tolist()) for k, ns, nd, w, js in self.groups])


@dataclass(frozen=True)
class _ShapeLists:
    """A :class:`_Shape`'s arrays as Python lists."""

    flat: list[int]
    key_of: list[int]
    src_items: list[int]
    dst_items: list[int]
    windowed: list[bool]
    groups: list[tuple[int, int, int, HeadWindow | None, list[int]]]


_SHAPES: dict[tuple[object, ...], _Shape] = {}
_SHAPES_MAX = 64  # distinct (peer layout, selection) pairs: a handful per daemon


def _draft_kinds(draft: IndexLists | None) -> frozenset[IndexKind] | None:
    return None if draft is None else frozenset(draft)


def tp_windows(src: PoolGeometry, dst: PoolGeometry) -> bool:
    """True when two target pools are paged at different tensor-parallel places, so their
    KV buffers pair by head window (:func:`buffer_window`) rather than whole items."""
    return src.kind == dst.kind == "paged" and (src.tp_size, src.tp_rank) != (dst.tp_size,
                                                                              dst.tp_rank)


def buffer_window(src: SideLayout, dst: SideLayout, sb: BufferLayout,
                  db: BufferLayout) -> HeadWindow | None:
    """The head window a KV buffer pair moves, or None when it moves whole items.

    Raises:
        PlanError: the two blocks hold different bytes per head, or no head in common.
    """
    if not tp_windows(src.target, dst.target):
        return None
    s, d = src.target, dst.target
    try:
        window = head_window(s.tp_rank, s.num_kv_heads, sb.item_len, d.tp_rank,
                             d.num_kv_heads, db.item_len)
    except ValueError as exc:
        raise PlanError(f"{sb.name}: {exc}") from None
    return None if window.whole(sb.item_len, db.item_len) else window


def side_windows(side: SideLayout, peer: SideLayout, *, source: bool
                 ) -> tuple[tuple[int, int] | None, ...]:
    """Per flat buffer of ``side``: the (offset, width) of each item it moves to or from
    ``peer``, or None for the whole item; what its digests cover (``source``: ``side``
    writes to ``peer``, else ``peer`` writes to ``side``).

    Raises:
        PlanError: as :func:`buffer_window` (the handshake refused such a pair already).
    """
    src, dst = (side, peer) if source else (peer, side)
    if not tp_windows(src.target, dst.target):
        return (None,) * len(side.flat_buffers)
    out: list[tuple[int, int] | None] = []
    for sb, db in zip(src.flat_buffers, dst.flat_buffers, strict=False):
        window = buffer_window(src, dst, sb, db)
        if window is None:
            out.append(None)
        else:
            out.append((window.src_offset if source else window.dst_offset, window.width))
    out.extend([None] * (len(side.flat_buffers) - len(out)))
    return tuple(out)


def _mismatch(ci: int, sb: BufferLayout, db: BufferLayout, windowed: bool) -> str | None:
    if sb.item_len != db.item_len and not windowed:
        return (f"item length differs for {sb.name} (component {ci}): source {sb.item_len}, "
                f"destination {db.item_len}")
    if sb.index_kind != db.index_kind:
        return (f"index kind differs for {sb.name}: source {sb.index_kind.value}, "
                f"destination {db.index_kind.value}")
    return None


def _cached(key: tuple[object, ...], src: SideLayout, dst: SideLayout) -> _Shape | None:
    hit = _SHAPES.get(key)
    return hit if hit is not None and hit.src is src and hit.dst is dst else None


def _shape(key: tuple[object, ...], src: SideLayout, dst: SideLayout, include_kv: bool,
           include_states: bool, src_draft: IndexLists | None,
           dst_draft: IndexLists | None, layers: tuple[int, int] | None) -> _Shape:
    if len(src.components) != len(dst.components):
        raise PlanError(
            f"component count differs: source {len(src.components)}, "
            f"destination {len(dst.components)}"
        )
    jobs: list[tuple[int, int, BufferLayout, BufferLayout, str]] = []
    flat_pos: list[int] = []
    sc_is_kv: list[bool] = []
    flat = 0
    for ci, (sc, dc) in enumerate(zip(src.components, dst.components, strict=True)):
        if len(sc.buffers) != len(dc.buffers):
            raise PlanError(
                f"component {ci} ({sc.name}) buffer count differs: source {len(sc.buffers)}, "
                f"destination {len(dc.buffers)}"
            )
        wanted = include_kv if sc.state_type is None else include_states
        in_layers = (src.kv_layers if layers is not None and sc.state_type is None
                     else None)
        for bi, (sb, db) in enumerate(zip(sc.buffers, dc.buffers, strict=True)):
            if wanted and (in_layers is None or layers is None
                           or layers[0] <= in_layers[bi] < layers[1]):
                jobs.append((ci, bi, sb, db, sc.pool))
                flat_pos.append(flat)
                sc_is_kv.append(sc.state_type is None)
            flat += 1
    broken: tuple[int, str] | None = None
    keys: dict[_Key, int] = {}
    first_job: list[int] = []
    key_of: list[int] = []
    windowed: list[bool] = []
    by_group: dict[tuple[int, int, int, HeadWindow | None], list[int]] = {}
    for j, (ci, _bi, sb, db, pool) in enumerate(jobs):
        window: HeadWindow | None = None
        why: str | None = None
        if sc_is_kv[j]:
            try:
                window = buffer_window(src, dst, sb, db)
            except PlanError as exc:
                why = str(exc)
        windowed.append(window is not None)
        by_heads = sc_is_kv[j] and tp_windows(src.target, dst.target)
        why = why or _mismatch(ci, sb, db, by_heads)
        if why is not None and broken is None:
            broken = (j, why)
        kind = sb.index_kind
        kk = (kind, own_draft_list(src_draft, pool, kind), own_draft_list(dst_draft, pool, kind))
        if kk not in keys:
            keys[kk] = len(keys)
            first_job.append(j)
        key_of.append(keys[kk])
        by_group.setdefault((keys[kk], sb.item_len, db.item_len, window), []).append(j)
    shape = _Shape(
        src, dst, (len(src.flat_buffers), len(dst.flat_buffers)), tuple(jobs),
        tuple((ci, bi, sb.name) for ci, bi, sb, _, _ in jobs), np.array(flat_pos, dtype=np.intp),
        np.array([sb.items for _, _, sb, _, _ in jobs], dtype=np.int64),
        np.array([db.items for _, _, _, db, _ in jobs], dtype=np.int64),
        np.array(key_of, dtype=np.intp), tuple(keys), tuple(first_job),
        tuple((k, ns, nd, w, np.array(js, dtype=np.intp))
              for (k, ns, nd, w), js in by_group.items()),
        np.array(windowed, dtype=np.bool_), broken)
    if len(_SHAPES) >= _SHAPES_MAX:
        _SHAPES.clear()
    _SHAPES[key] = shape
    return shape


def _first_error(shape: _Shape, src_indices: IndexLists, dst_indices: IndexLists,
                 src_draft: IndexLists | None, dst_draft: IndexLists | None
                 ) -> tuple[list[Runs], list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]]:
    """Pair each key's lists and check every job's index range; raise the first error.

    "First" is what a buffer-by-buffer check in positional order would hit first: a
    job's side mismatch, then its key's pairing (at the key's first job), then its
    source range, then its destination range. Returns each key's runs and paired lists.
    """
    errors: list[tuple[int, int, BaseException | None]] = []  # (job, rank, error)
    if shape.broken is not None:
        errors.append((shape.broken[0], 0, PlanError(shape.broken[1])))
    runs: list[Runs] = []
    pairs: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = []
    bounds: list[tuple[int, int, int, int]] = []
    for pos, (kind, _, _) in enumerate(shape.keys):
        j = shape.first_job[pos]
        if errors and errors[0][0] <= j:
            break  # every later key starts after the error already found
        _ci, _bi, sb, _db, pool = shape.jobs[j]
        try:
            s_idx, d_idx = _pair(kind, list_for(src_indices, src_draft, pool, kind),
                                 list_for(dst_indices, dst_draft, pool, kind), sb.name)
        except (PlanError, KeyError) as exc:
            errors.append((j, 1, exc))
            break
        runs.append(Runs.of(s_idx, d_idx))
        pairs.append((s_idx, d_idx))
        bounds.append((*_bounds(s_idx), *_bounds(d_idx)))
    # Range checks: a key's bounds against each job's item count (vectorised over the
    # jobs, or a plain loop over a few dozen).
    n = len(runs)
    if n and len(shape.jobs) <= SHORT_LIST:
        lists = shape.lists
        for j, k in enumerate(lists.key_of):
            if k >= n:
                continue
            s_lo, s_hi, d_lo, d_hi = bounds[k]
            if s_lo < 0 or s_hi >= lists.src_items[j]:
                errors.append((j, 2, None))
                break
            if d_lo < 0 or d_hi >= lists.dst_items[j]:
                errors.append((j, 3, None))
                break
    elif n:
        lo = np.array(bounds, dtype=np.int64).reshape(n, 4)
        usable = shape.key_of < n
        ks = np.where(usable, shape.key_of, 0)
        bad_src = usable & ((lo[ks, 0] < 0) | (lo[ks, 1] >= shape.src_items))
        bad_dst = usable & ((lo[ks, 2] < 0) | (lo[ks, 3] >= shape.dst_items))
        bad = np.flatnonzero(bad_src | bad_dst)
        if len(bad):
            j = int(bad[0])
            errors.append((j, 2 if bad_src[j] else 3, None))
    if errors:
        j, rank, first = min(errors, key=lambda e: (e[0], e[1]))
        if first is not None:
            raise first
        _ci, _bi, sb, db, _pool = shape.jobs[j]
        s_lo, s_hi, d_lo, d_hi = bounds[int(shape.key_of[j])]
        if rank == 2:
            _check_range(s_lo, s_hi, sb, "source")
        _check_range(d_lo, d_hi, db, "destination")
    return runs, pairs


def _blocks(shape: _Shape, runs: list[Runs],
            pairs: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]) -> int:
    """How many blocks the plan has: each job's key's runs, or its items for a job that
    moves a head window (one block per item)."""
    lists = shape.lists
    return sum(len(pairs[k][0]) if w else len(runs[k].count)
               for k, w in zip(lists.key_of, lists.windowed, strict=True))


def _small_plan(shape: _Shape, runs: list[Runs],
                pairs: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]],
                src_addrs: Sequence[int], dst_addrs: Sequence[int]) -> TransferPlan:
    """:func:`build_plan`'s blocks for a small plan (checked lists), assembled in plain
    Python: the same blocks in the same order as the vectorised path, which tests
    compare on random requests."""
    lists = shape.lists
    flat, key_of = lists.flat, lists.key_of
    per_job: list[tuple[list[int], list[int], list[int]]] = [([], [], [])] * len(flat)
    for key_pos, src_item, dst_item, window, jobs in lists.groups:
        if window is None:  # whole items (src_item == dst_item): runs coalesce
            r = runs[key_pos]
            s_off = [i * src_item for i in r.src_start.tolist()]
            d_off = [i * src_item for i in r.dst_start.tolist()]
            lengths = [c * src_item for c in r.count.tolist()]
        else:  # a head window of every page: one block each
            s_idx, d_idx = pairs[key_pos]
            s_off = [i * src_item + window.src_offset for i in s_idx.tolist()]
            d_off = [i * dst_item + window.dst_offset for i in d_idx.tolist()]
            lengths = [window.width] * len(s_off)
        for j in jobs:
            s_base, d_base = src_addrs[flat[j]], dst_addrs[flat[j]]
            per_job[j] = ([s_base + o for o in s_off], [d_base + o for o in d_off], lengths)
    out_src: list[int] = []
    out_dst: list[int] = []
    out_len: list[int] = []
    starts = [0]
    for s_list, d_list, lengths in per_job:
        out_src += s_list
        out_dst += d_list
        out_len += lengths
        starts.append(len(out_src))
    key_items = [int(r.count.sum()) for r in runs]
    return TransferPlan(Blocks(np.array(out_src, dtype=np.uint64),
                               np.array(out_dst, dtype=np.uint64),
                               np.array(out_len, dtype=np.uint64)),
                        shape.heads, np.array([key_items[k] for k in key_of], dtype=np.int64),
                        np.array(starts, dtype=np.int64))


def _compiled_plan(shape: _Shape, src_indices: IndexLists, dst_indices: IndexLists,
                   src_draft: IndexLists | None, dst_draft: IndexLists | None,
                   src_addrs: Sequence[int], dst_addrs: Sequence[int]) -> TransferPlan | None:
    """:func:`build_plan`'s plan from the compiled planner; None when a list is refused
    (a length, a missing kind, an index outside its buffer) or not contiguous: the
    Python checks then name the first error in positional order."""
    try:
        pairs = [_pair(kind, list_for(src_indices, src_draft, pool, kind),
                       list_for(dst_indices, dst_draft, pool, kind), name)
                 for kind, pool, name in shape.key_heads]
        out = _PLANNER.plan_blocks(pairs, shape.job_table, src_addrs, dst_addrs)
    except (PlanError, KeyError, BufferError):
        return None
    if out is None:
        return None
    blocks, meta = out
    n, jobs = len(blocks) // 24, len(shape.jobs)
    arr = np.frombuffer(blocks, dtype=np.uint64)
    head = np.frombuffer(meta, dtype=np.int64)
    return TransferPlan(Blocks(arr[:n], arr[n:2 * n], arr[2 * n:]), shape.heads,
                        head[jobs + 1:], head[:jobs + 1])


def build_plan(
    src: SideLayout,
    src_addrs: Sequence[int],
    src_indices: IndexLists,
    dst: SideLayout,
    dst_addrs: Sequence[int],
    dst_indices: IndexLists,
    *,
    include_kv: bool = True,
    include_states: bool = True,
    src_draft: IndexLists | None = None,
    dst_draft: IndexLists | None = None,
    layers: tuple[int, int] | None = None,
) -> TransferPlan:
    """Plan a request's transfer from ``src`` to ``dst``.

    ``*_addrs`` are the base addresses of each side's buffers, aligned with
    :attr:`SideLayout.flat_buffers`; ``*_indices`` are each side's index lists by
    kind (:func:`kvbeam.pools.indices.request_indices`). ``include_kv`` and
    ``include_states`` select the main KV component and the state components (a
    chunked send moves KV chunks first and the states with the last chunk).
    ``*_draft`` are the draft pool's own lists by kind, where an engine gave them
    (:func:`list_for`). ``layers`` ``(lo, hi)`` keeps the main KV buffers of the
    source's layers ``lo..hi-1`` only (:attr:`SideLayout.kv_layers`; a piece of a
    request ready in some layers, docs/protocol.md), None every layer. Index lists may
    come in any order and be fragmented: each
    run contiguous on both sides becomes one block, so a shuffled list gives more,
    smaller blocks, each item still landing at its paired position.

    Everything is validated before any block is produced: component and buffer
    counts, item lengths, index ranges and index-list lengths.
    """
    key = (id(src), id(dst), include_kv, include_states, _draft_kinds(src_draft),
           _draft_kinds(dst_draft), layers)
    shape = _cached(key, src, dst)
    n_src, n_dst = shape.n_flat if shape else (len(src.flat_buffers), len(dst.flat_buffers))
    if len(src_addrs) != n_src or len(dst_addrs) != n_dst:
        raise PlanError(
            f"address lists do not match the layouts: source {len(src_addrs)} addresses for "
            f"{n_src} buffers, destination {len(dst_addrs)} for {n_dst}"
        )
    if shape is None:
        shape = _shape(key, src, dst, include_kv, include_states, src_draft, dst_draft,
                       layers)
    if COMPILED and shape.broken is None:
        plan = _compiled_plan(shape, src_indices, dst_indices, src_draft, dst_draft,
                              src_addrs, dst_addrs)
        if plan is not None:
            return plan
    runs, pairs = _first_error(shape, src_indices, dst_indices, src_draft, dst_draft)
    if len(shape.jobs) <= SHORT_LIST and _blocks(shape, runs, pairs) <= SMALL_PLAN_BLOCKS:
        return _small_plan(shape, runs, pairs, src_addrs, dst_addrs)
    # Blocks: runs depend only on the index kind and byte offsets on (kind, item lengths,
    # window), so each group of buffers sharing them is one broadcast of the runs (of the
    # pages, for a head window) over the buffers' base addresses, scattered into the
    # plan's positional order.
    per_key = np.array([len(r.count) for r in runs], dtype=np.int64)
    items = np.array([int(r.count.sum()) for r in runs], dtype=np.int64)
    per_job = (np.where(shape.windowed, items[shape.key_of], per_key[shape.key_of])
               if len(runs) else np.zeros(0, dtype=np.int64))
    starts = np.zeros(len(per_job) + 1, dtype=np.int64)
    np.cumsum(per_job, out=starts[1:])
    total = int(starts[-1])
    out_src = np.empty(total, dtype=np.uint64)
    out_dst = np.empty(total, dtype=np.uint64)
    out_len = np.empty(total, dtype=np.uint64)
    s_base = np.array(src_addrs, dtype=np.uint64)[shape.flat]
    d_base = np.array(dst_addrs, dtype=np.uint64)[shape.flat]
    for key_pos, src_item, dst_item, window, jobs in shape.groups:
        if window is None:  # whole items (src_item == dst_item): runs coalesce
            r = runs[key_pos]
            item = np.uint64(src_item)
            s_off, d_off, lengths = r.src_start * item, r.dst_start * item, r.count * item
        else:  # a head window of every page: one block each
            s_idx, d_idx = pairs[key_pos]
            s_off = s_idx.astype(np.uint64) * np.uint64(src_item) + np.uint64(window.src_offset)
            d_off = d_idx.astype(np.uint64) * np.uint64(dst_item) + np.uint64(window.dst_offset)
            lengths = np.full(len(s_idx), window.width, dtype=np.uint64)
        width = len(lengths)
        if width == 0:
            continue
        at = (starts[jobs][:, None] + np.arange(width, dtype=np.int64)).ravel()
        out_src[at] = (s_base[jobs][:, None] + s_off).ravel()
        out_dst[at] = (d_base[jobs][:, None] + d_off).ravel()
        out_len[at] = np.broadcast_to(lengths, (len(jobs), width)).ravel()
    job_items = items[shape.key_of] if len(runs) else np.zeros(0, dtype=np.int64)
    return TransferPlan(Blocks(out_src, out_dst, out_len), shape.heads, job_items, starts)
