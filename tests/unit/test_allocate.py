"""Host allocation: page-aligned shared memory, buffer infos with the layout's geometry."""

from __future__ import annotations

import mmap

import numpy as np

from kvbeam.pools.allocate import AllocatedSide
from tests.fixtures import PAGED_DRAFT, PAGED_TARGET, layout


def test_buffer_infos_match_the_layout() -> None:
    lay = layout()
    side = AllocatedSide(lay)
    assert len(side.arrays) == len(lay.tensors)
    assert not side.cuda_tensors
    for ci, comp in enumerate(lay.components):
        infos = side.component_buf_infos(ci)
        assert [i.data_len for i in infos] == [b.nbytes for b in comp.buffers]
        assert [i.item_len for i in infos] == [b.item_len for b in comp.buffers]
        for info, buf in zip(infos, comp.buffers, strict=True):
            a = side.arrays[buf.tensor]
            assert a.ctypes.data <= info.data_ptr
            assert info.data_ptr + info.data_len <= a.ctypes.data + len(a)


def test_allocations_are_zeroed_page_aligned_and_stable() -> None:
    side = AllocatedSide(layout())
    regions = side.tensor_regions()
    assert all(r.addr % mmap.PAGESIZE == 0 for r in regions)
    assert all(not a.any() for a in side.arrays)
    side.fill_pattern(3)
    assert side.tensor_regions() == regions
    assert side.buffer_addrs() == [r.addr for r in side.buffer_regions()]


def test_buffer_array_and_view_alias_the_allocation() -> None:
    lay = layout(PAGED_TARGET, PAGED_DRAFT)
    side = AllocatedSide(lay)
    buf = lay.states[-1].buffers[0]
    array = side.buffer_array(buf)
    array.fill(7)
    assert int(side.arrays[buf.tensor][buf.offset]) == 7
    assert array.ctypes.data == side.buffer_addr(buf)
    view = side.buffer_view(buf)  # the reference engine's torch edge: same memory
    assert view.data_ptr() == side.buffer_addr(buf)
    view.fill_(9)
    assert int(array[-1]) == 9


def test_regions_and_patterns() -> None:
    lay = layout()
    a, b = AllocatedSide(lay), AllocatedSide(lay)
    a.fill_pattern(1)
    b.fill_pattern(1)
    assert all(np.array_equal(x, y) for x, y in zip(a.arrays, b.arrays, strict=True))
    b.fill_pattern(2)
    assert not np.array_equal(a.arrays[0], b.arrays[0])
    assert [r.length for r in a.tensor_regions()] == [t.nbytes for t in lay.tensors]
    assert [r.addr for r in a.buffer_regions()] == a.buffer_addrs()
