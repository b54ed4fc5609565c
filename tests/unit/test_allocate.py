"""Torch allocation: buffer infos point into live tensors with the layout's geometry."""

from __future__ import annotations

import torch

from kvbeam.pools.allocate import AllocatedSide
from tests.fixtures import PAGED_DRAFT, PAGED_TARGET, layout


def test_buffer_infos_match_the_layout() -> None:
    lay = layout()
    side = AllocatedSide(lay)
    assert len(side.tensors) == len(lay.tensors)
    for ci, comp in enumerate(lay.components):
        infos = side.component_buf_infos(ci)
        assert [i.data_len for i in infos] == [b.nbytes for b in comp.buffers]
        assert [i.item_len for i in infos] == [b.item_len for b in comp.buffers]
        for info, buf in zip(infos, comp.buffers, strict=True):
            t = side.tensors[buf.tensor]
            assert t.data_ptr() <= info.data_ptr
            assert info.data_ptr + info.data_len <= t.data_ptr() + t.numel()


def test_buffer_view_aliases_the_tensor() -> None:
    lay = layout(PAGED_TARGET, PAGED_DRAFT)
    side = AllocatedSide(lay)
    buf = lay.states[-1].buffers[0]
    view = side.buffer_view(buf)
    view.fill_(7)
    assert int(side.tensors[buf.tensor][buf.offset]) == 7
    assert view.data_ptr() == side.buffer_addr(buf)


def test_regions_and_patterns() -> None:
    lay = layout()
    a, b = AllocatedSide(lay), AllocatedSide(lay)
    a.fill_pattern(1)
    b.fill_pattern(1)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))
    b.fill_pattern(2)
    assert not torch.equal(a.tensors[0], b.tensors[0])
    assert [r.length for r in a.tensor_regions()] == [t.nbytes for t in lay.tensors]
    assert [r.addr for r in a.buffer_regions()] == a.buffer_addrs()
