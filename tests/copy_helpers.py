"""Apply transfer plans in-process with plain memory copies (a transport minus the wire)."""

from __future__ import annotations

from typing import Any

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.plan import IndexLists, build_plan
from kvbeam.transport import Blocks


def copy_blocks(src: AllocatedSide, dst: AllocatedSide, blocks: Blocks) -> None:
    """Copy each (src, dst, length) block between the two sides' allocations."""
    s_base = {t.ctypes.data: t for t in src.arrays}
    d_base = {t.ctypes.data: t for t in dst.arrays}
    for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.lengths.tolist(),
                       strict=True):
        (sa, st), = [(a, t) for a, t in s_base.items() if a <= s < a + len(t)]
        (da, dt), = [(a, t) for a, t in d_base.items() if a <= d < a + len(t)]
        so, do = s - sa, d - da
        dt[do:do + n] = st[so:so + n]


def copy_plan(src: AllocatedSide, dst: AllocatedSide, s_idx: IndexLists, d_idx: IndexLists,
              **plan_kwargs: Any) -> None:
    """Plan ``s_idx`` -> ``d_idx`` between the sides and apply it (``build_plan``'s kwargs)."""
    plan = build_plan(src.layout, src.buffer_addrs(), s_idx, dst.layout, dst.buffer_addrs(),
                      d_idx, **plan_kwargs)
    copy_blocks(src, dst, plan.blocks)
