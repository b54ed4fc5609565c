"""The vectorised planner against the buffer-by-buffer loop it replaced (hypothesis).

Each of its paths: the compiled planner (pools/_plan.c), numpy throughout, and plain
Python for short lists and small plans (``SHORT_LIST``, ``SMALL_PLAN_BLOCKS``), each
forced for a whole run of examples.

``_loop_plan`` is the planner as it was before the buffers of a kind were planned in
one broadcast step: each buffer validated and planned in positional order. On random
index lists (slot-contiguous and engine-fragmented, paged and unified DSV4 layouts,
with and without a draft and its own lists, some of them invalid) both must give the
same blocks, byte for byte, or the same error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import cache
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbeam.errors import PlanError
from kvbeam.pools import plan as plan_module
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.plan import (
    IndexLists,
    Runs,
    _bounds,
    _check_range,
    _pair,
    build_plan,
    list_for,
    own_draft_list,
)
from kvbeam.pools.types import IndexKind
from kvbeam.transport.blocks import Blocks
from tests.fixtures import PAGED_TARGET, UNIFIED_TARGET, layout
from tests.unit.test_paged_tp import layout as tp_layout

Planned = list[tuple[int, int, str, int, Blocks]]


def _loop_plan(src: SideLayout, src_addrs: list[int], src_indices: IndexLists,
               dst: SideLayout, dst_addrs: list[int], dst_indices: IndexLists, *,
               include_kv: bool, include_states: bool, src_draft: IndexLists | None,
               dst_draft: IndexLists | None) -> Planned:
    """The former build_plan: one buffer at a time (the oracle)."""
    if len(src_addrs) != len(src.flat_buffers) or len(dst_addrs) != len(dst.flat_buffers):
        raise PlanError("address lists do not match the layouts")
    if len(src.components) != len(dst.components):
        raise PlanError("component count differs")
    jobs = []
    flat = 0
    for ci, (sc, dc) in enumerate(zip(src.components, dst.components, strict=True)):
        if len(sc.buffers) != len(dc.buffers):
            raise PlanError(f"component {ci} ({sc.name}) buffer count differs")
        wanted = include_kv if sc.state_type is None else include_states
        for bi, (sb, db) in enumerate(zip(sc.buffers, dc.buffers, strict=True)):
            if wanted:
                jobs.append((ci, bi, flat, sb, db, sc.pool))
            flat += 1
    per_key: dict[Any, Any] = {}
    for ci, _bi, _flat, sb, db, pool in jobs:
        if sb.item_len != db.item_len:
            raise PlanError(f"item length differs for {sb.name} (component {ci}): source "
                            f"{sb.item_len}, destination {db.item_len}")
        if sb.index_kind != db.index_kind:
            raise PlanError(f"index kind differs for {sb.name}: source "
                            f"{sb.index_kind.value}, destination {db.index_kind.value}")
        kind = sb.index_kind
        key = (kind, own_draft_list(src_draft, pool, kind), own_draft_list(dst_draft, pool, kind))
        if key not in per_key:
            s_idx, d_idx = _pair(kind, list_for(src_indices, src_draft, pool, kind),
                                 list_for(dst_indices, dst_draft, pool, kind), sb.name)
            per_key[key] = (Runs.of(s_idx, d_idx), _bounds(s_idx), _bounds(d_idx))
        _runs, s_b, d_b = per_key[key]
        _check_range(s_b[0], s_b[1], sb, "source")
        _check_range(d_b[0], d_b[1], db, "destination")
    out: Planned = []
    for ci, bi, flat, sb, _db, pool in jobs:
        kind = sb.index_kind
        runs = per_key[(kind, own_draft_list(src_draft, pool, kind),
                        own_draft_list(dst_draft, pool, kind))][0]
        out.append((ci, bi, sb.name, int(runs.count.sum()),
                    runs.blocks(src_addrs[flat], dst_addrs[flat], sb.item_len)))
    return out


SPECS = [UNIFIED_TARGET, PAGED_TARGET, replace(UNIFIED_TARGET, compression_ratios=(128, 4, 0)),
         replace(PAGED_TARGET, compression_ratios=(4, 128, 0, 4), online_c128=True)]


@cache
def _layout(spec_i: int, draft: bool, slots: int, head_dim: int) -> SideLayout:
    # Cached: the planner caches per layout pair, so examples reuse the same objects.
    spec = replace(SPECS[spec_i], num_req_slots=slots, head_dim=head_dim)
    return layout(spec, replace(spec, compression_ratios=(0,)) if draft else None)


def _addrs(lay: SideLayout, base: int) -> list[int]:
    starts = np.cumsum([0] + [t.nbytes for t in lay.tensors])
    return [base + int(starts[b.tensor]) + b.offset for b in lay.flat_buffers]


def _capacity(lay: SideLayout, kind: IndexKind, pool: str | None = None) -> int | None:
    """Items every buffer of ``kind`` holds; None when no buffer uses the kind."""
    return min((b.items for c in lay.components for b in c.buffers
                if b.index_kind is kind and (pool is None or c.pool == pool)), default=None)


def _fragment(rng: np.random.Generator, lay: SideLayout, lists: IndexLists,
              pool: str | None = None) -> dict[IndexKind, np.ndarray]:
    """Engine-chosen lists: same lengths, distinct items anywhere in the buffers, any order."""
    out = {}
    for kind, idx in lists.items():
        cap = _capacity(lay, kind, pool)
        if cap is None:
            out[kind] = idx
            continue
        out[kind] = rng.choice(cap, size=min(len(idx), cap), replace=False).astype(np.int64)
    return out


def _break(rng: np.random.Generator, lists: dict[IndexKind, np.ndarray], how: int) -> None:
    kinds = [k for k, v in lists.items() if len(v)]
    if not kinds:
        return
    kind = kinds[int(rng.integers(len(kinds)))]
    v = lists[kind].copy()
    if how == 1:
        v[int(rng.integers(len(v)))] = 1 << 30  # out of range
    elif how == 2:
        v[int(rng.integers(len(v)))] = -1
    else:
        v = v[1:] if how == 3 else np.append(v, v[-1] + 1)  # a length mismatch
    lists[kind] = v


#: The planner's paths: (COMPILED, SHORT_LIST, SMALL_PLAN_BLOCKS) that force each (the
#: compiled one falls back to the others for an error's message: numpy's, forced).
PATHS = {"compiled": (True, 0, 0), "numpy": (False, 0, 0),
         "python": (False, 1 << 30, 1 << 30)}


@contextmanager
def forced(name: str) -> Iterator[None]:
    """The planner's path ``name`` for the block."""
    saved = plan_module.COMPILED, plan_module.SHORT_LIST, plan_module.SMALL_PLAN_BLOCKS
    plan_module.COMPILED, plan_module.SHORT_LIST, plan_module.SMALL_PLAN_BLOCKS = PATHS[name]
    try:
        yield
    finally:
        plan_module.COMPILED, plan_module.SHORT_LIST, plan_module.SMALL_PLAN_BLOCKS = saved


def test_the_compiled_planner_is_built_and_used() -> None:
    """setup.py builds it wherever a C compiler is (CI included), and plans go through it."""
    from kvbeam.pools import _plan  # type: ignore[attr-defined]

    assert plan_module.COMPILED and _plan.JOB_FIELDS == 10
    assert plan_module.planner().startswith("compiled")


@pytest.fixture(params=sorted(PATHS))
def path(request: pytest.FixtureRequest) -> Any:
    """Every test using it runs once with each of the planner's paths forced."""
    with forced(request.param):
        yield request.param


def _outcome(fn: Any, *args: Any, **kw: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args, **kw)
    except (PlanError, KeyError) as exc:
        return type(exc).__name__, str(exc)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # constant per run
@given(spec_i=st.integers(0, len(SPECS) - 1), draft=st.booleans(), seq_len=st.integers(0, 2048),
       src_slot=st.integers(0, 3), dst_slot=st.integers(0, 7), fragmented=st.booleans(),
       own_draft=st.integers(0, 3), include=st.sampled_from([(True, True), (True, False),
                                                             (False, True)]),
       broken=st.integers(0, 6), wide=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_vectorised_plan_equals_the_buffer_loop(
    path: str, spec_i: int, draft: bool, seq_len: int, src_slot: int, dst_slot: int,
    fragmented: bool, own_draft: int, include: tuple[bool, bool], broken: int, wide: bool,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    src = _layout(spec_i, draft, 4, 16)
    dst = _layout(spec_i, draft, 8, 32 if wide and broken == 6 else 16)  # 6+wide: item lengths
    s_idx = dict(request_indices(replace(SPECS[spec_i], num_req_slots=4), src_slot, seq_len))
    d_idx = dict(request_indices(replace(SPECS[spec_i], num_req_slots=8), dst_slot, seq_len))
    if fragmented:
        s_idx, d_idx = _fragment(rng, src, s_idx), _fragment(rng, dst, d_idx)
    if rng.random() < 0.3 and len(d_idx[IndexKind.KV_PAGES]) > 1:  # decode holds a prefix
        d_idx[IndexKind.KV_PAGES] = d_idx[IndexKind.KV_PAGES][1:]
    s_draft = d_draft = None
    if draft and own_draft:
        kinds = {b.index_kind for b in src.components[-1].buffers}
        mine = {k: v for k, v in s_idx.items() if k in kinds}
        s_draft = _fragment(rng, src, mine, "draft") if own_draft & 1 else None
        d_draft = _fragment(rng, dst, {k: v for k, v in d_idx.items() if k in kinds},
                            "draft") if own_draft & 2 else None
    if 1 <= broken <= 4:
        _break(rng, d_idx if rng.random() < 0.5 else s_idx, broken)
    s_addrs, d_addrs = _addrs(src, 1 << 32), _addrs(dst, (1 << 63) + (1 << 40))
    kw = dict(include_kv=include[0], include_states=include[1], src_draft=s_draft,
              dst_draft=d_draft)
    want = _outcome(_loop_plan, src, s_addrs, s_idx, dst, d_addrs, d_idx, **kw)
    got = _outcome(build_plan, src, s_addrs, s_idx, dst, d_addrs, d_idx, **kw)
    event(want[0] if want[0] == "ok" else want[1].split(" ")[0] + " " + want[1].split(" ")[1])
    assert got[0] == want[0], (got, want)
    if want[0] != "ok":
        assert got[1] == want[1]
        return
    plan = got[1]
    assert len(plan.buffers) == len(want[1])
    for bp, (ci, bi, name, items, blocks) in zip(plan.buffers, want[1], strict=True):
        assert (bp.component, bp.buffer, bp.name, bp.items) == (ci, bi, name, items)
        for a, b in ((bp.blocks.src, blocks.src), (bp.blocks.dst, blocks.dst),
                     (bp.blocks.lengths, blocks.lengths)):
            assert a.dtype == b.dtype == np.uint64
            assert a.tobytes() == b.tobytes()
    whole = Blocks.concat([b[4] for b in want[1]])
    assert plan.blocks.src.tobytes() == whole.src.tobytes()
    assert plan.blocks.dst.tobytes() == whole.dst.tobytes()
    assert plan.blocks.lengths.tobytes() == whole.lengths.tobytes()
    assert plan.total_bytes == whole.total_bytes and plan.num_blocks == len(whole)


def test_the_first_error_in_positional_order_wins(path: str) -> None:
    lay = _layout(0, True, 4, 16)
    idx = request_indices(replace(UNIFIED_TARGET, num_req_slots=4), 0, 600)
    bad = dict(idx)
    bad[IndexKind.SWA_RING_ROWS] = idx[IndexKind.SWA_RING_ROWS] + 10_000  # a later buffer
    bad[IndexKind.KV_PAGES] = idx[IndexKind.KV_PAGES][:0]  # shorter: fine (prefix held)
    bad[IndexKind.REQ_SLOT] = np.array([-1], dtype=np.int64)
    addrs = _addrs(lay, 0)
    kw: dict[str, Any] = dict(include_kv=True, include_states=True, src_draft=None,
                              dst_draft=None)
    with pytest.raises(PlanError) as want:
        _loop_plan(lay, addrs, idx, lay, addrs, bad, **kw)
    with pytest.raises(PlanError) as got:
        build_plan(lay, addrs, idx, lay, addrs, bad, **kw)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("tp", [(1, 0, 2, 1), (1, 0, 2, 0), (2, 1, 4, 3), (1, 0, 1, 0)])
def test_every_path_gives_the_same_head_window_blocks(tp: tuple[int, int, int, int]) -> None:
    """Paged pools at different TP places move a head window per page: the compiled, the
    Python and the numpy assembly give the same blocks, in the same order (random page
    lists)."""
    src, dst = tp_layout(tp[0], tp[1]), tp_layout(tp[2], tp[3])
    rng = np.random.default_rng(sum(tp))
    pages = min(src.flat_buffers[0].items, dst.flat_buffers[0].items)
    for n in (1, 3, pages):
        s_idx = {IndexKind.KV_PAGES: rng.permutation(pages)[:n].astype(np.int64)}
        d_idx = {IndexKind.KV_PAGES: rng.permutation(pages)[:n].astype(np.int64)}
        s_addrs, d_addrs = _addrs(src, 1 << 20), _addrs(dst, 1 << 40)
        plans = []
        for name in PATHS:
            with forced(name):
                plans.append(build_plan(src, s_addrs, s_idx, dst, d_addrs, d_idx))
        a = plans[0]
        for b in plans[1:]:
            for x, y in ((a.blocks.src, b.blocks.src), (a.blocks.dst, b.blocks.dst),
                         (a.blocks.lengths, b.blocks.lengths), (a.items, b.items),
                         (a.starts, b.starts)):
                assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 40), st.integers(-3, 40)), max_size=60))
def test_short_lists_give_the_vectorised_runs_and_bounds(pairs: list[tuple[int, int]]) -> None:
    """The runs and bounds of a short list, scanned in Python, are numpy's (the oracle
    above shares them, so they are compared here on their own, on lists whose sides
    break runs apart, independently)."""
    s = np.array([a for a, _ in pairs], dtype=np.int64)
    d = np.array([b for _, b in pairs], dtype=np.int64)
    got = []
    for short in (1 << 30, 0):
        saved = plan_module.SHORT_LIST
        plan_module.SHORT_LIST = short
        try:
            r = Runs.of(s, d)
            got.append((r.src_start.tobytes(), r.dst_start.tobytes(), r.count.tobytes(),
                        r.count.dtype, _bounds(s), _bounds(d)))
        finally:
            plan_module.SHORT_LIST = saved
    assert got[0] == got[1]
