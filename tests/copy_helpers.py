"""Apply transfer plans in-process with plain memory copies (a transport minus the wire)."""

from __future__ import annotations

from typing import Any

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.plan import IndexLists, build_plan
from kvbeam.transport import Blocks


def copy_blocks(src: AllocatedSide, dst: AllocatedSide, blocks: Blocks) -> None:
    """Copy each (src, dst, length) block between the two sides' tensors."""
    s_base = {t.data_ptr(): t for t in src.tensors}
    d_base = {t.data_ptr(): t for t in dst.tensors}
    for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.lengths.tolist(),
                       strict=True):
        st = next(t for a, t in s_base.items() if a <= s < a + t.numel())
        dt = next(t for a, t in d_base.items() if a <= d < a + t.numel())
        so, do = s - st.data_ptr(), d - dt.data_ptr()
        dt[do:do + n] = st[so:so + n]


def copy_plan(src: AllocatedSide, dst: AllocatedSide, s_idx: IndexLists, d_idx: IndexLists,
              **plan_kwargs: Any) -> None:
    """Plan ``s_idx`` -> ``d_idx`` between the sides and apply it (``build_plan``'s kwargs)."""
    plan = build_plan(src.layout, src.buffer_addrs(), s_idx, dst.layout, dst.buffer_addrs(),
                      d_idx, **plan_kwargs)
    copy_blocks(src, dst, plan.blocks)
