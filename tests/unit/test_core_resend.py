"""Prefill's resend after a transient transport error, with fake links and a fake decode.

Integrity is on: a first attempt's final chunk is two writes of its transfer id, its data
and then its digest record (the notified one); both complete (or fail) before anything is
resent. A resend's is one write (its digests are kept: the record is its last block).

The core runs on a queue executor (its digests computed at once, handed back as a pool's
job: :class:`~tests.unit.test_core_prefill.PoolJobDigests`): each test runs the queued
steps, handshakes and releases when it chooses, with no threads and no sleeps."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import pytest

from kvbeam.errors import ConfigError
from kvbeam.pools.indices import request_indices
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.faults import BREAK_LINK_ENV, FaultHooks
from kvbeam.server.settings import resolve
from kvbeam.server.state.lifecycle import Deadlines
from kvbeam.server.state.peers import PeerConn
from kvbeam.states import FailureReason, TransferState, TransferStatus
from tests.core_fakes import FakeDecode, FakeLink, slot_lists, wait_for
from tests.fake_clock import FakeClock
from tests.unit.test_core_decode import QueueExecutor
from tests.unit.test_core_prefill import _queued

ADDR = "127.0.0.1:9"
RETRY_EXC = "IBV_WC_RETRY_EXC_ERR"


def _link(core: PrefillDriver, not_: FakeLink | None = None) -> FakeLink:
    """The fake link of the core's live connection to ADDR (a new one after ``not_``),
    once there is one (polled: for cores on a thread pool)."""
    def current() -> FakeLink | None:
        conn = core.peers.by_address(ADDR)
        link = cast(FakeLink, conn.link) if conn is not None else None
        return link if link is not None and link is not not_ else None
    assert wait_for(lambda: current() is not None)
    link = current()
    assert link is not None
    return link


def _live(core: PrefillDriver, not_: FakeLink | None = None) -> FakeLink:
    """The fake link of the core's live connection to ADDR, which must be there (and be
    a new one after ``not_``)."""
    conn = core.peers.by_address(ADDR)
    assert conn is not None, "not connected"
    link = cast(FakeLink, conn.link)
    assert link is not not_, "still the old link"
    return link


def _resending(retries: int = 2, transferring: float = 30.0,
               ) -> tuple[PrefillDriver, FakeDecode, list[int], QueueExecutor]:
    counted: list[int] = []
    core, fake, io = _queued(record_apart=True, resend_retries=retries,
                             on_resend=lambda: counted.append(1),
                             deadlines=Deadlines(transferring=transferring))
    return core, fake, counted, io


def _fail_first_write(core: PrefillDriver, io: QueueExecutor,
                      status: str = RETRY_EXC) -> FakeLink:
    """Run the queued steps, then fail the first transfer's writes (its data and record)."""
    io.run_all()
    link = _live(core)
    assert len(link.writes) == 2  # the data, then the digest record
    for event in link.finish(link.writes[0][0], ok=False, status=status):
        core.on_event(event)
    return link


def _succeed(core: PrefillDriver, link: FakeLink) -> None:
    """Complete every write of the link's (one) request: its data and its record."""
    for event in link.finish(link.writes[0][0]):
        core.on_event(event)


def _during_handshake(fake: FakeDecode, nth: int, action: Callable[[], None]) -> None:
    """Run ``action`` inside decode's ``nth`` handshake (1: the first), before it answers:
    where a call from another thread would come while the handshake hangs (the core holds
    no lock while it handshakes)."""
    real = fake.connect

    def connect(address: str) -> PeerConn:
        if len(fake.connects) == nth - 1:
            action()
        return real(address)

    fake.connect = connect  # type: ignore[method-assign]


def test_a_failed_write_is_resent_on_a_new_link_and_the_request_succeeds() -> None:
    core, fake, counted, io = _resending()
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    old = _fail_first_write(core, io)
    assert core.status("r").state is TransferState.TRANSFERRING  # not failed
    assert counted == [1] and not old.released  # the resend's step and the release: queued
    io.run_all()
    new = _live(core, not_=old)
    assert len(new.writes) == 1
    assert new.writes[0][1] and len(new.records) == 1  # data and record, one notified write
    assert old.released and fake.connects == [ADDR, ADDR]
    assert [link for _r, link in fake.begins] == [old.id, new.id]  # a new grant
    _succeed(core, new)
    assert core.status("r").state is TransferState.SUCCESS
    assert counted == [1] and fake.aborts == []
    core.periodic()
    assert not core.known("r") and not io.queue


def test_every_posted_chunk_is_resent_in_order() -> None:
    core, _fake, _counted, io = _resending()
    core.send("c", 1000, ADDR, [(0, 256)], False, indices=slot_lists(core, 0, 1000))
    io.run_all()
    old = _live(core)
    assert len(old.writes) == 1
    core.on_event(old.completion(old.writes[0][0]))  # chunk 1 landed
    core.send("c", 1000, ADDR, [(256, 700)], False, indices=slot_lists(core, 0, 1000))
    io.run_all()
    assert len(old.writes) == 2
    core.on_event(old.completion(old.writes[1][0], ok=False, status=RETRY_EXC))
    io.run_all()
    new = _live(core, not_=old)
    # Both chunks again, as one step: the newest chunk covers the first.
    assert len(new.writes) == 1 and old.blocks[0].total_bytes < new.blocks[0].total_bytes
    assert new.blocks[0].total_bytes == old.blocks[0].total_bytes + old.blocks[1].total_bytes
    # Its first final: digested while data flies.
    core.send("c", 1000, ADDR, [], True, indices=slot_lists(core, 0, 1000))
    io.run_all()
    assert len(new.writes) == 3
    assert [notify for _tid, notify in new.writes] == [False, False, True]
    for tid, _ in new.writes:
        core.on_event(new.completion(tid))
    assert core.status("c").state is TransferState.SUCCESS
    facts = core.facts_of("c")
    done, total = facts.bytes_done, facts.bytes_total
    assert done == total > 0


def test_a_late_completion_from_the_old_link_is_ignored() -> None:
    core, _fake, _counted, io = _resending()
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    old = _fail_first_write(core, io)
    io.run_all()
    new = _live(core, not_=old)
    assert len(new.writes) == 1
    # The old link's write reported again, now as done: it proves nothing for the resend.
    core.on_event(old.completion(old.writes[0][0], ok=True))
    assert core.status("r").state is TransferState.TRANSFERRING
    _succeed(core, new)
    assert core.status("r").state is TransferState.SUCCESS


def test_a_resend_waits_until_the_dead_links_writes_completed() -> None:
    core, fake, _counted, io = _resending()
    core.send("c", 1000, ADDR, [(0, 256)], False, indices=slot_lists(core, 0, 1000))
    io.run_all()
    core.send("c", 1000, ADDR, [], True, indices=slot_lists(core, 0, 1000))
    io.run_all()
    old = _live(core)
    assert len(old.writes) == 3  # the chunk, the final's data, the record
    core.on_event(old.completion(old.writes[0][0], ok=False, status=RETRY_EXC))
    io.run_all()  # the dead link's release (its connection is forgotten at once)
    assert fake.connects == [ADDR]  # the final writes may still read the source
    core.on_event(old.completion(old.writes[1][0], ok=False))  # flushed
    assert not io.queue
    assert fake.connects == [ADDR]  # the record's write may still read its staging slot
    core.on_event(old.completion(old.writes[2][0], ok=False))  # flushed
    assert len(io.queue) == 1  # now the resend's step
    io.run_all()
    new = _live(core, not_=old)
    assert len(new.writes) == 1  # the chunk and the final, one step, with its record


def test_retries_zero_fails_at_once_with_the_transport_detail() -> None:
    core, fake, counted, io = _resending(retries=0)
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    _fail_first_write(core, io)
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.TRANSPORT_ERROR
    assert RETRY_EXC in st.detail and "resend" not in st.detail
    assert counted == [] and fake.connects == [ADDR]
    assert fake.aborts == []  # queued: told once both writes drained
    io.run_all()
    # The failed link's connection, and its peer channel, were dropped first: a new
    # handshake opens the channel the Abort goes on (no resend: none was counted).
    assert fake.aborts == ["r"] and fake.connects == [ADDR, ADDR]


def test_decode_is_told_when_the_dead_link_was_dropped_before_the_writes_drained() -> None:
    """The failed write's connection is closed (its DropLink ran) before the request's
    last write completes: decode is still told, over a new handshake, not left to its
    deadline (CI's ``test_resend_retries_zero…`` on a loaded host: the Abort was never
    sent because the closed connection was taken for a request that never connected)."""
    core, fake, counted, io = _resending(retries=0)
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    io.run_all()
    link = _live(core)
    assert len(link.writes) == 2  # the data, then the digest record
    core.on_event(link.completion(link.writes[0][0], ok=False, status=RETRY_EXC))
    io.run_all()  # the DropLink: the connection and its channel are closed
    assert fake.conns[0].closed and fake.aborts == [] and fake.untold == []
    core.on_event(link.completion(link.writes[1][0], ok=False))  # flushed: drained now
    io.run_all()
    assert fake.aborts == ["r"] and fake.untold == [], (fake.aborts, fake.untold)
    assert fake.connects == [ADDR, ADDR] and counted == []
    assert core.status("r").state is TransferState.FAILED


def test_a_permanent_fault_fails_after_the_retries_with_one_abort() -> None:
    core, fake, counted, io = _resending(retries=2)
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    link: FakeLink | None = None
    for attempt in range(3):
        io.run_all()
        link = _live(core, not_=link)
        assert len(link.writes) == (1 if attempt else 2)
        for event in link.finish(link.writes[0][0], ok=False, status=RETRY_EXC):
            core.on_event(event)
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.TRANSPORT_ERROR
    assert st.detail.endswith("after 2 resends") and RETRY_EXC in st.detail
    assert counted == [1, 1] and len(fake.connects) == 3
    io.run_all()
    assert fake.aborts == ["r"] and not io.queue


def test_an_error_that_is_not_transient_fails_at_once() -> None:
    core, fake, counted, io = _resending()
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    _fail_first_write(core, io, status="IBV_WC_REM_ACCESS_ERR")
    st = core.status("r")
    assert st.state is TransferState.FAILED and "IBV_WC_REM_ACCESS_ERR" in st.detail
    io.run_all()
    assert counted == [] and fake.aborts == ["r"]
    assert fake.connects == [ADDR, ADDR]  # the second only to tell decode


def test_a_lost_peer_fails_its_requests_without_a_resend() -> None:
    core, fake, counted, io = _resending()
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    io.run_all()
    link = _live(core)
    assert len(link.writes) == 2
    conn = core.peers.by_address(ADDR)
    assert conn is not None
    core.on_peer_lost(conn, "peer stopped answering heartbeats", gone=True)
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.PEER_FAILED
    assert link.released and not io.queue  # no resend queued, and no one to tell
    assert counted == [] and fake.connects == [ADDR]


def test_other_requests_on_the_failed_link_are_resent_too() -> None:
    core, fake, counted, io = _resending()
    for i in range(3):
        core.send(f"r{i}", 300, ADDR, [], True, indices=slot_lists(core, i, 300))
    io.run_all()
    old = _live(core)
    assert len(old.writes) == 6  # each request's data and record
    core.on_event(old.completion(old.writes[0][0], ok=False, status=RETRY_EXC))
    for tid, _ in old.writes[1:]:
        core.on_event(old.completion(tid, ok=False))  # flushed
    io.run_all()
    new = _live(core, not_=old)
    assert len(new.writes) == 3  # each one write: its digests are kept
    assert fake.connects == [ADDR, ADDR]  # one handshake for all three
    for tid, _ in new.writes:
        core.on_event(new.completion(tid))
    assert all(core.status(f"r{i}").state is TransferState.SUCCESS for i in range(3))
    assert counted == [1, 1, 1] and fake.aborts == []


def _resend_handshaking(core: PrefillDriver, fake: FakeDecode, io: QueueExecutor,
                        during: Callable[[], None]) -> FakeLink:
    """Request "r" posted, its write failed; ``during`` runs inside its resend's
    handshake (before decode answers it); returns the failed link."""
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    io.run_all()
    link = _live(core)
    assert len(link.writes) == 2
    _during_handshake(fake, 2, during)
    for event in link.finish(link.writes[0][0], ok=False, status=RETRY_EXC):
        core.on_event(event)
    return link


def test_abort_during_a_resend_tells_decode_once_and_posts_nothing() -> None:
    """The scheduler's Abort comes while the resend's handshake is under way (run inside
    it: the core holds no lock there, as when it comes from a handler's thread)."""
    core, fake, _counted, io = _resending()
    answers: list[tuple[TransferStatus, int]] = []

    def abort() -> None:
        answers.append((core.abort("r", from_peer=False, detail="scheduler"), len(io.queue)))

    link = _resend_handshaking(core, fake, io, abort)
    io.run_all()
    [(st, queued)] = answers
    assert queued == 1  # answered at once, the Abort to decode queued: nothing in flight
    assert st.state is TransferState.FAILED and st.reason is FailureReason.ABORTED
    assert RETRY_EXC in st.detail  # what made it resend is not lost
    assert len(fake.connects) == 2
    new = _live(core, not_=link)
    assert fake.aborts == ["r"]
    assert new.writes == [] and len(fake.begins) == 1
    core.periodic()
    assert not core.known("r")
    io.run_all()
    assert fake.aborts == ["r"]


def test_a_deadline_passing_during_a_resend_ends_it_with_one_abort() -> None:
    core, fake, _counted, io = _resending()

    def deadline() -> None:
        # The sweep finds the deadline passed while the resend's handshake hangs.
        snap = core.table.fail("r", FailureReason.TIMEOUT, "Transferring took longer than 30 s",
                               now=core.clock())
        assert snap is not None
        core.on_deadline(snap)

    link = _resend_handshaking(core, fake, io, deadline)
    io.run_all()
    assert len(fake.connects) == 2
    new = _live(core, not_=link)
    assert new.writes == [] and fake.aborts == ["r"]
    assert core.status("r").reason is FailureReason.TIMEOUT


def test_a_resend_that_finds_the_request_landed_ends_in_success() -> None:
    core, fake, counted, io = _resending()
    fake.landed.add("r")  # the failed write's acknowledgement was all that was lost
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    old = _fail_first_write(core, io)
    assert core.status("r").state is TransferState.TRANSFERRING
    io.run_all()
    new = _live(core, not_=old)
    assert core.status("r").state is TransferState.SUCCESS
    assert new.writes == [] and counted == [1] and fake.aborts == []
    # The metric gets the request's bytes (what landed), not the resend's (none).
    lists = request_indices(core.spec, 0, 300)
    whole = sum(buf.item_len * len(lists[buf.index_kind]) for buf in core.layout.flat_buffers)
    assert core.status("r").nbytes == whole > 0


def test_resend_retries_setting_defaults_to_two_and_refuses_negatives() -> None:
    env = {"KVBEAM_CONFIG": "side.yaml"}
    assert resolve("prefill", environ=env).resend_retries == 2
    assert resolve("prefill", environ={**env, "KVBEAM_RESEND_RETRIES": "0"}).resend_retries == 0
    with pytest.raises(ConfigError, match="--resend-retries"):
        resolve("prefill", environ={**env, "KVBEAM_RESEND_RETRIES": "-1"})


def test_break_link_fault_hook_is_off_unless_armed() -> None:
    assert not FaultHooks.from_env({}).armed
    hooks = FaultHooks.from_env({BREAK_LINK_ENV: "2:qpbreak-"})
    assert hooks.armed and (hooks.break_links, hooks.break_prefix) == (2, "qpbreak-")
    with pytest.raises(ConfigError, match=BREAK_LINK_ENV):
        FaultHooks.from_env({BREAK_LINK_ENV: "x"})


def test_a_resend_the_deadline_would_cut_fails_at_once_naming_the_verbs_status() -> None:
    core, fake, counted, io = _resending(transferring=0.2)  # under the 0.25 s floor
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    _fail_first_write(core, io)
    st = core.status("r")  # failed by the failed write's completion itself
    assert st.state is TransferState.FAILED
    assert st.reason is FailureReason.TRANSPORT_ERROR, st
    assert RETRY_EXC in st.detail and "no time left to resend" in st.detail, st.detail
    assert "after 0 resends" not in st.detail
    io.run_all()
    assert fake.aborts == ["r"]  # decode is told, not left to time out
    # No resend was started: the second handshake only opens a channel for the Abort.
    assert counted == [] and fake.connects == [ADDR, ADDR]
    assert [rid for rid, _link in fake.begins] == ["r"]


def test_the_time_a_resend_needs_is_the_measured_handshake(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first handshake takes 0.6 s on the core's clock (moved while it runs, no
    sleep); the deadline, 1 s, is enough for the 0.25 s floor, not for twice that."""
    clock = FakeClock(time.monotonic())  # the table's clock is the real one
    core, fake, counted, io = _resending(transferring=1.0)
    core.clock = clock

    def slow() -> None:
        clock.advance(0.6)

    _during_handshake(fake, 1, slow)
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    _fail_first_write(core, io)
    assert core.status("r").state is TransferState.FAILED
    assert "no time left to resend" in core.status("r").detail
    assert counted == [] and fake.connects == [ADDR]
