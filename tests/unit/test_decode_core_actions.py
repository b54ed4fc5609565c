"""Decode's core as a state machine: feed it events, compare the actions it returns.

No executor, no fake prefill, no threads, no clock: the core does no I/O, so each
test is a list of events and the exact actions each returns (h11's and raft's tests
read this way). The driver that does these actions has its own tests
(test_core_decode.py and the others that build a ``DecodeDriver``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from kvbeam.errors import DialRefused
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest import DigestParts, request_digests
from kvbeam.pools.digest_pool import DigestPool
from kvbeam.server.core.actions import Count, DropLink
from kvbeam.server.core.decode import DecodeCore
from kvbeam.server.core.decode_actions import (
    CheckLanding,
    DialPrefill,
    DigestMark,
    DrainPrefill,
    Freed,
    SendOffer,
    TellPrefill,
)
from kvbeam.server.core.decode_landing import LandingCheck, Verdict
from kvbeam.server.core.incoming import Incoming, Landing
from kvbeam.server.core.pairing import ASK_AGAIN_AFTER_S
from kvbeam.server.core.ports import Offered
from kvbeam.server.state.lifecycle import Deadlines, TransferTable
from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.states import FailureReason, TransferState, TransferStatus
from kvbeam.transport import Event, EventKind
from tests.core_fakes import fake_conn, land_record
from tests.fixtures import UNIFIED_TARGET, layout

PREFILL = "127.0.0.1:7"
OK = Verdict(True, "XXH3-128 verified: 13 buffers match prefill's digests",
             digests=bytes(16 * 13))


def _core(integrity: bool = True, budget_s: float = 0.0, check_inline_below: int = 0,
          on_change: Callable[[TransferStatus], None] | None = None
          ) -> tuple[DecodeCore, PeerConn]:
    lay = layout()
    core = DecodeCore(table=TransferTable(Deadlines(), on_change=on_change), peers=Peers(),
                      integrity=integrity, handoff_lease_s=30.0,
                      transfer_budget=lambda _n: budget_s,
                      check_inline_below=check_inline_below)
    core.take_pools(UNIFIED_TARGET, lay, AllocatedSide(lay))
    conn = fake_conn(PREFILL, AllocatedSide(lay))
    core.peers.add(conn)
    return core, conn


def _check(res: Incoming) -> CheckLanding:
    """The check of ``res``'s current landing, as the core asks for it."""
    return CheckLanding(res.ref, res.view(), res.transfer_id)


def _landed(core: DecodeCore, conn: PeerConn, tid: int) -> list[object]:
    return list(core.on_event(Event(EventKind.NOTIFIED, conn.link.id, tid), now=5.0))


def test_a_begun_write_that_lands_asks_for_its_check_and_the_verdict_is_success() -> None:
    core, conn = _core()
    res = core.reserve("r", 300, PREFILL, now=0.0)
    core.begin_write("r", conn.instance_id, 300, True, now=0.0)
    assert _landed(core, conn, res.transfer_id) == [_check(res)]
    assert res.landing is Landing.VERIFYING  # asked once: a second notification asks nothing
    assert _landed(core, conn, res.transfer_id) == []
    assert core.checked(res.ref, res.transfer_id, OK, now=6.0) == []
    st = core.status("r")
    assert st.state is TransferState.SUCCESS and st.detail == OK.detail
    assert res.success_at == 6.0 and res.digests == bytes(16 * 13)


def test_a_failed_verdict_frees_the_slot_then_tells_prefill() -> None:
    core, conn = _core()
    res = core.reserve("r", 300, PREFILL, now=0.0)
    core.begin_write("r", conn.instance_id, 300, True, now=0.0)
    _landed(core, conn, res.transfer_id)
    bad = Verdict(False, "XXH3-128 mismatch in 1 buffer(s): target.layer1.c4_kv")
    assert core.checked(res.ref, res.transfer_id, bad, now=6.0) == [
        Freed("r"), TellPrefill(conn, "r", f"decode integrity check failed: {bad.detail}")]
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.INTEGRITY
    assert core.slot_of("r") == -1


def test_a_verdict_on_a_replaced_landing_does_nothing() -> None:
    core, conn = _core()
    res = core.reserve("r", 300, PREFILL, now=0.0)
    core.begin_write("r", conn.instance_id, 300, True, now=0.0)
    old = res.transfer_id
    _landed(core, conn, old)
    res.transfer_id += 16  # what a relink does, under the lock, before the verdict
    assert core.checked(res.ref, old, OK, now=6.0) == []
    assert core.status("r").state is TransferState.TRANSFERRING


def test_actions_carry_plain_data_and_events_of_a_freed_record_are_void() -> None:
    # No action holds a record: each names it by ref; a check reads the view copied on
    # the loop when the core asked for it.
    for action in (SendOffer, DigestMark, CheckLanding, DrainPrefill, TellPrefill, Freed):
        assert not [f.name for f in dataclasses.fields(action) if "Incoming" in str(f.type)]
    core, conn = _core()
    core.table.keep_terminal = 0  # an ended request is forgotten at once: its id is free
    res = core.reserve("r", 300, PREFILL, now=0.0)
    core.begin_write("r", conn.instance_id, 300, True, now=0.0)
    [check] = _landed(core, conn, res.transfer_id)
    assert isinstance(check, CheckLanding) and check.ref == res.ref
    view = check.landing
    assert (view.request_id, view.nbytes, view.mailbox_slot, view.digests_follow) == (
        "r", res.nbytes, res.mailbox_slot, True)
    res.digests_follow = False  # the record changes on the loop; the copy does not
    assert view.digests_follow is True
    # Freed (aborted, prefill confirmed) and reserved again under the same id: the old
    # check's verdict, drain answer and offer reach nothing of the new reservation.
    _st, actions = core.abort("r", from_peer=False, detail="stop", now=1.0)
    assert actions == [DrainPrefill(res.ref, conn, "stop")]
    assert core.drain_answered(res.ref, "stop", confirmed=True, now=1.1) == [Freed("r")]
    newer = core.reserve("r", 300, PREFILL, now=2.0)
    assert newer.ref != res.ref
    assert core.checked(res.ref, res.transfer_id, OK, now=2.1) == []
    assert core.drain_answered(res.ref, "stop", confirmed=True, now=2.1) == []
    assert core.offer_sent(res.ref, True, 2.1) == [Count("offers", "made")]
    assert core.mark_digesting(res.ref, res.transfer_id, 1,
                               DigestPool(0).start(DigestParts([]))) == []
    assert core.status("r").state is not TransferState.SUCCESS and core.slot_of("r") != -1
    assert newer.marked == {} and newer.landing is Landing.AWAITED


def test_the_offer_is_an_action_and_an_answer_without_digests_may_start_the_check() -> None:
    core, conn = _core()
    res = core.reserve("r", 300, PREFILL, now=0.0)
    [offer] = core.offer(res, 0.0)
    assert isinstance(offer, SendOffer) and offer.conn is conn and offer.ref == res.ref
    assert offer.grant.transfer_id == res.transfer_id and offer.lease_s > 0
    assert core.offer(res, 0.0) == []  # granted already: no second Offer
    assert core.offer_sent(res.ref, True, 0.0) == [Count("offers", "made")]
    # The bytes land before any answer, with no record in the slot: the check waits.
    assert _landed(core, conn, res.transfer_id) == []
    assert core.status("r").state is TransferState.TRANSFERRING
    # Prefill's integrity is off: it said so (OFFER_ANSWER); nothing more to wait for.
    assert core.answer_arrived("r", res.transfer_id, conn.instance_id,
                               Offered.NO_DIGESTS) == [_check(res)]


def test_a_refused_offer_takes_the_grant_back() -> None:
    core, conn = _core()
    res = core.reserve("r", 300, PREFILL, now=0.0)
    core.offer(res, 0.0)
    assert core.answer_arrived("r", res.transfer_id, conn.instance_id,
                               Offered.REFUSED) == [Count("offers", "refused")]
    assert res.peer_instance == "" and not res.offered


def test_an_offer_not_sent_is_a_refusal() -> None:
    core, _conn = _core()
    res = core.reserve("r", 300, PREFILL, now=0.0)
    core.offer(res, 0.0)
    assert core.offer_sent(res.ref, False, 0.0) == [Count("offers", "refused")]
    assert res.peer_instance == "" and not res.offered


def test_a_mark_asks_for_its_digests_and_the_last_piece_for_the_check() -> None:
    core, conn = _core()
    core.sub_batch_bytes = 1 << 12
    res = core.reserve("r", 300, PREFILL, now=0.0)
    assert len(res.sub_batches) >= 1
    core.begin_write("r", conn.instance_id, 300, True, now=0.0)
    tid = res.transfer_id
    assert _landed(core, conn, tid + 1) == [DigestMark(res.ref, res.view(), tid, 1)]
    job = DigestPool(0).start(DigestParts([]))
    assert core.mark_digesting(res.ref, tid, 1, job) == []
    assert core.mark_digesting(res.ref, tid, 1, job) == []  # a repeated mark is ignored
    assert res.marked == {1: job}


def test_a_scheduler_abort_of_a_granted_request_drains_prefill_first() -> None:
    core, conn = _core()
    res = core.reserve("r", 300, PREFILL, now=0.0)
    core.begin_write("r", conn.instance_id, 300, True, now=0.0)
    st, actions = core.abort("r", from_peer=False, detail="stop", now=0.0)
    assert st.state is TransferState.FAILED
    assert actions == [DrainPrefill(res.ref, conn, "stop")] and core.slot_of("r") != -1
    # Prefill did not confirm, and the link is still there: only this slot stays held.
    assert core.drain_answered(res.ref, "stop", confirmed=False, now=10.0) == []
    assert res.unconfirmed is not None and res.unconfirmed.since == 10.0
    assert core.slot_of("r") != -1
    # Confirmed at the next ask: freed.
    assert core.drain_answered(res.ref, "stop", confirmed=True, now=11.0) == [Freed("r")]
    assert core.slot_of("r") == -1


def test_an_abort_before_any_grant_frees_at_once_and_tells_prefill() -> None:
    core, conn = _core()
    core.reserve("r", 300, PREFILL, now=0.0)
    _st, actions = core.abort("r", from_peer=False, detail="stop", now=0.0)
    assert actions == [Freed("r"), TellPrefill(conn, "r", "stop")]


def test_an_unconfirmed_abort_past_its_budget_drops_only_that_link() -> None:
    core, conn = _core(budget_s=2.0)
    res = core.reserve("r", 300, PREFILL, now=0.0)
    core.begin_write("r", conn.instance_id, 300, True, now=0.0)
    core.abort("r", from_peer=False, detail="stop", now=0.0)
    core.drain_answered(res.ref, "stop", confirmed=False, now=10.0)
    core.ask_again_s = 1.0
    assert core.periodic(now=11.5) == [DrainPrefill(res.ref, conn, "stop")]  # asked again
    assert core.periodic(now=11.6) == []  # one ask at a time
    core.drain_answered(res.ref, "stop", confirmed=False, now=11.7)
    actions = core.periodic(now=12.5)
    assert actions == [DropLink(conn, "prefill did not confirm the abort of r", gone=False)]
    # The driver released the link: the request is free now.
    assert core.link_dropped(conn, "released", gone=False, now=0.0) == [Freed("r")]


def test_a_link_failure_is_a_dropped_link_and_keeps_the_requests() -> None:
    core, conn = _core()
    core.reserve("r", 300, PREFILL, now=0.0)
    core.begin_write("r", conn.instance_id, 300, True, now=0.0)
    event = Event(EventKind.LINK_FAILED, conn.link.id, None, ok=False, status="RETRY_EXC",
                  detail="x")
    assert core.on_event(event, now=1.0) == [
        DropLink(conn, "link failed: RETRY_EXC: x", gone=False)]
    assert core.link_dropped(conn, "link failed", gone=False, now=0.0) == []  # resent later
    assert core.status("r").state is TransferState.TRANSFERRING


def test_a_lost_peer_fails_and_frees_its_requests() -> None:
    core, conn = _core()
    core.reserve("a", 300, PREFILL, now=0.0)
    core.reserve("b", 300, PREFILL, now=0.0)
    core.begin_write("a", conn.instance_id, 300, True, now=0.0)
    assert core.link_dropped(conn, "heartbeats lost", gone=True, now=0.0) == [Freed("a"),
                                                                               Freed("b")]
    assert core.status("a").reason is FailureReason.PEER_FAILED


def test_the_hand_off_lease_frees_a_success_nobody_released() -> None:
    core, conn = _core(integrity=False)
    res = core.reserve("r", 300, PREFILL, now=0.0)
    core.begin_write("r", conn.instance_id, 300, False, now=0.0)
    assert _landed(core, conn, res.transfer_id) == [_check(res)]
    core.checked(res.ref, res.transfer_id, Verdict(True, "not verified"), now=100.0)
    assert core.periodic(now=129.0) == []
    assert core.periodic(now=131.0) == [Freed("r")]


def test_a_decline_tells_prefill_on_its_connection_or_once_it_connected() -> None:
    core, conn = _core()
    assert core.decline("x", PREFILL, "full", 1.0) == [
        TellPrefill(conn, "x", "declined by decode: full"), Count("declines")]
    # Not connected (prefill's Send may name no decode): prefill is asked to connect,
    # naming the request, and told over the new connection's channel once it did.
    other = "10.0.0.9:1"
    assert core.decline("y", other, "full", 1.0) == [DialPrefill(other, ("y",)),
                                                    Count("declines")]
    assert core.decline("z", other, "full", 1.1) == [Count("declines")]  # the ask serves it
    new = fake_conn(other, AllocatedSide(layout()))
    core.peers.add(new)
    assert core.dialed(other, new.instance_id, None, now=1.5) == [
        Count("connects", "ok"), TellPrefill(new, "y", "declined by decode: full"),
        TellPrefill(new, "z", "declined by decode: full")]
    # A refused pairing drops what waited: prefill ended those requests itself.
    assert core.decline("w", "10.0.0.9:2", "full", 2.0)[0] == DialPrefill("10.0.0.9:2", ("w",))
    refusal = DialRefused(FailureReason.INCOMPATIBLE, "block size differs")
    assert core.dialed("10.0.0.9:2", "", refusal, now=2.5) == [Count("connects", "refused")]


def test_shutdown_fails_what_is_live_then_frees_it_all() -> None:
    core, conn = _core()
    core.reserve("a", 300, PREFILL, now=0.0)
    res = core.reserve("b", 300, PREFILL, now=0.0)
    core.begin_write("b", conn.instance_id, 300, True, now=0.0)
    assert core.fail_live("bye", 0.0) == [(conn, "a"), (conn, "b")]
    assert core.status("b").reason is FailureReason.SHUTDOWN
    assert core.free_all("shutdown") == [Freed("a"), Freed("b")]
    assert res.request_id == "b" and core.slot_of("b") == -1


def test_the_real_digests_of_a_landing_make_the_same_verdict_as_a_test_one() -> None:
    """The driver's check (LandingCheck) against the record a real prefill writes."""
    core, conn = _core()
    res = core.reserve("r", 300, PREFILL, now=0.0)
    core.begin_write("r", conn.instance_id, 300, True, now=0.0)
    land_record(core, "r", request_digests(core.pools, res.indices))
    [check] = _landed(core, conn, res.transfer_id)
    assert isinstance(check, CheckLanding)
    checker = LandingCheck(lambda: (core.pools, core.layout, core.mailbox), True,
                           DigestPool(0), time.monotonic)
    verdict = checker.check(res.view(), check.transfer_id)
    assert verdict.ok and verdict.detail.startswith("XXH3-128 verified: 13")
    assert core.checked(res.ref, check.transfer_id, verdict, now=6.0) == []
    assert core.status("r").state is TransferState.SUCCESS


def test_a_landing_checked_as_it_lands_goes_to_success_in_one_change() -> None:
    """An offered request whose landing is checked on the thread that saw it land (fewer
    bytes than the digest pool takes): still Bootstrapping (an offered reservation moves
    when it lands) during the check, and Success passes through WaitingForInput and
    Transferring in one change (one push to the engine, a version step of 3); a larger
    one is Transferring while its digests run on the pool."""
    for below, at_landing in ((1 << 30, TransferState.BOOTSTRAPPING),
                              (1, TransferState.TRANSFERRING)):
        seen: list[TransferStatus] = []
        core, conn = _core(check_inline_below=below, on_change=seen.append)
        res = core.reserve("r", 300, PREFILL, now=0.0)
        core.offer(res, 0.0)
        core.offer_sent(res.ref, True, 0.0)
        land_record(core, "r", bytes(16 * 13))  # prefill's answer is its record (protocol 8)
        before, version = len(seen), core.status("r").version
        assert _landed(core, conn, res.transfer_id) == [_check(res)]
        assert core.status("r").state is at_landing
        assert core.checked(res.ref, res.transfer_id, OK, now=6.0) == []
        changes = [s.state for s in seen[before:]]
        st = core.status("r")
        assert st.state is TransferState.SUCCESS and st.detail == OK.detail
        if at_landing is TransferState.BOOTSTRAPPING:
            assert changes == [TransferState.SUCCESS]
            assert st.version == version + 3  # two states passed
        else:
            assert changes == [TransferState.TRANSFERRING, TransferState.SUCCESS]


def test_the_core_module_imports_nothing_that_does_io() -> None:
    """No executor, clock, socket, RPC or driver in decode's core: its I/O is its
    driver's (a change that adds one fails here, not in review)."""
    import ast
    from pathlib import Path

    import kvbeam.server.core.decode as module
    tree = ast.parse(Path(module.__file__).read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    io = {"time", "socket", "grpc", "concurrent.futures", "kvbeam.server.peers.calls",
          "kvbeam.server.core.decode_driver", "kvbeam.server.faults"}
    assert names & io == set()


# ---- decode-initiated pairing --------------------------------------------------------
def _unconnected() -> DecodeCore:
    lay = layout()
    core = DecodeCore(table=TransferTable(Deadlines()), peers=Peers(), integrity=True,
                      handoff_lease_s=30.0)
    core.take_pools(UNIFIED_TARGET, lay, AllocatedSide(lay))
    return core


def test_a_reservation_naming_an_unconnected_prefill_asks_it_to_connect_once() -> None:
    core = _unconnected()
    a, b = core.reserve("a", 300, PREFILL, now=0.0), core.reserve("b", 300, PREFILL, now=0.0)
    assert core.offer(a, 1.0) == [DialPrefill(PREFILL, ("a", "b"))]
    assert core.offer(b, 1.0) == []  # the ask under way serves it too
    conn = fake_conn(PREFILL, AllocatedSide(layout()))
    core.peers.add(conn)  # what prefill's handshake with us registered
    offers = core.dialed(PREFILL, conn.instance_id, None, now=1.5)
    assert offers[0] == Count("connects", "ok")
    assert [(o.ref.request_id, o.conn) for o in offers[1:] if isinstance(o, SendOffer)] == [
        ("a", conn), ("b", conn)]


def test_a_refused_pairing_fails_the_reservations_at_once_with_the_refusal(
        ) -> None:
    """Prefill's handshake with us was refused (block sizes differ, say): every
    reservation naming it fails now with the refusal's text, not at the Bootstrapping
    deadline, and its pages are free. Prefill needs no word: the ask named the request,
    and prefill ended it itself when its handshake was refused."""
    core = _unconnected()
    res = core.reserve("a", 300, PREFILL, now=0.0)
    assert core.offer(res, 1.0) == [DialPrefill(PREFILL, ("a",))]
    refusal = DialRefused(FailureReason.INCOMPATIBLE, f"prefill daemon at {PREFILL} could "
                          "not pair with this decode: block size: prefill=128, decode=64")
    actions = core.dialed(PREFILL, "", refusal, now=1.2)
    assert actions == [Count("connects", "refused"), Freed("a")]
    st = core.status("a")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.INCOMPATIBLE
    assert "block size: prefill=128, decode=64" in st.detail
    assert core.slot_of("a") == -1


def test_an_unreachable_prefill_fails_the_reservations_at_once_telling_nobody() -> None:
    core = _unconnected()
    res = core.reserve("a", 300, PREFILL, now=0.0)
    core.offer(res, 1.0)
    down = DialRefused(FailureReason.PEER_UNREACHABLE, f"{PREFILL}: connection refused")
    assert core.dialed(PREFILL, "", down, now=1.2) == [Count("connects", "unreachable"),
                                                      Freed("a")]
    assert core.status("a").reason is FailureReason.PEER_UNREACHABLE


def test_an_answer_that_says_nothing_about_the_pair_leaves_the_reservations_and_pauses() -> None:
    """An older prefill (no Connect) or a busy one: the reservations wait for their
    deadline as before, and decode does not ask that prefill again for a while."""
    core = _unconnected()
    a = core.reserve("a", 300, PREFILL, now=0.0)
    core.offer(a, 1.0)
    old = DialRefused(FailureReason.PEER_UNREACHABLE, "UNIMPLEMENTED", retry=True)
    assert core.dialed(PREFILL, "", old, now=1.1) == [Count("connects", "retry")]
    assert core.status("a").state is TransferState.BOOTSTRAPPING
    b = core.reserve("b", 300, PREFILL, now=0.0)
    assert core.offer(b, 2.0) == []  # paused
    assert core.offer(b, 1.1 + ASK_AGAIN_AFTER_S + 0.1) == [DialPrefill(PREFILL, ("a", "b"))]


def test_a_prefill_that_connects_under_another_address_fails_the_reservation_clearly() -> None:
    core = _unconnected()
    res = core.reserve("a", 300, PREFILL, now=0.0)
    core.offer(res, 1.0)
    conn = fake_conn("10.9.9.9:7", AllocatedSide(layout()))
    core.peers.add(conn)
    actions = core.dialed(PREFILL, conn.instance_id, None, now=1.1)
    assert actions[:2] == [Count("connects", "refused"), Freed("a")]
    assert "names its control address 10.9.9.9:7" in core.status("a").detail
