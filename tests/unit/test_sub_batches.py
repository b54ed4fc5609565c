"""Sub-batches (protocol 6): the cut both sides compute, prefill's marked writes, and
decode digesting each sub-batch as its mark comes, Success only after the last."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest

from kvbeam.errors import ProtocolError
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest import request_digests
from kvbeam.pools.digest_pool import DigestPool
from kvbeam.pools.indices import request_indices
from kvbeam.pools.mailbox import HEADER
from kvbeam.pools.plan import build_plan, list_for
from kvbeam.pools.sub_batches import (
    MAX_MARKS,
    MIN_SUB_BATCH_BYTES,
    bounds,
    buffer_bytes,
    complete_parts,
    cuts,
    mark_id,
    parse_sub_batch,
    part_blocks,
    split_id,
)
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.incoming import Landing
from kvbeam.server.core.outgoing import Step
from kvbeam.server.core.ports import WriteGrant
from kvbeam.server.faults import FaultHooks, arm
from kvbeam.server.state.peers import PeerConn
from kvbeam.states import FailureReason, TransferState
from kvbeam.transport import Event, EventKind
from tests.core_fakes import FakeLink, land_record, prefill_core, slot_lists, wait_for
from tests.engine_lists import Lists, random_lists
from tests.fake_clock import FakeClock
from tests.fixtures import UNIFIED_TARGET, layout
from tests.unit.test_core_decode import PREFILL, QueueExecutor, _core, _relink
from tests.unit.test_core_offers import ADDR, SEQ, _connected
from tests.unit.test_engine_indices_plan import EngineDecode

PER_BUFFER = buffer_bytes(layout(), request_indices(UNIFIED_TARGET, 0, SEQ), {})
#: A size that cuts the unit-test request into 3 marked sub-batches and a last part.
QUARTER = sum(PER_BUFFER) // 4


# ---- the cut ------------------------------------------------------------------------------
@pytest.mark.parametrize("own", [None, (), (0,), (0, 1), (1,)])
def test_buffer_bytes_counts_each_buffers_own_list(own: tuple[int, ...] | None) -> None:
    """Per flat buffer: its list's items (the draft's own list where it has one, of each
    kind it has) times its item length, as a buffer-by-buffer count gives; the layout's
    template is reused, so a second call with other lengths gives their counts."""
    lay = layout()
    for seq in (SEQ, 3 * SEQ + 5):
        idx = request_indices(UNIFIED_TARGET, 1, seq)
        kinds = sorted({b.index_kind for b in lay.components[-1].buffers}, key=str)
        draft = None if own is None else {kinds[i]: idx[kinds[i]][:1 + i]
                                          for i in own if i < len(kinds)}
        want = [len(list_for(idx, draft, c.pool, b.index_kind)) * b.item_len
                for c in lay.components for b in c.buffers]
        assert buffer_bytes(lay, idx, draft) == want


def test_the_cut_covers_every_buffer_once_and_leaves_the_last_to_the_record() -> None:
    at = cuts(PER_BUFFER, QUARTER)
    assert at == (3, 9, 12) and len(PER_BUFFER) == 13
    parts = [bounds(at, k, len(PER_BUFFER)) for k in range(1, len(at) + 2)]
    assert parts == [(0, 3), (3, 9), (9, 12), (12, 13)]
    for lo, hi in parts[:-1]:  # each marked sub-batch reaches the size
        assert sum(PER_BUFFER[lo:hi]) >= QUARTER


@pytest.mark.parametrize(("per_buffer", "size", "want"), [
    ([100, 100], 0, ()),            # sub-batches off
    ([100, 99], 100, ()),           # under two sub-batches: verified whole
    ([100, 100], 100, (1,)),
    ([300], 100, ()),               # one buffer: nothing to cut
    ([1000, 1, 1], 100, (1,)),      # the last buffer always goes with the last part
])
def test_the_cut_in_corner_cases(per_buffer: list[int], size: int, want: tuple[int, ...]) -> None:
    assert cuts(per_buffer, size) == want


def test_a_huge_request_has_at_most_fifteen_marks() -> None:
    at = cuts([1 << 20] * 1000, 1 << 20)
    assert len(at) == MAX_MARKS == 15 and list(at) == sorted(at) and at[-1] < 1000


def test_mark_ids_name_no_other_grant() -> None:
    assert mark_id(32, 1) == 33 and split_id(33) == (32, 1) and split_id(32) == (32, 0)
    assert split_id(0xFFFFFFF0 | MAX_MARKS) == (0xFFFFFFF0, MAX_MARKS)
    with pytest.raises(ValueError, match=r"marks are 1\.\.15"):
        mark_id(33, 1)  # not a protocol 6 grant's id
    with pytest.raises(ValueError):
        mark_id(32, 16)


def test_the_advertised_size_is_checked() -> None:
    assert parse_sub_batch("") == 0 and parse_sub_batch(str(16 << 20)) == 16 << 20
    for bad, why in (("16M", "not a number"), (str(MIN_SUB_BATCH_BYTES - 1), "outside")):
        with pytest.raises(ProtocolError, match=why) as err:
            parse_sub_batch(bad)
        assert err.value.field == "side.endpoint.extra[kvbeam-sub-batch]"


# ---- prefill: the marked writes -------------------------------------------------------------
def test_prefill_posts_each_sub_batch_as_a_notified_write_then_the_rest_and_its_record() -> None:
    core, fake, conn, _events = _connected()
    conn.sub_batch_bytes = QUARTER
    tid = 16 * 7
    assert core.offer("r", conn.instance_id, SEQ,
                      WriteGrant(tid, request_indices(UNIFIED_TARGET, 2, SEQ)), lease_s=10.0)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    link = cast(FakeLink, conn.link)
    assert wait_for(lambda: len(link.writes) == 2 + 5 and len(fake.digests) == 2)
    assert link.writes[2:] == [(tid + 1, True), (tid + 2, True), (tid + 3, True),
                               (tid, False), (tid, True)]
    # Each mark's blocks are exactly its buffers' (in the plan's order), the last part
    # the rest; together every byte once.
    marked = link.blocks[2:5]
    assert [b.total_bytes for b in marked] == [sum(PER_BUFFER[0:3]), sum(PER_BUFFER[3:9]),
                                               sum(PER_BUFFER[9:12])]
    assert sum(b.total_bytes for b in link.blocks[2:6]) == sum(PER_BUFFER)
    assert HEADER.unpack_from(link.records[-1][1])[2] == 3  # the record counts the marks
    for event in [*link.finish(tid + 1), *link.finish(tid + 2), *link.finish(tid)]:
        core.on_event(event)
    assert core.status("r").state is TransferState.TRANSFERRING  # mark 3 still out
    for event in link.finish(tid + 3):
        core.on_event(event)
    st = core.status("r")
    assert st.state is TransferState.SUCCESS and st.nbytes == sum(PER_BUFFER)


def test_prefill_marks_nothing_for_a_grant_id_with_mark_bits() -> None:
    """A grant that is no protocol 6 one (low bits set) is written as before: no marks."""
    core, _fake, conn, _events = _connected()
    conn.sub_batch_bytes = QUARTER
    assert core.offer("r", conn.instance_id, SEQ,
                      WriteGrant(77, request_indices(UNIFIED_TARGET, 2, SEQ)), lease_s=10.0)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    link = cast(FakeLink, conn.link)
    assert wait_for(lambda: len(link.writes) == 4)
    assert link.writes[2:] == [(77, False), (77, True)]
    assert HEADER.unpack_from(link.records[-1][1])[2] == 0


# ---- decode: digests as each sub-batch lands ------------------------------------------------
def _marked_core() -> tuple[DecodeDriver, QueueExecutor, PeerConn, bytes]:
    core, io, _prefill, conn = _core()
    core.core.sub_batch_bytes = QUARTER
    core.digest_pool = DigestPool(0)  # each job on the calling thread: nothing to wait on
    res = core.reserve("r", SEQ, PREFILL)
    assert res.sub_batches == (3, 9, 12) and res.transfer_id % 16 == 0
    core.begin_write("r", conn.instance_id, SEQ, True)
    return core, io, conn, request_digests(core.pools, res.indices)


def _notify(core: DecodeDriver, conn: PeerConn, transfer_id: int) -> None:
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, transfer_id))


def test_decode_digests_each_marked_sub_batch_and_succeeds_after_the_last() -> None:
    core, io, conn, digests = _marked_core()
    res = core.core._reservation("r")
    tid = res.transfer_id
    _notify(core, conn, tid + 2)  # marks may come in any order (lanes)
    assert sorted(res.marked) == [2] and res.parts is not None
    land_record(core, "r", digests, marks=3)
    _notify(core, conn, tid)  # the last part and the record, before marks 1 and 3
    assert core.status("r").state is TransferState.TRANSFERRING and res.landing is Landing.LANDED
    _notify(core, conn, tid + 1)
    assert core.status("r").state is TransferState.TRANSFERRING
    _notify(core, conn, tid + 3)  # the last missing piece starts the check
    io.run_all()
    st = core.status("r")
    assert st.state is TransferState.SUCCESS and st.detail.startswith("XXH3-128 verified: 13")


def test_a_byte_flipped_in_a_marked_sub_batch_fails_the_request() -> None:
    core, io, conn, digests = _marked_core()
    res = core.core._reservation("r")
    plain = core.checker
    arm(core, FaultHooks(corrupt_landed=1.0, seed=3))
    for k in (1, 2, 3):
        _notify(core, conn, res.transfer_id + k)
    core.checker = plain  # only the marked sub-batches were hit
    land_record(core, "r", digests, marks=3)
    _notify(core, conn, res.transfer_id)
    io.run_all()
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.INTEGRITY
    assert "XXH3-128 mismatch in 3 buffer(s)" in st.detail


def test_a_record_counting_other_marks_fails_naming_both_counts() -> None:
    core, io, conn, digests = _marked_core()
    res = core.core._reservation("r")
    land_record(core, "r", digests, marks=2)  # decode cut 3: not waited for
    _notify(core, conn, res.transfer_id)
    io.run_all()
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.INTEGRITY
    assert st.detail.startswith("digest record: marks: 2 sub-batches notified before the "
                                "record, decode cut the request into 3"), st.detail


def test_a_record_without_marks_is_digested_whole() -> None:
    """Prefill sent the request in chunks (or it is no protocol 6 prefill): no marks."""
    core, io, conn, digests = _marked_core()
    land_record(core, "r", digests)
    _notify(core, conn, core.core._reservation("r").transfer_id)
    io.run_all()
    assert core.status("r").state is TransferState.SUCCESS


def test_marks_decode_did_not_cut_and_repeated_ones_are_ignored() -> None:
    core, io, conn, digests = _marked_core()
    res = core.core._reservation("r")
    _notify(core, conn, res.transfer_id + 4)  # decode cut 3
    _notify(core, conn, res.transfer_id + 1)
    _notify(core, conn, res.transfer_id + 1)
    assert sorted(res.marked) == [1]
    for k in (2, 3):
        _notify(core, conn, res.transfer_id + k)
    land_record(core, "r", digests, marks=3)
    _notify(core, conn, res.transfer_id)
    io.run_all()
    assert core.status("r").state is TransferState.SUCCESS


def test_a_resend_starts_the_marks_over() -> None:
    core, io, conn, digests = _marked_core()
    res = core.core._reservation("r")
    old = res.transfer_id
    for k in (1, 2, 3):
        _notify(core, conn, old + k)
    new = _relink(core, conn)
    tid = core.begin_write("r", conn.instance_id, SEQ, True).transfer_id
    assert tid != old and res.marked == {}  # the old landing's sub-batches count for nothing
    _notify(core, new, old + 1)  # a late mark of the old transfer: no request has its id
    assert res.marked == {}
    land_record(core, "r", digests, marks=3)
    for k in (1, 2):
        _notify(core, new, tid + k)
    _notify(core, new, tid)
    io.run_all()
    assert core.status("r").state is TransferState.TRANSFERRING  # mark 3 of the resend
    _notify(core, new, tid + 3)
    io.run_all()
    assert core.status("r").state is TransferState.SUCCESS


# ---- a request written in several chunks: each sub-batch marked once it is whole ----------
@pytest.mark.parametrize(("layers_done", "final", "want"), [
    (0, False, []),            # nothing whole yet
    (2, False, [1]),           # layers 0-1: the first part's buffers only
    (3, False, [1, 2]),        # the second part's last buffer is of layer 2
    (4, False, [1, 2]),        # every KV buffer: the third part holds a state buffer
    (1, True, [1, 2, 3]),      # the final chunk makes every part whole
])
def test_a_part_is_whole_once_every_buffer_in_it_is(layers_done: int, final: bool,
                                                    want: list[int]) -> None:
    # Flat buffers 0..5 are KV of layers 0,0,1,1,2,3; 6 and 7 are states.
    kv_layers = (0, 0, 1, 1, 2, 3)
    assert complete_parts((2, 5, 7), kv_layers, 6, layers_done, 4, final=final) == want
    # Layers not known (buffers that name none): whole only with every layer.
    assert complete_parts((2, 5, 7), None, 6, 2, 4, final=False) == []
    assert complete_parts((2, 5, 7), None, 6, 4, 4, final=False) == [1, 2]


def test_a_plans_blocks_are_cut_by_part_every_block_once() -> None:
    lay = layout()
    idx = request_indices(UNIFIED_TARGET, 1, SEQ)
    plan = build_plan(lay, AllocatedSide(lay).buffer_addrs(), idx, lay,
                      AllocatedSide(lay).buffer_addrs(), idx)
    at = cuts(PER_BUFFER, QUARTER)
    parts = part_blocks([plan], lay.component_offsets, at)
    assert [p.total_bytes for p in parts] == [
        sum(PER_BUFFER[lo:hi]) for lo, hi in (bounds(at, k, 13) for k in range(1, len(at) + 2))]
    assert sum(len(p) for p in parts) == plan.num_blocks
    # Plans of some buffers each (a layer's rectangle, then the rest) cut the same.
    kv = build_plan(lay, AllocatedSide(lay).buffer_addrs(), idx, lay,
                    AllocatedSide(lay).buffer_addrs(), idx, include_states=False)
    states = build_plan(lay, AllocatedSide(lay).buffer_addrs(), idx, lay,
                        AllocatedSide(lay).buffer_addrs(), idx, include_kv=False)
    split = part_blocks([kv, states], lay.component_offsets, at)
    assert [p.total_bytes for p in split] == [p.total_bytes for p in parts]


def _check_marks(link: FakeLink, tid: int, at: tuple[int, ...],
                 per_buffer: list[int]) -> dict[int, int]:
    """Every write is the grant's or one of its marks'; each mark is notified once,
    after every byte of its sub-batch and before none; returns the bytes per mark (0:
    the last part, its record included)."""
    written: dict[int, int] = {}
    notified: list[int] = []
    for (wid, notify), blocks in zip(link.writes, link.blocks, strict=True):
        base, k = split_id(wid)
        assert base == tid
        assert k not in notified, f"a write of mark {k} after its notification"
        written[k] = written.get(k, 0) + blocks.total_bytes
        if notify and k:
            notified.append(k)
            lo, hi = bounds(at, k, len(per_buffer))
            assert written[k] == sum(per_buffer[lo:hi]), f"mark {k} before its bytes"
    assert sorted(notified) == list(range(1, len(at) + 1))
    return written


class _MarkingDecode(EngineDecode):
    """An engine decode whose grants have room for marks (ids of 16 apart), advertising
    a sub-batch size of ``size`` bytes in its handshake."""

    size = 0

    def connect(self, address: str) -> PeerConn:
        conn = super().connect(address)
        conn.sub_batch_bytes = self.size
        return conn

    def begin_write(self, conn: PeerConn, request_id: str, seq_len: int,
                    digests_follow: bool) -> WriteGrant:
        grant = super().begin_write(conn, request_id, seq_len, digests_follow)
        return WriteGrant(16 * 5, grant.indices, grant.draft)


def test_a_request_written_in_pieces_marks_each_sub_batch_in_the_chunk_that_makes_it_whole(
        ) -> None:
    """Pieces ready in 2 layers, then in every layer, then the final chunk: each sub-batch's
    bytes go under its mark's id in whatever chunk they are written, its mark is notified
    once, in the chunk that makes it whole, with every byte of it written by then; prefill
    digests a sub-batch as soon as it is whole, and the record counts every mark and
    carries the request's digests."""
    lay = layout()
    rng = np.random.default_rng(21)
    s = random_lists(UNIFIED_TARGET, lay, 1000, rng)
    d = random_lists(UNIFIED_TARGET, lay, 1000, rng)
    core, _fake = prefill_core(integrity=True)
    engine = _MarkingDecode(AllocatedSide(lay), d, {})
    core.decode = engine
    core.pools.fill_pattern(11)
    full = {k: d.get(k, np.zeros(0, dtype=np.int64)) for k in IndexKind}
    per_buffer = buffer_bytes(lay, full, {})
    size = engine.size = sum(per_buffer) // 5
    pages = s[IndexKind.KV_PAGES]
    core.send("m", 1000, ADDR, [], False, indices={IndexKind.KV_PAGES: pages},
              kv_offset=0, layers=2)
    assert wait_for(lambda: core.peers.by_address(ADDR) is not None)
    conn = core.peers.by_address(ADDR)
    assert conn is not None and isinstance(conn.link, FakeLink)
    link = conn.link
    at = cuts(per_buffer, size)
    assert len(at) >= 3, at
    engine.names.add("m")
    rec = core.core._out["m"]
    assert wait_for(lambda: len(link.writes) > 0 and rec.step is Step.IDLE)
    first = len(link.writes)
    core.send("m", 1000, ADDR, [], False, kv_offset=len(pages), layers=lay.num_layers)
    assert wait_for(lambda: len(link.writes) > first and rec.step is Step.IDLE)
    second = len(link.writes)
    early = dict(rec.early_digests)
    rest: Lists = {k: v for k, v in s.items() if k is not IndexKind.KV_PAGES}
    core.send("m", 1000, ADDR, [], True, indices=rest, kv_offset=len(pages))
    assert wait_for(lambda: len(link.records) == 1)
    tid = 16 * 5
    written = _check_marks(link, tid, at, per_buffer)
    # Marks went before the final chunk (the KV-only sub-batches, with every layer),
    # and prefill started their digests then.
    before_final = [split_id(wid)[1] for wid, n in link.writes[:second] if n]
    assert before_final and len(early) == len(before_final)
    assert HEADER.unpack_from(link.records[-1][1])[2] == len(at)
    last_lo = at[-1]
    assert written[0] - len(link.records[-1][1]) == sum(per_buffer[last_lo:])
    assert engine.digests == [("m", tid, request_digests(core.pools, s))]


def test_a_resend_mid_stream_marks_every_sub_batch_again_on_the_new_link() -> None:
    """A link fails after a piece marked a sub-batch: the resend replays what was written
    as one step on a new link, where every sub-batch is written and marked again (the
    old marks count for nothing on decode), and the record counts them all."""
    lay = layout()
    rng = np.random.default_rng(22)
    s = random_lists(UNIFIED_TARGET, lay, 1000, rng)
    d = random_lists(UNIFIED_TARGET, lay, 1000, rng)
    core, _fake = prefill_core(integrity=True, resend_retries=1)
    engine = _MarkingDecode(AllocatedSide(lay), d, {})
    core.decode = engine
    engine.names.add("m")
    core.pools.fill_pattern(11)
    full = {k: d.get(k, np.zeros(0, dtype=np.int64)) for k in IndexKind}
    per_buffer = buffer_bytes(lay, full, {})
    engine.size = sum(per_buffer) // 5
    at = cuts(per_buffer, engine.size)
    pages = s[IndexKind.KV_PAGES]
    core.send("m", 1000, ADDR, [], False, indices={IndexKind.KV_PAGES: pages},
              kv_offset=0, layers=lay.num_layers)
    assert wait_for(lambda: core.peers.by_address(ADDR) is not None)
    conn = core.peers.by_address(ADDR)
    assert conn is not None and isinstance(conn.link, FakeLink)
    old = conn.link
    rec = core.core._out["m"]
    assert wait_for(lambda: len(old.writes) > 0 and rec.step is Step.IDLE)
    assert any(n for _tid, n in old.writes), "the piece of every layer marked nothing"
    for tid in dict.fromkeys(t for t, _ in old.writes):
        for event in old.finish(tid, ok=False, status="IBV_WC_RETRY_EXC_ERR"):
            core.on_event(event)
    assert wait_for(lambda: len(engine.links) == 2 and len(engine.links[1].writes) > 0
                    and rec.step is Step.IDLE)
    rest: Lists = {k: v for k, v in s.items() if k is not IndexKind.KV_PAGES}
    core.send("m", 1000, ADDR, [], True, indices=rest, kv_offset=len(pages))
    new = engine.links[1]
    assert wait_for(lambda: len(new.records) == 1)
    _check_marks(new, 16 * 5, at, per_buffer)
    assert HEADER.unpack_from(new.records[-1][1])[2] == len(at)
    assert engine.digests == [("m", 16 * 5, request_digests(core.pools, s))]


def test_a_landed_mark_restarts_decodes_transferring_deadline() -> None:
    """A request in pieces asks BeginWrite about once a second (prefill's
    ``GRANT_RENEW_S``), not per piece: each of its sub-batches that lands is progress
    too, so a stream longer than the Transferring deadline is not failed while it
    lands."""
    clock = FakeClock()
    core, _io, _prefill, conn = _core()
    core.clock = clock
    core.core.sub_batch_bytes = QUARTER
    res = core.reserve("r", SEQ, PREFILL)
    core.begin_write("r", conn.instance_id, SEQ, True)
    left = core.table.left("r", now=clock())
    assert left is not None and left > 20.0
    clock.advance(20.0)
    _notify(core, conn, res.transfer_id + 1)
    assert core.status("r").state is TransferState.TRANSFERRING
    assert core.table.left("r", now=clock()) == pytest.approx(left)
