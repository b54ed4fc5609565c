"""Protocol 2 in the cores: decode's Offer replaces BeginWrite; the digest record (protocol
5) is the final chunk's last write, into decode's mailbox, and the notification follows it.

Both cores run on a queue executor: each test runs the queued jobs when it chooses, with
no threads and no sleeps (:func:`_connected` stays on a thread pool for other modules)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest

from kvbeam.errors import TransportError, UnknownRequest
from kvbeam.pools.digest import request_digests
from kvbeam.pools.digest_pool import DigestJob, DigestPool
from kvbeam.pools.indices import request_indices
from kvbeam.pools.mailbox import encode_record
from kvbeam.server.core import prefill as prefill_module
from kvbeam.server.core.decode import WAITING_FOR_DIGESTS
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.incoming import Landing
from kvbeam.server.core.outgoing import Step
from kvbeam.server.core.ports import Offered, WriteGrant
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.faults import FaultHooks, arm
from kvbeam.server.state.lifecycle import Deadlines
from kvbeam.server.state.peers import PeerConn
from kvbeam.states import NOT_VERIFIED_NO_DIGESTS, FailureReason, TransferState
from kvbeam.transport import Event, EventKind
from tests.core_fakes import (
    FakeDecode,
    FakeLink,
    SilentChannel,
    flip_digest,
    land_record,
    prefill_core,
    slot_lists,
    wait_for,
)
from tests.fixtures import UNIFIED_TARGET
from tests.unit.test_core_decode import PREFILL, FakePrefill, QueueExecutor, _core
from tests.unit.test_core_prefill import _queued

ADDR = "127.0.0.1:9"
SEQ = 300


# ---- prefill ----------------------------------------------------------------------------
def _connected(**kw: object) -> tuple[PrefillDriver, FakeDecode, PeerConn, list[str]]:
    """A prefill core that already handshook with decode (one request, by BeginWrite)."""
    core, fake = prefill_core(**kw)  # type: ignore[arg-type]
    conn, events = _first_request(core, fake, lambda: None)
    return core, fake, conn, events


def _queued_connected(**kw: Any) -> tuple[PrefillDriver, FakeDecode, PeerConn, list[str],
                                          QueueExecutor]:
    """:func:`_connected` on a queue executor: nothing runs until the test runs it. The
    digests are computed at once, yet handed back as a pool's job, so a first attempt's
    final chunk is still its data and then its record, two writes."""
    core, fake, io = _queued(record_apart=True, **kw)
    conn, events = _first_request(core, fake, io.run_all)
    return core, fake, conn, events, io


def _first_request(core: PrefillDriver, fake: FakeDecode,
                   run: Callable[[], None]) -> tuple[PeerConn, list[str]]:
    """Send a first request (``run`` runs what it queued; a thread pool's needs nothing)
    and complete it: the core is connected, and records what happens to offers."""
    events: list[str] = []
    core.on_offer = events.append
    core.send("first", SEQ, ADDR, [], True, indices=slot_lists(core, 0, SEQ))
    run()
    # True at once after a queue executor's run; a thread pool's is polled.
    assert wait_for(lambda: len(fake.begins) == 1 and len(fake.digests) == 1)
    conn = core.peers.by_address(ADDR)
    assert conn is not None
    link = cast(FakeLink, conn.link)
    assert link.writes == [(link.writes[0][0], False), (link.writes[0][0], True)]
    for event in link.finish(link.writes[0][0]):  # its data, then its digest record
        core.on_event(event)
    assert core.status("first").state is TransferState.SUCCESS
    assert events == ["missed"]  # the first request found no offer: it asked BeginWrite
    events.clear()
    return conn, events


def _grant(tid: int) -> WriteGrant:
    return WriteGrant(tid, request_indices(UNIFIED_TARGET, 2, SEQ))


def test_an_offered_request_posts_its_writes_without_begin_write_then_its_record() -> None:
    core, fake, conn, events, io = _queued_connected()
    grant = WriteGrant(77, request_indices(UNIFIED_TARGET, 2, SEQ), mailbox_slot=5)
    assert core.offer("r", conn.instance_id, SEQ, grant, lease_s=10.0)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    link = cast(FakeLink, conn.link)
    assert len(link.writes) == 3 and len(io.queue) == 1  # the data; the record is queued
    io.run_all()
    assert len(link.writes) == 4 and len(fake.digests) == 2
    # The offer's transfer id: the data unnotified, then the record with the notification.
    assert link.writes[2:] == [(77, False), (77, True)]
    assert [rid for rid, _ in fake.begins] == ["first"], "BeginWrite was called for r"
    want = request_digests(core.pools, request_indices(UNIFIED_TARGET, 1, SEQ))
    assert fake.digests[1] == ("r", 77, want)
    # The record goes from a staging slot into decode's mailbox slot 5, whole.
    record = link.blocks[3]
    assert conn.mailbox is not None and int(record.dst[0]) == conn.mailbox.slot_addr(5)
    assert link.records[1][1] == encode_record(77, 5, "r", want)
    assert core.status("r").state is TransferState.TRANSFERRING
    core.on_event(link.completion(77))  # the data: not yet Success, the record is out
    assert core.status("r").state is TransferState.TRANSFERRING and core.in_flight("r") == 1
    core.on_event(link.completion(77))
    assert core.status("r").state is TransferState.SUCCESS
    assert events == ["received", "used"]
    assert len(core.core.offers) == 0


def test_a_send_before_the_reserve_falls_back_to_begin_write_and_a_late_offer_is_refused(
        ) -> None:
    core, fake, conn, events, io = _queued_connected()
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    io.run_all()
    assert len(fake.begins) == 2
    assert fake.begins[1][0] == "r"
    assert events == ["missed"]
    assert not core.offer("r", conn.instance_id, SEQ, _grant(77), lease_s=10.0)
    assert events == ["missed", "refused"] and len(core.core.offers) == 0


def test_with_send_wait_a_send_before_the_offer_waits_for_it_instead_of_asking() -> None:
    core, fake, conn, events, io = _queued_connected(send_wait_s=5.0)
    link = cast(FakeLink, conn.link)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    assert core.status("r").state is TransferState.WAITING_FOR_INPUT
    assert core.offer("r", conn.instance_id, SEQ, _grant(77), lease_s=10.0)  # unparks it
    io.run_all()
    assert len(link.writes) == 4
    assert link.writes[2:] == [(77, False), (77, True)]
    assert [rid for rid, _ in fake.begins] == ["first"], "BeginWrite was called for r"
    assert core.status("r").state is TransferState.TRANSFERRING
    assert events == ["received", "used"]


def _count_jobs(core: PrefillDriver) -> list[str]:
    """The names of the jobs the core hands its executor from now on."""
    jobs: list[str] = []
    submit = core.io.submit

    def counted(fn: object, *args: object, **kw: object) -> object:
        jobs.append(getattr(fn, "__name__", repr(fn)))
        return submit(fn, *args, **kw)  # type: ignore[arg-type]

    core.io.submit = counted  # type: ignore[method-assign,assignment]
    return jobs


def test_a_send_before_the_offer_parks_at_once_and_the_offer_runs_its_one_step() -> None:
    core, fake, conn, events, io = _queued_connected(send_wait_s=5.0)
    jobs = _count_jobs(core)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    # Parked before send returned: no executor job ran only to park it.
    assert core.status("r").state is TransferState.WAITING_FOR_INPUT and jobs == []
    assert core.offer("r", conn.instance_id, SEQ, _grant(77), lease_s=10.0)  # unparks it
    link = cast(FakeLink, conn.link)
    # Its one step ran on the Offer's thread: only the wait for the digest pool (the
    # record's write) went to the executor.
    assert link.writes[2:] == [(77, False)] and jobs == ["_post_record"]
    io.run_all()
    assert len(link.writes) == 4 and jobs == ["_post_record"]
    assert events == ["received", "used"]
    assert [rid for rid, _ in fake.begins] == ["first"], "BeginWrite was called for r"


def test_an_offered_small_send_posts_on_the_senders_thread() -> None:
    """With decode's offer in hand a small request's step cannot block: the Send posts
    its data before it returns (no executor hand-off); the digest record follows once
    the pool's digests are done (waited for on the executor)."""
    core, fake, conn, events, io = _queued_connected()
    link = cast(FakeLink, conn.link)
    assert core.offer("r", conn.instance_id, SEQ, _grant(77), lease_s=10.0)
    jobs = _count_jobs(core)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    assert link.writes[2:] == [(77, False)], "the data was not posted by send itself"
    assert jobs == ["_post_record"]
    io.run_all()
    assert len(link.writes) == 4 and len(fake.digests) == 2
    assert link.writes[3] == (77, True) and jobs == ["_post_record"]
    assert events == ["received", "used"]
    want = request_digests(core.pools, request_indices(UNIFIED_TARGET, 1, SEQ))
    assert fake.digests[1] == ("r", 77, want)


def test_an_offered_small_send_with_inline_digests_is_one_write_and_no_job() -> None:
    """Digests small enough to run on the calling thread (the daemon's default pool):
    the record is the data write's last block, and nothing goes to the executor."""
    core, _fake, conn, _events, io = _queued_connected()
    core.digest_pool = DigestPool(0)  # every job inline, as a small request's in a daemon
    link = cast(FakeLink, conn.link)
    assert core.offer("r", conn.instance_id, SEQ, _grant(77), lease_s=10.0)
    jobs = _count_jobs(core)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    assert link.writes[2:] == [(77, True)] and len(link.records) == 2 and jobs == []
    assert not io.queue
    core.on_event(link.completion(77))
    assert core.status("r").state is TransferState.SUCCESS


def test_a_request_over_the_inline_bound_steps_on_the_executor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    core, _fake, conn, _events, io = _queued_connected()
    monkeypatch.setattr(prefill_module, "INLINE_STEP_MAX_PAGES", 1)
    assert core.offer("r", conn.instance_id, SEQ, _grant(77), lease_s=10.0)
    jobs = _count_jobs(core)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    link = cast(FakeLink, conn.link)
    assert jobs == ["_step_job"] and len(link.writes) == 2  # nothing posted by send itself
    io.run_all()
    assert jobs == ["_step_job"] and link.writes[2:] == [(77, False), (77, True)]


def test_an_armed_write_delay_keeps_the_step_on_the_executor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The armed delay is recorded instead of slept: it is taken on the executor's step,
    never on the sender's thread."""
    core, _fake, conn, _events, io = _queued_connected()
    hooks = FaultHooks(write_delay_s=0.01)  # a hook that sleeps before the post
    delays: list[float] = []
    monkeypatch.setattr(hooks, "slow_wire", lambda: delays.append(0.01))
    arm(core, hooks)
    assert core.offer("r", conn.instance_id, SEQ, _grant(77), lease_s=10.0)
    jobs = _count_jobs(core)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    link = cast(FakeLink, conn.link)
    assert jobs == ["_step_job"] and delays == [] and len(link.writes) == 2
    io.run_all()
    assert len(link.writes) == 4 and delays == [0.01]


def test_an_offer_gone_before_the_inline_step_asks_begin_write_from_the_executor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The offer is checked without the lock: when it went (aborted, expired) before
    the step took it, the step does not ask BeginWrite on the sender's thread."""
    core, fake, conn, events, io = _queued_connected()
    monkeypatch.setattr(core.core.offers, "has", lambda _rid: True)  # it looked offered
    jobs = _count_jobs(core)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    # The step started inline, found no offer (counted a miss), and handed its
    # BeginWrite, and what follows it, to the executor.
    assert jobs == ["execute"] and [rid for rid, _ in fake.begins] == ["first"]
    assert events == ["missed"]
    io.run_all()
    link = cast(FakeLink, conn.link)
    assert len(link.writes) == 4
    assert jobs[0] == "execute" and [rid for rid, _ in fake.begins] == ["first", "r"]
    assert events == ["missed"]  # counted once


def test_an_inline_post_that_fails_is_resent_on_a_new_link_from_the_executor() -> None:
    core, fake, conn, _events, io = _queued_connected(resend_retries=1)
    old = cast(FakeLink, conn.link)
    assert core.offer("r", conn.instance_id, SEQ, _grant(77), lease_s=10.0)
    real = old.write

    def broken(transfer_id: int, blocks: object, notify: bool = True) -> None:
        if transfer_id == 77:
            raise TransportError("link 1: QP in error state", "IBV_WC_RETRY_EXC_ERR")
        real(transfer_id, blocks, notify)  # type: ignore[arg-type]

    old.write = broken  # type: ignore[method-assign]
    jobs = _count_jobs(core)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    assert core.status("r").state is TransferState.TRANSFERRING  # not failed on this thread
    # The link's release, and what follows it, on the executor.
    assert jobs == ["execute"] and not old.released
    io.run_all()
    # Resent under a new grant; its digests were never recorded (the post failed before
    # the record), so the resend's data and record are two writes again.
    assert len(fake.links) == 2 and len(fake.links[1].writes) == 2
    new = fake.links[1]
    assert jobs[0] == "execute" and old.released
    assert [rid for rid, link in fake.begins][-1] == "r" and fake.begins[-1][1] == new.id
    for event in new.finish(new.writes[0][0]):
        core.on_event(event)
    assert core.status("r").state is TransferState.SUCCESS


def test_with_send_wait_no_offer_within_the_grace_asks_begin_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    core, fake, conn, _events, io = _queued_connected(send_wait_s=5.0)
    core.send("s", SEQ, ADDR, [], True,
              indices=slot_lists(core, 1, SEQ))  # decode reserved without offering it
    assert core.status("s").state is TransferState.WAITING_FOR_INPUT
    core.periodic()  # within the grace: it keeps waiting
    assert not io.queue
    monkeypatch.setattr(prefill_module, "OFFER_GRACE_S", 0.0)
    core.periodic()  # the sweep: the grace passed
    io.run_all()
    assert [rid for rid, _ in fake.begins] == ["first", "s"]
    link = cast(FakeLink, conn.link)
    assert len(link.writes) == 4


def test_with_send_wait_decode_without_the_reservation_keeps_it_waiting_until_the_lease(
        monkeypatch: pytest.MonkeyPatch) -> None:
    core, fake, _conn, _events, io = _queued_connected(send_wait_s=0.3)
    fake.not_yet.add("t")  # BeginWrite: decode has no reservation yet (NotReserved)
    core.send("t", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    assert core.status("t").state is TransferState.WAITING_FOR_INPUT
    monkeypatch.setattr(prefill_module, "OFFER_GRACE_S", 0.0)  # the grace passed
    core.periodic()
    io.run_all()
    assert fake.refused_not_yet == ["t"]
    core.periodic()  # asked once: only decode's Offer (or the lease) ends the wait now
    assert not io.queue
    assert fake.refused_not_yet == ["t"]
    assert core.status("t").state is TransferState.WAITING_FOR_INPUT
    expired = core.table.expire(core.clock() + 0.35)  # the lease, 0.3 s, has passed
    assert [s.request_id for s in expired] == ["t"]
    assert expired[0].reason is FailureReason.TIMEOUT
    assert "for 0.3 s (decode's reservation" in expired[0].detail, expired[0].detail


def test_an_offer_over_a_previous_connection_is_ignored() -> None:
    core, fake, conn, events, io = _queued_connected()
    assert core.offer("r", conn.instance_id, SEQ, _grant(77), lease_s=10.0)
    # Decode's instance changed behind the connection (prefill has not noticed a loss):
    # the next request handshakes a new connection, which the offer did not come over.
    core.peers.remove(conn)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    io.run_all()
    assert len(fake.begins) == 2
    new = core.peers.by_address(ADDR)
    assert new is not None and new is not conn
    assert len(cast(FakeLink, new.link).writes) == 2
    assert cast(FakeLink, new.link).writes[0][0] != 77
    assert events == ["received", "missed"]


@pytest.mark.parametrize("change", ["seq_len", "expired"])
def test_an_offer_that_does_not_fit_the_send_is_not_used(change: str) -> None:
    """An offer for another length, or one whose lease passed (granted with a lease
    already over: no sleep)."""
    core, fake, conn, events, io = _queued_connected()
    assert core.offer("r", conn.instance_id, SEQ + (change == "seq_len"), _grant(77),
                      lease_s=10.0 if change == "seq_len" else -1.0)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    io.run_all()
    assert len(fake.begins) == 2
    assert events == ["received", "missed"]


@pytest.mark.parametrize("reason", [None, FailureReason.INCOMPATIBLE])
def test_decodes_verdict_before_the_send_fails_the_send_with_its_reason(
        reason: FailureReason | None) -> None:
    """Decode ended a request before prefill's engine sent it (its Connect's handshake
    was refused: ``incompatible``; else decode's word: ``peer_failed``): the Send that
    comes within ``send_wait_s`` fails at once, with that reason, as the Send's own
    handshake would have failed it."""
    core, _fake, _conn, _events, _io = _queued_connected(send_wait_s=5.0)
    with pytest.raises(UnknownRequest):  # prefill has no Send of it yet
        core.abort("early", from_peer=True, detail="the pair could not connect",
                   reason=reason)
    core.send("early", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    st = core.status("early")
    assert st.state is TransferState.FAILED, st
    assert st.reason is (reason or FailureReason.PEER_FAILED), st
    assert "the pair could not connect" in st.detail, st


def test_abort_and_peer_loss_drop_offers_and_the_book_is_bounded() -> None:
    core, _fake, conn, events, io = _queued_connected()
    core.core.offers.capacity = 2
    assert core.offer("a", conn.instance_id, SEQ, _grant(1), lease_s=10.0)
    assert core.offer("b", conn.instance_id, SEQ, _grant(2), lease_s=10.0)
    assert not core.offer("c", conn.instance_id, SEQ, _grant(3), lease_s=10.0)  # full
    with pytest.raises(UnknownRequest):  # prefill never saw a Send of it
        core.abort("a", from_peer=True, detail="decode aborted")
    assert len(core.core.offers) == 1
    core.on_peer_lost(conn, "link failed", gone=False)
    assert len(core.core.offers) == 0
    assert events == ["received", "received", "refused"]
    assert not io.queue


# ---- decode -----------------------------------------------------------------------------
def _offered(answer: Offered | None = None, deadlines: Deadlines | None = None
             ) -> tuple[DecodeDriver, QueueExecutor, FakePrefill, PeerConn, bytes]:
    """A reservation offered to prefill, which keeps it without a word (``answer``
    None: digests follow) or answers ``answer`` at once."""
    core, io, prefill, conn = _core()
    if deadlines is not None:
        core.table.deadlines = deadlines
    prefill.answer = answer
    res = core.reserve("r", SEQ, PREFILL)
    assert core.offer(res)  # sent (and, the fake, answered at once when it answers)
    assert [rid for rid, _ in prefill.offers] == ["r"]
    assert prefill.offers[0][1].transfer_id == res.transfer_id
    return core, io, prefill, conn, request_digests(core.pools, res.indices)


def _notify(core: DecodeDriver, conn: PeerConn) -> None:
    tid = core.core._reservation("r").transfer_id
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, tid))


def test_an_offered_request_is_verified_from_its_record_once_the_notification_came() -> None:
    core, io, _prefill, conn, digests = _offered()
    assert prefill_offer_slot(_prefill) == core.core._reservation("r").mailbox_slot
    land_record(core, "r", digests)
    assert io.queue == []  # nothing landed yet: the record alone proves nothing
    _notify(core, conn)
    assert core.status("r").state is TransferState.TRANSFERRING
    assert len(io.queue) == 1
    io.run_all()
    st = core.status("r")
    assert st.state is TransferState.SUCCESS and st.detail.startswith("XXH3-128 verified")


def prefill_offer_slot(prefill: FakePrefill) -> int:
    """The mailbox slot decode's Offer named."""
    return prefill.offers[-1][1].mailbox_slot


def test_a_wrong_digest_in_the_record_fails_integrity() -> None:
    core, io, prefill, conn, digests = _offered()
    land_record(core, "r", flip_digest(digests))
    _notify(core, conn)
    io.run_all()
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.INTEGRITY
    assert st.detail.startswith("XXH3-128 mismatch in 1 buffer(s)"), st.detail
    assert prefill.aborts == ["r"] and core.slot_of("r") == -1


def test_a_landing_without_a_record_fails_integrity_naming_the_magic() -> None:
    """Prefill said its digests follow (an answer it need not send since protocol 8, as
    BeginWrite's flag says it), the marker came, the slot holds no record (it was
    cleared when reserved): never Success, never a wait."""
    core, io, prefill, conn, _digests = _offered(Offered.DIGESTS_FOLLOW)
    _notify(core, conn)
    io.run_all()
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.INTEGRITY
    assert st.detail.startswith("digest record: magic: 0x00000000, expected 0x5244564b"), \
        st.detail
    assert prefill.aborts == ["r"] and core.slot_of("r") == -1


@pytest.mark.parametrize(("field", "kw"), [("transfer_id", {"transfer_id": 999}),
                                           ("slot", {"slot": 7})])
def test_a_record_of_another_transfer_or_slot_fails_naming_the_field(
        field: str, kw: dict[str, int]) -> None:
    core, io, _prefill, conn, digests = _offered()
    land_record(core, "r", digests, **kw)
    _notify(core, conn)
    io.run_all()
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.INTEGRITY
    assert st.detail.startswith(f"digest record: {field}: {next(iter(kw.values()))}, "
                                "expected "), st.detail


def test_a_stale_record_of_an_earlier_request_in_the_slot_never_passes() -> None:
    core, io, _prefill, conn, digests = _offered()
    slot = core.core._reservation("r").mailbox_slot
    land_record(core, "r", digests)  # the record of r
    core.abort("r", from_peer=True, detail="prefill failed", instance_id=conn.instance_id)
    io.run_all()
    res = core.reserve("r2", SEQ, PREFILL)  # the same slot again: its header is cleared
    assert res.mailbox_slot == slot
    assert core.mailbox is not None and not core.mailbox.has_record(slot)


def test_no_flag_and_no_record_waits_for_the_offers_answer_then_times_out() -> None:
    """Kept without a word, landed, and no record in the slot: prefill's integrity may
    be off and its OFFER_ANSWER still on the way, so the check waits for it, bounded by
    the Transferring deadline."""
    core, io, _prefill, conn, _digests = _offered(deadlines=Deadlines(transferring=0.05))
    _notify(core, conn)
    io.run_all()
    assert core.status("r").state is TransferState.TRANSFERRING
    expired = core.table.expire(core.clock() + 0.1)
    assert [s.request_id for s in expired] == ["r"]
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.TIMEOUT
    assert WAITING_FOR_DIGESTS in st.detail
    core.on_deadline(expired[0])
    io.run_all()
    with pytest.raises(UnknownRequest):  # the slot is freed
        core.core._reservation("r")


def test_a_record_in_the_slot_stands_for_an_unanswered_offer() -> None:
    """The usual case since protocol 8: no answer (kept), the record says digests follow."""
    core, io, _prefill, conn, digests = _offered()
    land_record(core, "r", digests)
    _notify(core, conn)
    assert len(io.queue) == 1
    io.run_all()
    assert core.status("r").state is TransferState.SUCCESS


def test_a_notification_before_the_offers_answer_still_counts() -> None:
    core, io, prefill, conn = _core()
    res = core.reserve("r", SEQ, PREFILL)
    prefill.hold = True
    prefill.answer = Offered.DIGESTS_FOLLOW  # an answer decode need not have
    assert core.offer(res)
    # Prefill used the offer at once: its record and notification beat the answer.
    land_record(core, "r", request_digests(core.pools, res.indices))
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, res.transfer_id))
    # No answer yet: the record says digests follow.
    assert res.landing is Landing.VERIFYING and len(io.queue) == 1
    prefill.held.pop()()  # the answer comes: the check is not queued twice
    assert len(io.queue) == 1
    io.run_all()
    assert core.status("r").state is TransferState.SUCCESS


def test_an_offer_kept_without_digests_lands_unverified() -> None:
    core, io, _prefill, conn, _digests = _offered(Offered.NO_DIGESTS)
    _notify(core, conn)
    io.run_all()
    st = core.status("r")
    assert st.state is TransferState.SUCCESS and st.detail == NOT_VERIFIED_NO_DIGESTS


def test_an_offered_reservation_is_drained_on_abort_a_refused_one_is_freed_at_once() -> None:
    core, io, prefill, _conn, _digests = _offered()
    core.abort("r", from_peer=False, detail="scheduler")
    assert core.slot_of("r") != -1  # prefill may write: asked to drain first
    io.run_all()
    assert prefill.aborts == ["r"] and core.slot_of("r") == -1

    core, io, prefill, _conn, _digests = _offered(Offered.REFUSED)
    assert not core.core._reservation("r").peer_instance  # the grant was taken back
    core.abort("r", from_peer=False, detail="scheduler")
    assert core.slot_of("r") == -1  # freed at once: prefill cannot write


def test_no_offer_without_a_connection_to_the_prefill() -> None:
    core, _io, prefill, conn = _core()
    core.peers.remove(conn)
    assert not core.offer(core.reserve("r", SEQ, PREFILL))
    assert prefill.offers == []


def test_no_offer_to_a_prefill_that_misses_heartbeats() -> None:
    """A peer not answering heartbeats (slow, partitioned) would make Reserve wait."""
    core, _io, prefill, conn = _core()
    conn.channel = SilentChannel(1)
    assert not core.offer(core.reserve("r", SEQ, PREFILL))
    assert prefill.offers == [] and not core.core._reservation("r").peer_instance
    conn.channel = None
    assert core.offer(core.reserve("r2", SEQ, PREFILL))
    assert len(prefill.offers) == 1


def test_a_resend_sends_the_digests_computed_once_with_its_new_transfer_id(
        monkeypatch: pytest.MonkeyPatch) -> None:
    computed: list[str] = []
    real = DigestPool.start

    def counting(*args: object, **kw: object) -> DigestJob:
        computed.append("x")
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(DigestPool, "start", counting)  # the cores digest on the pool
    core, fake, io = _queued(record_apart=True, resend_retries=1)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 0, SEQ))
    io.run_all()
    conn = core.peers.by_address(ADDR)
    assert conn is not None
    old = cast(FakeLink, conn.link)
    assert len(old.writes) == 2 and len(fake.digests) == 1
    for event in old.finish(old.writes[0][0], ok=False, status="IBV_WC_RETRY_EXC_ERR"):
        core.on_event(event)  # the data and the record, flushed
    io.run_all()
    assert len(fake.digests) == 2
    (r1, tid1, d1), (r2, tid2, d2) = fake.digests
    assert r1 == r2 == "r" and tid1 != tid2 and d1 == d2
    assert computed == ["x"], "the resend digested the source again"


@pytest.mark.parametrize("answer", [None, Offered.REFUSED])
def test_a_kept_offer_grows_the_lease_by_the_bytes_time_only(answer: Offered | None) -> None:
    """Sent and not refused (no answer: kept), the lease grows by the bytes' time at the
    floor rate; refused before that, it does not."""
    core, _io, prefill, _conn = _core()
    core.table.deadlines = Deadlines(bootstrapping=10.0)
    core.core.wire_s = lambda n: 5.0 if n > 0 else 0.0
    prefill.answer = answer
    res = core.reserve("r", SEQ, PREFILL)
    core.offer(res)
    left = core.table.left("r", now=core.clock())
    assert left is not None
    want = 15.0 if answer is None else 10.0  # never the 30 s Transferring
    assert want - 0.5 < left <= want, left


@pytest.mark.parametrize("stale", ["transfer_id", "instance", "request"])
def test_an_answer_to_an_offer_the_reservation_no_longer_has_changes_nothing(
        stale: str) -> None:
    """An OFFER_ANSWER names the request, its transfer id and (by its channel) the
    prefill: one naming another transfer, another prefill or no live request is only
    counted; the grant stays."""
    core, _io, prefill, conn, _digests = _offered()
    res = core.core._reservation("r")
    events: list[str] = []
    core.on_offer = events.append
    rid, tid, who = "r", res.transfer_id, conn.instance_id
    if stale == "transfer_id":
        tid += 16
    elif stale == "instance":
        who = "another-prefill"
    else:
        rid = "gone"
    core.offer_answer(rid, tid, who, Offered.REFUSED)
    assert res.peer_instance == conn.instance_id and res.offered  # still granted
    assert events == ["refused"]
    core.offer_answer("r", res.transfer_id, conn.instance_id, Offered.REFUSED)
    assert not res.peer_instance and not res.offered  # the current one takes it back
    assert prefill.offers and events == ["refused", "refused"]


def test_an_offer_that_cannot_be_sent_counts_as_refused() -> None:
    core, _io, prefill, _conn = _core()
    events: list[str] = []
    core.on_offer = events.append
    prefill.sent = False  # no open channel
    res = core.reserve("r", SEQ, PREFILL)
    core.offer(res)
    assert events == ["refused"] and not res.peer_instance and not res.offered


def test_an_offer_that_comes_while_the_send_asks_begin_write_is_kept_and_unparks_it() -> None:
    """Decode reserves (and offers) just after refusing the Send's BeginWrite for want of
    a reservation: the offer must not be refused as late, or the parked Send would wait
    for an offer that already came, until --send-wait-s."""
    core, fake, conn, events, io = _queued_connected(send_wait_s=5.0)
    conn.channel = SilentChannel(1)  # no waiting for an offer first: the Send asks at once
    fake.not_yet.add("r")
    real = fake.begin_write

    def racing(c: PeerConn, rid: str, *args: object) -> WriteGrant:
        if rid == "r":  # decode's Offer overtakes its refusal of this BeginWrite
            assert core.offer("r", conn.instance_id, SEQ, _grant(77), lease_s=10.0)
        return real(c, rid, *args)  # type: ignore[arg-type]

    fake.begin_write = racing  # type: ignore[method-assign,assignment]
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    io.run_all()
    link = cast(FakeLink, conn.link)
    assert len(link.writes) == 4, core.status("r")
    assert link.writes[2:] == [(77, False), (77, True)]  # written under the offer
    assert events == ["missed", "received", "used"]


def test_chunks_of_a_parked_request_wait_for_the_offer_and_go_as_one_step() -> None:
    """A chunked Send whose decode has not reserved yet parks (its BeginWrite refused);
    its later chunk stays parked with it (no BeginWrite per chunk: decode would only
    say again that nothing is reserved), and decode's Offer runs one step, the newest
    chunk's, under the offered grant."""
    core, fake, conn, events, io = _queued_connected(send_wait_s=5.0)
    conn.channel = SilentChannel(1)  # no waiting for an offer first: the Send asks at once
    fake.not_yet.add("c")
    core.send("c", SEQ, ADDR, [(0, 256)], False,
              indices=slot_lists(core, 1, SEQ))  # its first page
    io.run_all()
    assert fake.refused_not_yet == ["c"] and core.core._out["c"].step is Step.PARKED
    core.send("c", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    assert not io.queue, "a chunk of a parked request started a step"
    fake.not_yet.discard("c")
    assert core.offer("c", conn.instance_id, SEQ, _grant(88), lease_s=10.0)
    io.run_all()
    link = cast(FakeLink, conn.link)
    assert fake.refused_not_yet == ["c"] and [r for r, _ in fake.begins] == ["first"]
    assert [tid for tid, _ in link.writes[2:]] == [88, 88], link.writes  # data, record
    assert events[-1] == "used"
