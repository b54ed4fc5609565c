"""Bounds checking, slicing and write preparation of the transports (no I/O)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbeam.errors import RegionError, TransportError
from kvbeam.server.faults import UncheckedRemote
from kvbeam.transport import status
from kvbeam.transport.base import Event, EventKind
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.core import EventQueue, prepare
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.regions import RegionTable

U64 = np.uint64


def blocks(*rows: tuple[int, int, int]) -> Blocks:
    """Blocks from (src, dst, length) rows."""
    a = np.array(rows, dtype=np.uint64).reshape(-1, 3)
    return Blocks(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy())


LOCAL = RegionTable([(0x1000, 0x1000, 11), (0x4000, 0x2000, 12)], "local")
REMOTE = RegionTable([(0x10_0000, 0x1_0000, 21), (0x20_0000, 0x100, 22)], "remote")


def lookup(table: RegionTable, addr: int, length: int) -> int:
    return int(table.lookup(np.array([addr], U64), np.array([length], U64))[0])


@pytest.mark.parametrize(("addr", "length", "key"), [
    (0x1000, 0x1000, 11),  # exactly the first region
    (0x1fff, 1, 11),  # its last byte
    (0x4000, 0x2000, 12),
    (0x5000, 0x10, 12),
    (0x2000, 0, 11),  # zero length at the end of a region: inside
])
def test_lookup_inside(addr: int, length: int, key: int) -> None:
    assert lookup(LOCAL, addr, length) == key


@pytest.mark.parametrize(("addr", "length"), [
    (0xfff, 1),  # one byte before
    (0xfff, 2),  # straddles the start
    (0x1fff, 2),  # straddles the end
    (0x2000, 1),  # the gap
    (0x3fff, 0x2001),  # covers the gap into the next region
    (0x1000, 0x5000),  # spans two regions: must lie within one
    (0x6000, 1),  # past the last region
    (0, 1),
    (0x1800, 2**64 - 0x1000),  # addr + length wraps around 2**64
    (2**64 - 1, 1),
])
def test_lookup_outside(addr: int, length: int) -> None:
    with pytest.raises(RegionError, match="nothing was posted"):
        lookup(LOCAL, addr, length)


def test_lookup_reports_count_and_first_bad_block() -> None:
    addrs = np.array([0x1000, 0x3000, 0x4000, 0x9000], U64)
    with pytest.raises(RegionError, match=r"2 of 4 blocks .* block 1 at 0x3000 length 16"):
        LOCAL.lookup(addrs, np.full(4, 16, U64))


def test_empty_table_refuses_everything() -> None:
    with pytest.raises(RegionError):
        RegionTable([], "remote").lookup(np.array([0x1000], U64), np.array([1], U64))
    assert len(RegionTable([], "remote").lookup(np.zeros(0, U64), np.zeros(0, U64))) == 0


def test_overlapping_regions_are_refused() -> None:
    with pytest.raises(RegionError, match="overlap"):
        RegionTable([(0x1000, 0x1000, 1), (0x1800, 0x1000, 2)], "local")
    RegionTable([(0x1000, 0x1000, 1), (0x2000, 0x1000, 2)], "local")  # adjacent is fine


def test_contains_matches_lookup() -> None:
    for addr, length in [(0x1000, 0x1000), (0x1fff, 2), (0x4000, 0x2000), (0x2000, 1), (0, 1)]:
        try:
            lookup(LOCAL, addr, length)
            inside = True
        except RegionError:
            inside = False
        assert LOCAL.contains(addr, length) is inside


@given(st.lists(st.tuples(st.integers(0, 0x7000), st.integers(0, 0x3000)), max_size=30))
def test_lookup_agrees_with_a_scalar_model(rows: list[tuple[int, int]]) -> None:
    regions = [(0x1000, 0x1000), (0x4000, 0x2000)]

    def inside(a: int, n: int) -> bool:
        return any(s <= a and a + n <= s + ln for s, ln in regions)

    addrs = np.array([a for a, _ in rows], U64)
    lengths = np.array([n for _, n in rows], U64)
    if all(inside(a, n) for a, n in rows):
        keys = LOCAL.lookup(addrs, lengths)
        assert [int(k) for k in keys] == [11 if a < 0x4000 else 12 for a, _ in rows]
    else:
        with pytest.raises(RegionError):
            LOCAL.lookup(addrs, lengths)


def test_prepare_slices_and_keys() -> None:
    b = blocks((0x4000, 0x10_0000, 0x1800), (0x1000, 0x20_0000, 0x100))
    p = prepare(7, b, True, 0x800, LOCAL, REMOTE)
    assert p.src.tolist() == [0x4000, 0x4800, 0x5000, 0x1000]
    assert p.dst.tolist() == [0x10_0000, 0x10_0800, 0x10_1000, 0x20_0000]
    assert p.lengths.tolist() == [0x800, 0x800, 0x800, 0x100]
    assert p.lkeys.tolist() == [12, 12, 12, 11]
    assert p.rkeys.tolist() == [21, 21, 21, 22]
    assert p.transfer_id == 7 and p.notify


def test_prepare_drops_zero_length_blocks_after_checking_them() -> None:
    b = blocks((0x1000, 0x10_0000, 0), (0x1000, 0x10_0000, 8))
    p = prepare(1, b, False, 1 << 20, LOCAL, REMOTE)
    assert p.lengths.tolist() == [8]
    with pytest.raises(RegionError):  # a zero-length block at a wild address is still a bug
        prepare(1, blocks((0x9999_0000, 0x10_0000, 0)), False, 1 << 20, LOCAL, REMOTE)


@pytest.mark.parametrize("side", ["src", "dst"])
def test_prepare_refuses_one_bad_block_among_many(side: str) -> None:
    good = [(0x1000 + 16 * i, 0x10_0000 + 16 * i, 16) for i in range(100)]
    bad = (0x3000, 0x10_0000, 16) if side == "src" else (0x1000, 0x20_00f8, 16)
    with pytest.raises(RegionError, match=r"block 50 "):
        prepare(1, blocks(*good[:50], bad, *good[50:]), True, 1 << 20, LOCAL, REMOTE)


def test_prepare_checks_the_whole_block_not_only_its_slices() -> None:
    # 0x1800 bytes at 0x1000 run 0x800 past the region; slicing must not hide that.
    with pytest.raises(RegionError):
        prepare(1, blocks((0x1000, 0x10_0000, 0x1800)), True, 0x800, LOCAL, REMOTE)


def test_prepare_transfer_id_must_fit_32_bits() -> None:
    b = blocks((0x1000, 0x10_0000, 8))
    prepare(0xFFFF_FFFF, b, True, 64, LOCAL, REMOTE)
    for bad in (-1, 1 << 32):
        with pytest.raises(TransportError, match="32 bits"):
            prepare(bad, b, True, 64, LOCAL, REMOTE)


def test_prepare_unchecked_uses_the_first_remote_key() -> None:
    """The outside-MR fault's table (kvbeam.server.faults): the peer, not us, catches it."""
    unchecked = UncheckedRemote(REMOTE)
    p = prepare(1, blocks((0x1000, 0xdead_0000, 8)), True, 64, LOCAL, unchecked)
    assert p.rkeys.tolist() == [21]
    with pytest.raises(RegionError):  # the local side is always checked
        prepare(1, blocks((0x9000, 0x10_0000, 8)), True, 64, LOCAL, unchecked)


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=40), st.integers(1, 1500))
def test_split_preserves_bytes_and_order(lengths: list[int], max_length: int) -> None:
    src = np.cumsum([0, *lengths[:-1]]).astype(np.uint64) + U64(1 << 20)
    dst = src + U64(1 << 30)
    b = Blocks(src, dst, np.array(lengths, U64)).split(max_length)
    assert int(b.lengths.max(initial=0)) <= max_length
    assert b.total_bytes == sum(lengths)
    # Slices tile each block contiguously, in order, and keep src/dst in step.
    covered = [(int(s), int(s + n)) for s, n in zip(b.src, b.lengths, strict=True) if n]
    expected = [(int(s), int(s + n)) for s, n in zip(src, lengths, strict=True) if n]
    assert _merge(covered) == _merge(expected)
    assert (b.dst - b.src == U64(1 << 30)).all()


def _merge(segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in segments:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


@pytest.mark.timeout(10)  # a drain that does not end fails the test (no wall-clock assert)
def test_event_queue_waits_and_drains() -> None:
    """A drain of an empty queue ends with nothing once its timeout runs out (a hang fails
    the marker); until then it waits: a wake-up with nothing queued does not end it, an
    event put later does."""
    q = EventQueue()
    assert q.drain(0) == []
    assert q.drain(0.05) == []
    ev = Event(EventKind.NOTIFIED, 3, 9)
    threading.Timer(0.05, q.wake).start()
    threading.Timer(0.1, q.put, (ev,)).start()
    assert q.drain(60.0) == [ev]  # one that returned before the put would have none


def test_staged_events_are_delivered_on_the_calling_thread_in_order() -> None:
    q = EventQueue()
    seen: list[tuple[int | None, str]] = []
    q.deliver_to(lambda e: seen.append((e.transfer_id, threading.current_thread().name)))
    for tid in (1, 2, 3):
        q.put(Event(EventKind.COMPLETED, 1, tid), wake=False)
    assert q.deliver()
    assert seen == [(1, "MainThread"), (2, "MainThread"), (3, "MainThread")]
    assert q.drain(0) == []  # nothing left behind for an event thread


def test_a_thread_that_finds_a_delivery_under_way_leaves_its_events_to_it() -> None:
    """One deliverer at a time, and nothing stranded: an event staged while another
    thread delivers is delivered by that thread, after the ones before it."""
    q = EventQueue()
    seen: list[int | None] = []
    answers: list[bool] = []

    def handler(event: Event) -> None:
        seen.append(event.transfer_id)
        if event.transfer_id == 1:  # meanwhile another thread stages 2 and tries
            def other() -> None:
                q.put(Event(EventKind.COMPLETED, 1, 2), wake=False)
                answers.append(q.deliver())
            t = threading.Thread(target=other)
            t.start()
            t.join()

    q.deliver_to(handler)
    q.put(Event(EventKind.COMPLETED, 1, 1), wake=False)
    assert q.deliver()
    assert answers == [False] and seen == [1, 2]


@pytest.mark.timeout(10)
def test_pump_delivers_what_was_queued_with_a_wake_up() -> None:
    q = EventQueue()
    seen: list[str] = []
    q.deliver_to(lambda e: seen.append(threading.current_thread().name))
    threading.Timer(0.05, q.put, (Event(EventKind.NOTIFIED, 3, 9),)).start()
    q.pump(60.0)  # one pump: woken by the put, not by its timeout (the marker)
    assert seen == ["MainThread"]


@pytest.mark.timeout(10)
def test_deliver_without_a_handler_wakes_the_event_thread() -> None:
    q = EventQueue()
    ev = Event(EventKind.NOTIFIED, 3, 9)
    delivered: list[bool] = []

    def stage_then_deliver() -> None:
        q.put(ev, wake=False)
        delivered.append(q.deliver())

    stager = threading.Timer(0.05, stage_then_deliver)
    stager.start()
    assert q.drain(60.0) == [ev]  # woken by deliver(), not by its timeout (the marker)
    stager.join()
    assert delivered == [False]  # no handler: it left the event to the event thread


def test_event_error() -> None:
    assert Event(EventKind.COMPLETED, 1, 2).error() is None
    err = Event(EventKind.COMPLETED, 1, 2, False, "IBV_WC_RETRY_EXC_ERR", "x").error()
    assert isinstance(err, TransportError) and err.status == "IBV_WC_RETRY_EXC_ERR"
    assert "transfer 2 on link 1" in str(err)


def test_status_names() -> None:
    assert status.wc_status_name(0) == "IBV_WC_SUCCESS"
    assert status.wc_status_name(5) == "IBV_WC_WR_FLUSH_ERR"
    assert status.wc_status_name(10) == "IBV_WC_REM_ACCESS_ERR"
    assert status.wc_status_name(12) == "IBV_WC_RETRY_EXC_ERR"
    assert status.wc_status_name(99) == "IBV_WC_STATUS_99"
    assert status.qp_state_name(6) == "IBV_QPS_ERR"


def test_options_validation() -> None:
    TransportOptions()
    with pytest.raises(ValueError, match="signal_every"):
        TransportOptions(sq_depth=64, signal_every=65)
    with pytest.raises(ValueError, match="slice_bytes"):
        TransportOptions(slice_bytes=1 << 31)
    with pytest.raises(ValueError, match="op_timeout_s"):
        TransportOptions(op_timeout_s=0)
    with pytest.raises(ValueError, match="qp_timeout"):
        TransportOptions(qp_timeout=32)
    with pytest.raises(ValueError, match="retry_cnt"):
        TransportOptions(retry_cnt=8)
