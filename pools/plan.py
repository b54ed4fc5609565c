"""Transfer plans: for every buffer of every component, the coalesced (src, dst, length) blocks.

A block covers one run of indices that is contiguous on BOTH sides, so a request
whose pages are adjacent on prefill and on decode moves as one large write. All
work is numpy array arithmetic; nothing loops per token or per index.

Example: source buffers at 1000 and 2000, destination buffers at 3000 and 4000,
item lengths 16 and 32, source indices [1, 2], destination indices [3, 4] give the
blocks (1016, 3048, 32) and (2032, 4096, 64).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

from kvbeam.errors import PlanError
from kvbeam.pools.layout import BufferLayout, SideLayout
from kvbeam.pools.types import EXACT_MATCH_KINDS, IndexKind
from kvbeam.transport.blocks import Blocks

IndexLists = Mapping[IndexKind, npt.NDArray[np.int64]]


def own_draft_list(draft: IndexLists | None, pool: str, kind: IndexKind) -> bool:
    """True when a ``pool`` buffer of ``kind`` is addressed by the draft's own list.

    The draft component uses the target's list of its kind unless the engine gave
    the draft a list of that kind (docs/indices.md).
    """
    return pool == "draft" and draft is not None and kind in draft


def list_for(indices: IndexLists, draft: IndexLists | None, pool: str,
             kind: IndexKind) -> npt.NDArray[np.int64]:
    """The list addressing a ``pool`` buffer of ``kind``: the draft's own, else the target's."""
    src = draft if draft is not None and own_draft_list(draft, pool, kind) else indices
    return np.asarray(src[kind], np.int64)


@dataclass(frozen=True)
class BufferPlan:
    """The blocks of one buffer: component position, buffer position within it, and name."""

    component: int
    buffer: int
    name: str
    items: int
    blocks: Blocks


@dataclass(frozen=True)
class TransferPlan:
    """Every buffer's blocks, in positional order."""

    buffers: tuple[BufferPlan, ...]

    # Cached: the send path reads these several times per request, and each used to
    # concatenate or sum per buffer (a cost that is 16-40x larger under TCG).
    @cached_property
    def blocks(self) -> Blocks:
        """All blocks of the plan as one batch (positional order)."""
        return Blocks.concat([b.blocks for b in self.buffers])

    @cached_property
    def total_bytes(self) -> int:
        """Bytes the plan moves."""
        return self.blocks.total_bytes

    @cached_property
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
    return (int(idx.min()), int(idx.max())) if len(idx) else (0, -1)


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
) -> TransferPlan:
    """Plan a request's transfer from ``src`` to ``dst``.

    ``*_addrs`` are the base addresses of each side's buffers, aligned with
    :attr:`SideLayout.flat_buffers`; ``*_indices`` are each side's index lists by
    kind (:func:`kvbeam.pools.indices.request_indices`). ``include_kv`` and
    ``include_states`` select the main KV component and the state components (a
    chunked send moves KV chunks first and the states with the last chunk).
    ``*_draft`` are the draft pool's own lists by kind, where an engine gave them
    (:func:`list_for`). Index lists may come in any order and be fragmented: each
    run contiguous on both sides becomes one block, so a shuffled list gives more,
    smaller blocks, each item still landing at its paired position.

    Everything is validated before any block is produced: component and buffer
    counts, item lengths, index ranges and index-list lengths.
    """
    src_bufs, dst_bufs = src.flat_buffers, dst.flat_buffers
    if len(src_addrs) != len(src_bufs) or len(dst_addrs) != len(dst_bufs):
        raise PlanError(
            f"address lists do not match the layouts: source {len(src_addrs)} addresses for "
            f"{len(src_bufs)} buffers, destination {len(dst_addrs)} for {len(dst_bufs)}"
        )
    if len(src.components) != len(dst.components):
        raise PlanError(
            f"component count differs: source {len(src.components)}, "
            f"destination {len(dst.components)}"
        )
    jobs: list[tuple[int, int, int, BufferLayout, BufferLayout, str]] = []
    flat = 0
    for ci, (sc, dc) in enumerate(zip(src.components, dst.components, strict=True)):
        if len(sc.buffers) != len(dc.buffers):
            raise PlanError(
                f"component {ci} ({sc.name}) buffer count differs: source {len(sc.buffers)}, "
                f"destination {len(dc.buffers)}"
            )
        wanted = include_kv if sc.state_type is None else include_states
        for bi, (sb, db) in enumerate(zip(sc.buffers, dc.buffers, strict=True)):
            if wanted:
                jobs.append((ci, bi, flat, sb, db, sc.pool))
            flat += 1
    # Validate everything first: a bad request must not produce half a plan.
    # Pairing, range bounds and runs depend only on the index kind: compute them once.
    # The key also says whether each side uses the draft's own list of the kind.
    per_kind: dict[tuple[IndexKind, bool, bool], tuple[Runs, int, int, int, int, int]] = {}
    keys: list[tuple[IndexKind, bool, bool]] = []
    for ci, _bi, _flat, sb, db, pool in jobs:
        if sb.item_len != db.item_len:
            raise PlanError(
                f"item length differs for {sb.name} (component {ci}): source {sb.item_len}, "
                f"destination {db.item_len}"
            )
        if sb.index_kind != db.index_kind:
            raise PlanError(
                f"index kind differs for {sb.name}: source {sb.index_kind.value}, "
                f"destination {db.index_kind.value}"
            )
        kind = sb.index_kind
        key = (kind, own_draft_list(src_draft, pool, kind), own_draft_list(dst_draft, pool, kind))
        keys.append(key)
        if key not in per_kind:
            s_idx, d_idx = _pair(kind, list_for(src_indices, src_draft, pool, kind),
                                 list_for(dst_indices, dst_draft, pool, kind), sb.name)
            runs = Runs.of(s_idx, d_idx)
            per_kind[key] = (runs, *_bounds(s_idx), *_bounds(d_idx), int(runs.count.sum()))
        _runs, s_lo, s_hi, d_lo, d_hi, _items = per_kind[key]
        _check_range(s_lo, s_hi, sb, "source")
        _check_range(d_lo, d_hi, db, "destination")
    # Byte offsets depend only on (index kind, item length): scale once, then each buffer
    # costs two additions (dozens of buffers share a handful of shapes).
    scaled: dict[tuple[tuple[IndexKind, bool, bool], int], tuple[npt.NDArray[np.uint64], ...]] = {}
    plans = []
    for (ci, bi, flat, sb, _db, _pool), key in zip(jobs, keys, strict=True):
        runs, *_, items = per_kind[key]
        skey = (key, sb.item_len)
        if skey not in scaled:
            item = np.uint64(sb.item_len)
            scaled[skey] = (runs.src_start * item, runs.dst_start * item, runs.count * item)
        s_off, d_off, lengths = scaled[skey]
        blocks = Blocks(np.uint64(src_addrs[flat]) + s_off, np.uint64(dst_addrs[flat]) + d_off,
                        lengths)
        plans.append(BufferPlan(ci, bi, sb.name, items, blocks))
    return TransferPlan(tuple(plans))
