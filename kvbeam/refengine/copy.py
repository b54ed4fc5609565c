"""An in-process transfer: move exactly the items the index lists name, buffer by buffer.

This is what kvbeam's daemons do over TCP or RDMA (the same components, the same
index semantics, the same pairing of lists via
:func:`kvbeam.pools.plan.pair_index_lists`), done with tensor copies so unit tests
and the demo can run without daemons. ``skip`` and ``shift`` inject the faults the
sensitivity tests need: a component (or buffer kind) left out, or its rows landing
one ring position off.
"""

from __future__ import annotations

from collections.abc import Collection
from fnmatch import fnmatchcase

import numpy as np
import torch

from kvbeam.errors import PlanError
from kvbeam.pools.layout import BufferLayout, ComponentLayout, SideLayout
from kvbeam.pools.plan import IndexLists, pair_index_lists
from kvbeam.pools.spec import PoolSpec, SideConfig
from kvbeam.pools.types import IndexKind
from kvbeam.refengine.memory import SideMemory


def _matches(entries: Collection[str], comp: ComponentLayout, buf: BufferLayout) -> bool:
    """An entry names a component (``target.swa_ring``), a buffer kind (``c4_state``) or
    buffers by pattern (``target.layer*.swa``)."""
    return any(e == comp.name or fnmatchcase(buf.name, e) or buf.name.endswith("." + e)
               for e in entries)


def row_bytes(buf: BufferLayout, config: SideConfig) -> int:
    """Bytes of one ring/page row of ``buf``: the unit a one-position shift moves by."""
    spec: PoolSpec = config.target if buf.name.startswith("target.") else (
        config.draft or config.target)
    kind = buf.name.rsplit(".", 1)[-1]
    if buf.index_kind == IndexKind.SWA_RING_ROWS:
        return buf.item_len
    if buf.index_kind == IndexKind.SWA_PAGES:
        return buf.item_len // spec.page_size
    if kind in ("c4_state", "c4_indexer_state"):
        return buf.item_len // spec.c4_ring_size
    if kind == "c128_state":
        return buf.item_len if spec.online_c128 else buf.item_len // 128
    ratio = 4 if kind.startswith("c4") else 128
    return buf.item_len // (spec.page_size // ratio)


def copy_state(src: SideMemory, src_lists: IndexLists, dst: SideMemory, dst_lists: IndexLists,
               config: SideConfig, *, skip: Collection[str] = (),
               shift: Collection[str] = ()) -> int:
    """Copy every buffer's listed items from ``src`` to ``dst``; return the bytes moved.

    Element ``i`` of a kind's source list lands at element ``i`` of its destination
    list. ``skip`` leaves the named components/buffers out; ``shift`` rolls the moved
    rows of the named ones forward by one row (window position ``j``'s row lands
    where position ``j + 1`` belongs), the off-by-one of a wrong ring mapping.
    """
    s_lists, d_lists = pair_index_lists(src_lists, dst_lists)
    layout: SideLayout = src.layout
    for entry in (*skip, *shift):
        # A fault that names nothing would make a sensitivity test pass vacuously.
        if not any(_matches((entry,), c, b) for c in layout.components for b in c.buffers):
            raise PlanError(f"copy_state: {entry!r} names no component or buffer")
    moved = 0
    for comp, dcomp in zip(layout.components, dst.layout.components, strict=True):
        for sb, db in zip(comp.buffers, dcomp.buffers, strict=True):
            if _matches(skip, comp, sb):
                continue
            s_idx = torch.from_numpy(np.asarray(s_lists[sb.index_kind], dtype=np.int64))
            d_idx = torch.from_numpy(np.asarray(d_lists[sb.index_kind], dtype=np.int64))
            if len(s_idx) == 0:
                continue
            data = src.buffer_view(sb).view(-1, sb.item_len)[s_idx]
            if _matches(shift, comp, sb):
                rb = row_bytes(sb, config)
                data = torch.roll(data.reshape(-1, rb), 1, dims=0).reshape(data.shape)
            dst.buffer_view(db).view(-1, db.item_len)[d_idx] = data
            moved += data.numel()
    return moved


def flip_byte(side: SideMemory, lists: IndexLists, buffer_name: str, item: int = -1,
              byte: int = 1) -> None:
    """Flip one byte (XOR 0x40) of a listed item of a buffer: a corruption the digest catches."""
    for buf in side.layout.flat_buffers:
        if buf.name == buffer_name:
            idx = int(np.asarray(lists[buf.index_kind])[item])
            view = side.buffer_view(buf)
            view[idx * buf.item_len + byte] ^= 0x40
            return
    raise KeyError(buffer_name)
