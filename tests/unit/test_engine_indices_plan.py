"""Engine-chosen lists move each source item to its paired destination item (plans, cores)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvbeam.errors import BadIndexList, BadRequest, NoFreeSlot
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.plan import build_plan, list_for
from kvbeam.pools.spec import PoolSpec
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.ports import WriteGrant
from kvbeam.server.state.peers import PeerConn
from kvbeam.states import TransferState
from tests.copy_helpers import copy_blocks, copy_plan
from tests.core_fakes import FakeDecode, FakeLink, prefill_core, slot_lists, wait_for
from tests.engine_lists import Lists, random_lists
from tests.fixtures import PAGED_DRAFT, PAGED_TARGET, UNIFIED_DRAFT, UNIFIED_TARGET, layout
from tests.unit.test_core_decode import _core as decode_core

K = IndexKind
ADDR = "127.0.0.1:9"


def _sides(lay: SideLayout) -> tuple[AllocatedSide, AllocatedSide]:
    src, dst = AllocatedSide(lay), AllocatedSide(lay)
    src.fill_pattern(11)
    dst.fill_pattern(12)
    return src, dst


def _assert_moved(src: AllocatedSide, dst: AllocatedSide, before: AllocatedSide,
                  s: Lists, d: Lists, s_draft: Lists | None = None,
                  d_draft: Lists | None = None) -> None:
    """Each buffer: dst item d[i] holds src item s[i]; every other dst item is untouched."""
    for comp in src.layout.components:
        for buf in comp.buffers:
            si = list_for(s, s_draft, comp.pool, buf.index_kind)
            di = list_for(d, d_draft, comp.pool, buf.index_kind)
            sv = src.buffer_array(buf).reshape(buf.items, buf.item_len)
            dv = dst.buffer_array(buf).reshape(buf.items, buf.item_len)
            bv = before.buffer_array(buf).reshape(buf.items, buf.item_len)
            assert np.array_equal(dv[di], sv[si]), buf.name
            rest = np.ones(buf.items, dtype=bool)
            rest[di] = False
            assert np.array_equal(dv[rest], bv[rest]), buf.name


@pytest.mark.parametrize(("target", "draft", "own_draft"), [
    (UNIFIED_TARGET, UNIFIED_DRAFT, False), (UNIFIED_TARGET, UNIFIED_DRAFT, True),
    (PAGED_TARGET, PAGED_DRAFT, False), (PAGED_TARGET, PAGED_DRAFT, True)])
def test_shuffled_fragmented_lists_land_item_for_item(target: PoolSpec, draft: PoolSpec,
                                                      own_draft: bool) -> None:
    lay = layout(target, draft)
    src, dst = _sides(lay)
    before = AllocatedSide(lay)
    before.fill_pattern(12)
    rng = np.random.default_rng(7)
    s, d = random_lists(target, lay, 1500, rng), random_lists(target, lay, 1500, rng)
    s_draft = random_lists(target, lay, 1500, rng, pool="draft") if own_draft else None
    d_draft = random_lists(target, lay, 1500, rng, pool="draft") if own_draft else None
    copy_plan(src, dst, s, d, src_draft=s_draft, dst_draft=d_draft)
    _assert_moved(src, dst, before, s, d, s_draft, d_draft)


def test_fragmented_lists_give_more_smaller_blocks_same_bytes() -> None:
    lay = layout()
    addrs = AllocatedSide(lay).buffer_addrs()
    slot = build_plan(lay, addrs, request_indices(UNIFIED_TARGET, 0, 2000), lay, addrs,
                      request_indices(UNIFIED_TARGET, 1, 2000))
    rng = np.random.default_rng(8)
    eng = build_plan(lay, addrs, random_lists(UNIFIED_TARGET, lay, 2000, rng), lay, addrs,
                     random_lists(UNIFIED_TARGET, lay, 2000, rng))
    assert eng.total_bytes == slot.total_bytes
    assert eng.num_blocks > slot.num_blocks


class EngineDecode(FakeDecode):
    """A fake decode whose BeginWrite grants the engine's own destination lists."""

    def __init__(self, side: AllocatedSide, lists: Lists, draft: Lists) -> None:
        super().__init__(side)
        self.lists, self.draft = lists, draft

    def begin_write(self, conn: PeerConn, request_id: str, seq_len: int,
                    digests_follow: bool) -> WriteGrant:
        full = {k: self.lists.get(k, np.zeros(0, dtype=np.int64)) for k in IndexKind}
        return WriteGrant(next(self._tids), full, self.draft)


def _engine_prefill(dst_lists: Lists, dst_draft: Lists) -> tuple[Any, EngineDecode]:
    core, _fake = prefill_core(integrity=False)
    dst = AllocatedSide(core.layout)
    dst.fill_pattern(12)
    engine = EngineDecode(dst, dst_lists, dst_draft)
    core.decode = engine
    core.pools.fill_pattern(11)
    return core, engine


def test_chunked_send_selects_pages_by_position_not_page_id() -> None:
    lay = layout()
    rng = np.random.default_rng(9)
    s = random_lists(UNIFIED_TARGET, lay, 1000, rng)
    d = random_lists(UNIFIED_TARGET, lay, 1000, rng)
    s_draft = random_lists(UNIFIED_TARGET, lay, 1000, rng, pool="draft")
    d_draft = random_lists(UNIFIED_TARGET, lay, 1000, rng, pool="draft")
    core, engine = _engine_prefill(d, d_draft)
    before = AllocatedSide(lay)
    before.fill_pattern(12)
    core.send("e", 1000, ADDR, [(0, 300)], False, indices=s, draft=s_draft)
    assert wait_for(lambda: core.peers.by_address(ADDR) is not None)
    conn = core.peers.by_address(ADDR)
    assert conn is not None
    link = conn.link
    assert isinstance(link, FakeLink)
    # Each chunk's step runs before the next chunk comes (one that came meanwhile
    # would be one step with it): three writes, each of its own pages.
    assert wait_for(lambda: len(link.writes) == 1)
    core.send("e", 1000, ADDR, [(300, 700)], False)  # omits the lists: the first's kept
    assert wait_for(lambda: len(link.writes) == 2)
    core.send("e", 1000, ADDR, [], True, indices=s, draft=s_draft)  # repeated unchanged
    assert wait_for(lambda: len(link.writes) == 3)
    for blocks in link.blocks:
        copy_blocks(core.pools, engine.side, blocks)
    _assert_moved(core.pools, engine.side, before, s, d, s_draft, d_draft)
    for tid, _ in link.writes:
        core.on_event(link.completion(tid))
    assert core.status("e").state is TransferState.SUCCESS
    assert core.slot_of("e") == -1


def test_prefill_refuses_a_bad_list_before_queueing_and_a_changed_list_later() -> None:
    lay = layout()
    rng = np.random.default_rng(10)
    s = random_lists(UNIFIED_TARGET, lay, 1000, rng)
    core, _engine = _engine_prefill(s, {})
    bad = dict(s)
    bad[K.KV_PAGES] = bad[K.KV_PAGES].copy()
    bad[K.KV_PAGES][2] = 10**6
    with pytest.raises(BadIndexList, match="prefill: KV_PAGES index 1000000 at position 2"):
        core.send("b", 1000, ADDR, [], True, indices=bad)
    assert not core.known("b")
    core.send("c", 1000, ADDR, [(0, 256)], False, indices=s)
    other = dict(s)
    other[K.KV_PAGES] = s[K.KV_PAGES][::-1].copy()
    with pytest.raises(BadRequest, match=r"must keep the index lists \(or source slot\)"):
        core.send("c", 1000, ADDR, [], True, indices=other)
    # A slot's lists (what the gRPC Send makes of a source slot) are compared the same
    # way: a further chunk naming another slot is refused.
    core.send("d", 1000, ADDR, [(0, 256)], False, indices=slot_lists(core, 0, 1000))
    with pytest.raises(BadRequest, match=r"must keep the index lists \(or source slot\)"):
        core.send("d", 1000, ADDR, [], True, indices=slot_lists(core, 1, 1000))
    with pytest.raises(BadRequest, match="its first chunk names no source lists"):
        core.send("e", 1000, ADDR, [], True)


def test_decode_reserve_with_engine_lists_counts_capacity_and_reports_slot_minus_one() -> None:
    core, _io, _prefill, _conn = decode_core()
    rng = np.random.default_rng(11)
    lay = core.layout
    bad = random_lists(UNIFIED_TARGET, lay, 900, rng)
    bad[K.REQ_SLOT] = np.array([UNIFIED_TARGET.num_req_slots], dtype=np.int64)
    with pytest.raises(BadIndexList, match="decode: REQ_SLOT index 4 at position 0"):
        core.reserve("bad", 900, "127.0.0.1:7", indices=bad)
    assert core.slots.free == UNIFIED_TARGET.num_req_slots and core.table.get("bad") is None
    taken: dict[K, set[int]] = {}
    for i in range(UNIFIED_TARGET.num_req_slots):
        lists = random_lists(UNIFIED_TARGET, lay, 900, rng, taken=taken)
        res = core.reserve(f"r{i}", 900, "127.0.0.1:7", indices=lists)
        assert res.slot == -1 and np.array_equal(res.indices[K.KV_PAGES], lists[K.KV_PAGES])
        slot_res = request_indices(UNIFIED_TARGET, 0, 900)
        assert res.nbytes == sum(len(slot_res[b.index_kind]) * b.item_len
                                 for b in lay.flat_buffers)
    with pytest.raises(NoFreeSlot):
        core.reserve("one-too-many", 900, "127.0.0.1:7",
                     indices=random_lists(UNIFIED_TARGET, lay, 900, rng))


def _engine_request(seed: int) -> tuple[SideLayout, Lists, Lists, Any, EngineDecode,
                                         AllocatedSide]:
    """A 1000-token request's random source and destination lists, a prefill core
    writing into an engine decode at them, and decode's memory before (the layout,
    source, destination, core, engine, before)."""
    lay = layout()
    rng = np.random.default_rng(seed)
    s = random_lists(UNIFIED_TARGET, lay, 1000, rng)
    d = random_lists(UNIFIED_TARGET, lay, 1000, rng)
    core, engine = _engine_prefill(d, {})
    before = AllocatedSide(lay)
    before.fill_pattern(12)
    return lay, s, d, core, engine, before


def test_a_page_a_chunk_fills_in_part_moves_once_it_is_whole() -> None:
    """A chunk makes ready the KV pages it completes: the page its tokens end inside is
    written by a later chunk, with the tokens the engine computed meanwhile (written
    with the first chunk, it was never written again: decode kept its first half)."""
    lay, s, d, core, engine, before = _engine_request(13)
    core.send("p", 1000, ADDR, [(0, 300)], False, indices=s)  # page 1 half computed
    assert wait_for(lambda: core.peers.by_address(ADDR) is not None)
    conn = core.peers.by_address(ADDR)
    assert conn is not None and isinstance(conn.link, FakeLink)
    link = conn.link
    assert wait_for(lambda: len(link.writes) == 1)
    copy_blocks(core.pools, engine.side, link.blocks[0])  # the bytes as they are now
    page = int(s[K.KV_PAGES][1])
    for buf in lay.flat_buffers:  # the engine computes the rest of page 1
        if buf.index_kind is K.KV_PAGES:
            core.pools.buffer_array(buf).reshape(buf.items, buf.item_len)[page] ^= 0x5A
    core.send("p", 1000, ADDR, [], True, indices=s)
    assert wait_for(lambda: len(link.writes) == 2)
    copy_blocks(core.pools, engine.side, link.blocks[1])
    _assert_moved(core.pools, engine.side, before, s, d)


def test_a_request_sent_layer_by_layer_moves_each_layer_once_it_is_ready() -> None:
    """LAYERS pieces: the first makes every page ready in the model's first layers
    only, so only those layers' KV moves; a later layer's bytes move with the piece
    that makes it ready (computed after the first piece: its final bytes land); the
    final chunk brings the states."""
    lay, s, d, core, engine, before = _engine_request(14)
    pages = s[K.KV_PAGES]
    core.send("l", 1000, ADDR, [], False, indices={K.KV_PAGES: pages}, kv_offset=0,
              layers=2)
    assert wait_for(lambda: core.peers.by_address(ADDR) is not None)
    conn = core.peers.by_address(ADDR)
    assert conn is not None and isinstance(conn.link, FakeLink)
    link = conn.link
    assert wait_for(lambda: len(link.writes) == 1)
    copy_blocks(core.pools, engine.side, link.blocks[0])

    def moved(buf: Any) -> bool:
        src = core.pools.buffer_array(buf).reshape(buf.items, buf.item_len)[pages]
        dst = engine.side.buffer_array(buf).reshape(buf.items, buf.item_len)[d[K.KV_PAGES]]
        return bool(np.array_equal(src, dst))

    assert [moved(b) for b in lay.kv.buffers] == [layer < 2 for layer in lay.kv_layers]
    for buf, layer in zip(lay.kv.buffers, lay.kv_layers, strict=True):
        if layer >= 2:  # the engine computes the later layers now
            core.pools.buffer_array(buf).reshape(buf.items, buf.item_len)[pages] ^= 0x33
    core.send("l", 1000, ADDR, [], False, kv_offset=len(pages), layers=lay.num_layers)
    assert wait_for(lambda: len(link.writes) == 2)
    copy_blocks(core.pools, engine.side, link.blocks[1])
    assert all(moved(b) for b in lay.kv.buffers)
    rest = {k: v for k, v in s.items() if k is not K.KV_PAGES}
    core.send("l", 1000, ADDR, [], True, indices=rest, kv_offset=len(pages))
    assert wait_for(lambda: len(link.writes) == 3)
    copy_blocks(core.pools, engine.side, link.blocks[2])
    _assert_moved(core.pools, engine.side, before, s, d)
    for tid, _ in link.writes:
        core.on_event(link.completion(tid))
    assert core.status("l").state is TransferState.SUCCESS
