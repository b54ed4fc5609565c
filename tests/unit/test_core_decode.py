"""Decode's gRPC-free core with a fake prefill side: verification off the event thread."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any, cast, get_args

import pytest

from kvbeam.errors import AlreadyLanded, DialRefused
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest import request_digests
from kvbeam.pools.digest_pool import DigestPool
from kvbeam.server.core import decode_driver, prefill_driver
from kvbeam.server.core.decode_actions import DecodeAction
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.incoming import Landing
from kvbeam.server.core.ports import Offered, WriteGrant
from kvbeam.server.core.prefill_actions import PrefillAction
from kvbeam.server.state.lifecycle import Deadlines, TransferTable
from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.states import NOT_VERIFIED_NO_DIGESTS, FailureReason, TransferState
from kvbeam.transport import Event, EventKind
from tests.core_fakes import FakeLink, fake_conn, flip_digest, land_record
from tests.fixtures import UNIFIED_TARGET, layout

PREFILL = "127.0.0.1:7"


class QueueExecutor(Executor):
    """Runs nothing until the test says so: shows what a call left for the executor."""

    def __init__(self) -> None:
        self.queue: list[Callable[[], Any]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.queue.append(lambda: fn(*args, **kwargs))
        return Future()

    def run_all(self) -> None:
        while self.queue:
            self.queue.pop(0)()


class FakePrefill:
    """Prefill daemons as decode's core sees them: Abort and Offer, recorded.

    An Offer is one-way (protocol 8): ``answer`` None (the default) is prefill keeping
    it without a word, digests to follow; any other answer comes back through
    ``answered`` (the driver's ``offer_answer``, wired by :func:`_core`) at once, or,
    with ``hold`` set, when a test calls it from ``held``. ``sent`` False: no channel.
    """

    def __init__(self) -> None:
        self.aborts: list[str] = []
        self.offers: list[tuple[str, WriteGrant]] = []
        self.answer: Offered | None = None
        self.sent = True
        self.hold = False
        self.held: list[Callable[[], None]] = []
        self.answered: Callable[[str, int, str, Offered], None] | None = None
        self.asked: list[str] = []
        self.connected: Callable[[], str] | None = None
        self.refusal = DialRefused(FailureReason.PEER_UNREACHABLE, "no Connect (fake)",
                                   retry=True)
        self.named: list[tuple[str, ...]] = []  # the request ids each ask named

    def offer(self, conn: PeerConn, request_id: str, seq_len: int, grant: WriteGrant,
              lease_s: float) -> bool:
        if not self.sent:
            return False
        self.offers.append((request_id, grant))
        answer, answered = self.answer, self.answered
        if answer is not None and answered is not None:
            def deliver() -> None:
                answered(request_id, grant.transfer_id, conn.instance_id, answer)
            if self.hold:
                self.held.append(deliver)
            else:
                deliver()
        return True

    def abort(self, conn: PeerConn, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        self.aborts.append(request_id)
        return True

    def abort_all(self, calls: Sequence[tuple[PeerConn, str]], detail: str,
                  timeout: float) -> int:
        return sum(self.abort(conn, rid, detail, timeout) for conn, rid in calls)

    def connect_back(self, address: str, request_ids: Sequence[str] = ()) -> str:
        """Asked to connect: ``connected`` (a callable making the connection, then its
        instance id) or ``refusal``; by default an answer that says nothing (retry)."""
        self.asked.append(address)
        self.named.append(tuple(request_ids))
        if self.connected is not None:
            return self.connected()
        raise self.refusal


def _core() -> tuple[DecodeDriver, QueueExecutor, FakePrefill, PeerConn]:
    lay = layout()
    io, prefill = QueueExecutor(), FakePrefill()
    # inline_below=0: every landing counts as large, so its verification is a job on the
    # executor that a test runs when it chooses (a small landing's inline check has
    # tests of its own, which set the core's digest_pool back to the daemon's default).
    core = DecodeDriver(table=TransferTable(Deadlines()), peers=Peers(), prefill=prefill, io=io,
                      integrity=True, handoff_lease_s=30.0,
                      digest_pool=DigestPool(0, inline_below=0), clock=time.monotonic)
    core.use_pools(UNIFIED_TARGET, lay, AllocatedSide(lay))
    conn = fake_conn(PREFILL, AllocatedSide(lay))
    core.peers.add(conn)
    prefill.answered = core.offer_answer
    return core, io, prefill, conn


def test_a_small_landing_is_verified_on_the_thread_that_saw_it_land() -> None:
    """Digests that run on the calling thread anyway: no executor job, Success before
    the event handler returns."""
    core, io, _prefill, conn = _core()
    core.digest_pool = DigestPool(0)  # the daemon's default: small jobs inline
    res = core.reserve("r", 300, PREFILL)
    core.begin_write("r", conn.instance_id, 300, True)
    land_record(core, "r", request_digests(core.pools, res.indices))
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, res.transfer_id))
    st = core.status("r")
    assert st.state is TransferState.SUCCESS and st.detail.startswith("XXH3-128 verified")
    assert io.queue == []


def test_a_small_landing_that_fails_its_check_fails_at_once_and_tells_prefill_later() -> None:
    """The check runs where the landing was seen, and so does its verdict: the request
    is Failed and its slot freed before the event handler returns; telling prefill (a
    peer call) is the one thing left for the executor."""
    core, io, prefill, conn = _core()
    core.digest_pool = DigestPool(0)
    res = core.reserve("r", 300, PREFILL)
    wrong = flip_digest(request_digests(core.pools, res.indices))
    core.begin_write("r", conn.instance_id, 300, True)
    land_record(core, "r", wrong)
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, res.transfer_id))
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.INTEGRITY
    assert core.slot_of("r") == -1 and prefill.aborts == [] and len(io.queue) == 1
    io.run_all()
    assert prefill.aborts == ["r"]


def test_landing_is_verified_on_the_executor_not_the_event_thread() -> None:
    core, io, _prefill, conn = _core()
    res = core.reserve("r", 300, PREFILL)
    digests = request_digests(core.pools, res.indices)  # what prefill would send
    core.begin_write("r", conn.instance_id, 300, True)
    land_record(core, "r", digests)  # sent after posting
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, res.transfer_id))
    # The event thread only noted the arrival; the CRC check waits on the executor.
    assert core.status("r").state is TransferState.TRANSFERRING
    assert len(io.queue) == 1
    io.run_all()
    st = core.status("r")
    assert st.state is TransferState.SUCCESS and st.detail.startswith("XXH3-128 verified")
    core.release("r")
    assert core.slot_of("r") == -1


def test_integrity_failure_frees_the_slot_and_tells_prefill_from_the_executor() -> None:
    core, io, prefill, conn = _core()
    res = core.reserve("r", 300, PREFILL)
    wrong = flip_digest(request_digests(core.pools, res.indices))
    core.begin_write("r", conn.instance_id, 300, True)
    land_record(core, "r", wrong)
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, res.transfer_id))
    assert prefill.aborts == []
    io.run_all()
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.INTEGRITY
    assert prefill.aborts == ["r"] and core.slot_of("r") == -1


def test_prefills_integrity_flag_comes_with_the_first_pieces_begin_write() -> None:
    """A request in pieces asks BeginWrite for its first piece and may write its final
    one under that grant without asking: the first ask's flag (no digests follow) is
    what decode goes by, not a wait for a record that never comes."""
    core, io, _prefill, conn = _core()
    res = core.reserve("r", 300, PREFILL)
    core.begin_write("r", conn.instance_id, 300, False)
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, res.transfer_id))
    io.run_all()
    st = core.status("r")
    assert st.state is TransferState.SUCCESS and st.detail == NOT_VERIFIED_NO_DIGESTS


def test_abort_after_begin_write_asks_prefill_before_freeing_the_slot() -> None:
    core, io, prefill, conn = _core()
    core.reserve("r", 300, PREFILL)
    core.begin_write("r", conn.instance_id, 300, False)
    st = core.abort("r", from_peer=False, detail="scheduler")
    assert st.state is TransferState.FAILED
    assert core.slot_of("r") != -1  # prefill may still write: the slot stays held
    io.run_all()
    assert prefill.aborts == ["r"] and core.slot_of("r") == -1


def test_link_failure_is_handled_on_the_executor() -> None:
    core, io, _prefill, conn = _core()
    core.reserve("r", 300, PREFILL)
    core.begin_write("r", conn.instance_id, 300, False)
    core.on_event(Event(EventKind.LINK_FAILED, conn.link.id, None, ok=False,
                        status="IBV_EVENT_QP_FATAL"))
    assert not cast(FakeLink, conn.link).released  # the event thread only noted it
    io.run_all()
    assert cast(FakeLink, conn.link).released
    # Only the link failed: the request prefill began writing stays for its resend.
    assert core.status("r").state is TransferState.TRANSFERRING
    assert core.slot_of("r") != -1


def test_a_lost_peer_fails_and_frees_its_requests_at_once() -> None:
    core, _io, _prefill, conn = _core()
    core.reserve("r", 300, PREFILL)
    core.begin_write("r", conn.instance_id, 300, False)
    core.on_peer_lost(conn, "peer stopped answering heartbeats", gone=True)
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.PEER_FAILED
    assert core.slot_of("r") == -1


def _relink(core: DecodeDriver, conn: PeerConn) -> PeerConn:
    """The same prefill instance handshakes again after its link failed: a new link."""
    core.on_peer_lost(conn, "link failed", gone=False)
    new = fake_conn(PREFILL, core.pools)
    new.peer = conn.peer
    core.peers.add(new)
    return new


def test_a_resend_gets_a_new_transfer_id_and_the_old_links_notification_is_ignored() -> None:
    core, io, _prefill, conn = _core()
    res = core.reserve("r", 300, PREFILL)
    digests = request_digests(core.pools, res.indices)
    old_tid = core.begin_write("r", conn.instance_id, 300, True).transfer_id
    land_record(core, "r", digests)
    new = _relink(core, conn)
    new_tid = core.begin_write("r", conn.instance_id, 300, True).transfer_id
    assert new_tid != old_tid
    land_record(core, "r", digests)  # the resend sends them again
    # A late notification from the old link, with the old id or the new one: ignored.
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, old_tid))
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, new_tid))
    assert io.queue == [] and core.facts_of("r").bytes_done == 0
    core.on_event(Event(EventKind.NOTIFIED, new.link.id, new_tid))
    io.run_all()
    st = core.status("r")
    assert st.state is TransferState.SUCCESS and st.detail.startswith("XXH3-128 verified")


def test_a_notification_from_the_granted_link_counts_after_that_link_failed() -> None:
    core, io, _prefill, conn = _core()
    res = core.reserve("r", 300, PREFILL)
    tid = core.begin_write("r", conn.instance_id, 300, False).transfer_id
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, tid))  # arrived, then link died
    core.on_peer_lost(conn, "link failed", gone=False)
    io.run_all()
    assert core.status("r").state is TransferState.SUCCESS
    assert res.landing is Landing.VERIFIED


def test_a_resend_of_a_request_that_already_landed_is_answered_already_landed() -> None:
    core, io, _prefill, conn = _core()
    core.reserve("r", 300, PREFILL)
    tid = core.begin_write("r", conn.instance_id, 300, False).transfer_id
    core.on_event(Event(EventKind.NOTIFIED, conn.link.id, tid))
    io.run_all()
    _relink(core, conn)
    with pytest.raises(AlreadyLanded):
        core.begin_write("r", conn.instance_id, 300, False)
    assert core.status("r").state is TransferState.SUCCESS


def test_each_action_type_has_a_doer_on_both_sides() -> None:
    """The drivers dispatch actions by their exact type (no isinstance chain): every
    type of each side's action union has its doer, and nothing subclasses them."""
    for doers, union in ((decode_driver._DOERS, DecodeAction),
                         (prefill_driver._DOERS, PrefillAction)):
        kinds = set(get_args(union))
        assert set(doers) == kinds
        assert not [k for k in kinds if k.__subclasses__()]
