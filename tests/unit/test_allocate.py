"""Host allocation: page-aligned shared memory, buffers at the layout's offsets."""

from __future__ import annotations

import mmap

import numpy as np

from kvbeam.pools.allocate import AllocatedSide
from tests.fixtures import PAGED_DRAFT, PAGED_TARGET, layout


def test_buffers_lie_inside_their_allocations() -> None:
    lay = layout()
    side = AllocatedSide(lay)
    assert len(side.arrays) == len(lay.tensors)
    assert not side.cuda_tensors
    for buf in lay.flat_buffers:
        a = side.arrays[buf.tensor]
        assert side.buffer_addr(buf) == a.ctypes.data + buf.offset
        assert buf.offset + buf.nbytes <= len(a)


def test_allocations_are_zeroed_page_aligned_and_stable() -> None:
    side = AllocatedSide(layout())
    regions = side.tensor_regions()
    addrs = side.buffer_addrs()
    assert all(r.addr % mmap.PAGESIZE == 0 for r in regions)
    assert all(not a.any() for a in side.arrays)
    side.fill_pattern(3)
    assert side.tensor_regions() == regions
    assert side.buffer_addrs() == addrs == [side.buffer_addr(b) for b in side.layout.flat_buffers]


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
