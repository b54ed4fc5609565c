"""Prefill's core as a state machine: feed it events, compare the actions it returns.

No executor, no fake decode daemon, no threads, no clock: the core does no I/O, so each
test is a list of events (a Send, a handshake's answer, decode's grant, a post's
outcome) and the actions each returns. The driver that does them has its own tests
(test_core_prefill*.py, test_core_offers.py and the others that build a
``PrefillDriver``).
"""

from __future__ import annotations

import ast
import dataclasses
import time
from pathlib import Path

import pytest

from kvbeam.errors import FrameError, NotPosted, NotReserved, SendFailed, TransportError
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.indices import request_indices
from kvbeam.pools.types import IndexKind
from kvbeam.server.core import prefill
from kvbeam.server.core.actions import Count, DropLink
from kvbeam.server.core.chunks import Chunk
from kvbeam.server.core.outgoing import Outgoing, Step
from kvbeam.server.core.ports import WriteGrant
from kvbeam.server.core.prefill import PrefillCore
from kvbeam.server.core.prefill_actions import (
    AskGrant,
    Connect,
    PostWrites,
    RunStep,
    TellDecode,
)
from kvbeam.server.state.lifecycle import Deadlines, TransferTable
from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.states import FailureReason, TransferState
from tests.core_fakes import fake_conn, slot_lists
from tests.fixtures import UNIFIED_TARGET, layout

DECODE = "127.0.0.1:9"
SEQ = 300
#: The KV pages of a SEQ-token request: what its final chunk makes ready.
PAGES = len(request_indices(UNIFIED_TARGET, 1, SEQ)[IndexKind.KV_PAGES])
_FINAL = Chunk.whole(PAGES, True)  # a whole request's one chunk


def _core(integrity: bool = False, **kw: float) -> PrefillCore:
    lay = layout()
    core = PrefillCore(table=TransferTable(Deadlines()), peers=Peers(), integrity=integrity,
                       drain_s=5.0, **kw)  # type: ignore[arg-type]
    core.take_pools(UNIFIED_TARGET, lay, AllocatedSide(lay))
    return core


def _conn() -> PeerConn:
    return fake_conn(DECODE, AllocatedSide(layout()))


def _grant(tid: int = 7) -> WriteGrant:
    return WriteGrant(tid, request_indices(UNIFIED_TARGET, 2, SEQ))


def _rec(core: PrefillCore, rid: str = "r") -> Outgoing:
    return core._out[rid]


def _sent(core: PrefillCore, rid: str = "r") -> Outgoing:
    """A single-chunk request whose Send asked for its step."""
    assert core.send(rid, SEQ, DECODE, [], True, now=1.0,
                     indices=slot_lists(core, 1, SEQ)) == [RunStep(_rec(core, rid).ref)]
    return _rec(core, rid)


def _asking(core: PrefillCore, conn: PeerConn, rid: str = "r") -> Outgoing:
    """A request connected to ``conn`` whose step asks decode for a grant."""
    if core.peers.by_address(DECODE) is None:
        core.peers.add(conn)
    rec = _sent(core, rid)
    # No offer of decode's in hand: a miss, and BeginWrite asks.
    assert core.step(rec.ref, now=1.0) == [Count("offers", "missed"),
                                           AskGrant(rec.ref, rec.seq_len, conn, _FINAL)]
    return rec


def test_the_first_step_connects_once_per_address_and_the_handshake_starts_every_waiter(
        ) -> None:
    core = _core()
    first, second = _sent(core, "a"), _sent(core, "b")
    assert core.step(first.ref, now=1.0) == [Connect(DECODE)]
    assert core.step(second.ref, now=1.0) == []  # waits for the same handshake
    assert first.step is Step.CONNECTING and second.step is Step.CONNECTING
    conn = _conn()
    assert core.connected(DECODE, conn, None, began=0.8, now=1.0) == [RunStep(first.ref),
                                                                       RunStep(second.ref)]
    assert core.peers.by_address(DECODE) is conn and first.asked  # no offer is coming


def test_a_failed_handshake_fails_every_waiter_and_tells_decode_by_address() -> None:
    core = _core()
    rec = _sent(core)
    assert core.step(rec.ref, now=1.0) == [Connect(DECODE)]
    error = SendFailed(FailureReason.PEER_UNREACHABLE, "decode at 127.0.0.1:9: refused")
    # Nothing was written: decode (which may hold its reservation) is told at once, by a
    # call of its own (there is no connection).
    assert core.connected(DECODE, None, error, began=0.9, now=1.0) == [TellDecode(
        None, DECODE, "r", "prefill failed: peer_unreachable: decode at 127.0.0.1:9: refused")]
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.PEER_UNREACHABLE
    assert rec.step is Step.IDLE


def test_a_grant_plans_the_writes_and_their_post_ends_the_step() -> None:
    core, conn = _core(), _conn()
    rec = _asking(core, conn)
    [post] = core.granted(rec.ref, conn, _FINAL, _grant(7), None, elapsed=0.01, now=1.1)
    assert isinstance(post, PostWrites)
    assert (post.ref, post.conn, post.final, post.record, post.marks) == (rec.ref, conn, True,
                                                                          False, 0)
    assert [(tid, notify) for tid, _, notify in post.writes] == [(7, True)] and post.total_bytes > 0
    assert core.status("r").state is TransferState.TRANSFERRING
    assert core.book(post, separate=False)
    attempt = rec.attempt
    assert attempt.outstanding == 1 and attempt.final_posted and attempt.link == conn.link.id
    assert core.posted(rec.ref, now=1.2) == [] and rec.step is Step.IDLE


def test_with_integrity_the_final_chunk_books_its_record_as_one_more_write() -> None:
    core, conn = _core(integrity=True), _conn()
    rec = _asking(core, conn)
    [post] = core.granted(rec.ref, conn, _FINAL, _grant(7), None, elapsed=0.01, now=1.1)
    assert isinstance(post, PostWrites) and post.record
    assert core.book(post, separate=True)
    assert rec.attempt.outstanding == 2 and rec.staging is not None  # the data, then the record
    core.unbook(post, left=0, separate=True)  # the record's post failed
    # The data is still in flight: no Success without the record (its staging slot is
    # given back once the data's write completed).
    assert rec.attempt.outstanding == 1 and not rec.attempt.final_posted


def test_the_record_post_takes_its_staging_slot_with_its_writes_and_none_free_fails_it(
        ) -> None:
    # Two requests, one staging slot: the first's record holds it while its writes are
    # in flight; the second's book refuses (nothing counted) with the reason.
    core = _core(integrity=True, staging_slots=1)
    conn = _conn()
    first = _asking(core, conn)
    [post] = core.granted(first.ref, conn, _FINAL, _grant(7), None, elapsed=0.01, now=1.1)
    assert isinstance(post, PostWrites) and post.digest is not None
    assert first.staging is None  # planned only: the slot goes with the booking
    booked = core.book(post, separate=False)
    assert booked is not None and booked.staging == first.staging is not None
    second = _asking(core, conn, "s")
    [post2] = core.granted(second.ref, conn, _FINAL, _grant(8), None, elapsed=0.01, now=1.1)
    assert isinstance(post2, PostWrites)
    with pytest.raises(SendFailed, match="no free digest-record staging slot"):
        core.book(post2, separate=False)
    assert second.attempt.outstanding == 0 and second.staging is None


def test_actions_carry_plain_data_and_events_of_a_forgotten_record_are_ignored() -> None:
    # No action holds a record: each names it by ref (the driver never reads one).
    for action in (RunStep, AskGrant, PostWrites, TellDecode, Connect):
        assert not [f.name for f in dataclasses.fields(action) if "Outgoing" in str(f.type)]
    core, conn = _core(integrity=True), _conn()
    core.table.keep_terminal = 0  # an ended request is forgotten at once: its id is free
    rec = _asking(core, conn)
    [post] = core.granted(rec.ref, conn, _FINAL, _grant(7), None, elapsed=0.01, now=1.1)
    assert isinstance(post, PostWrites) and post.digest is not None
    assert post.digest.source[IndexKind.KV_PAGES] is rec.moved_source[IndexKind.KV_PAGES]
    assert post.digest.digests is None and post.digest.early == {}
    rec.keep_digests(b"later")  # the record changes on the loop; the action's copy not
    assert post.digest.digests is None
    # The request ends and is forgotten; a new request of the same id takes its place.
    failed = core.abort("r", from_peer=False, detail="scheduler", now=1.2)
    assert failed is not None and failed[0] == rec.ref
    assert core.abort_answered(rec.ref, from_peer=False, drained=True, detail="scheduler")
    core.sweep(now=1.3)
    assert "r" not in core._out
    newer = _sent(core)
    assert newer.ref != rec.ref and newer.ref.request_id == rec.ref.request_id
    # The old step's events reach nothing: not the newer record.
    assert core.book(post, separate=False) is None
    assert core.posted(rec.ref, now=1.4) == []
    assert core.step(rec.ref, now=1.4) == []
    assert core.granted(rec.ref, conn, _FINAL, _grant(9), None, elapsed=0.01, now=1.4) == []
    assert not core.steps_inline(rec.ref, now=1.4) and core.drained(rec.ref)
    assert newer.attempt.outstanding == 0 and newer.step is Step.RUNNING


def test_no_offer_within_the_grace_asks_and_no_reservation_yet_parks_it_again() -> None:
    core, conn = _core(send_wait_s=5.0), _conn()
    core.peers.add(conn)
    assert core.send("r", SEQ, DECODE, [], True, now=1.0,
                     indices=slot_lists(core, 1, SEQ)) == []  # parked at once
    rec = _rec(core)
    assert core.periodic(now=1.0) == []  # within the grace: it waits for decode's Offer
    assert core.periodic(now=1.0 + prefill.OFFER_GRACE_S) == [RunStep(rec.ref)]
    assert core.step(rec.ref, now=1.1) == [Count("offers", "missed"),
                                       AskGrant(rec.ref, rec.seq_len, conn, _FINAL)]
    refused = NotReserved(FailureReason.INVALID_REQUEST, "UnknownRequest: no reservation")
    assert core.granted(rec.ref, conn, _FINAL, None, refused, elapsed=0.01, now=1.1) == []
    assert rec.step is Step.PARKED and list(rec.chunks) == [_FINAL]
    assert core.status("r").state is TransferState.WAITING_FOR_INPUT


def test_decodes_offer_unparks_a_parked_request_and_its_step_writes_without_asking() -> None:
    core, conn = _core(send_wait_s=5.0), _conn()
    core.peers.add(conn)
    assert core.send("r", SEQ, DECODE, [], True, now=1.0,
                     indices=slot_lists(core, 1, SEQ)) == []  # parked at once
    rec = _rec(core)
    assert rec.step is Step.PARKED
    kept, actions = core.offer("r", conn.instance_id, SEQ, _grant(9), lease_s=1.0, now=1.1)
    assert kept and actions == [Count("offers", "received"), RunStep(rec.ref)]
    count, post = core.step(rec.ref, now=1.2)
    assert count == Count("offers", "used") and isinstance(post, PostWrites)
    assert [tid for tid, _, _ in post.writes] == [9]


def test_a_post_on_a_dead_link_drops_it_and_resends_on_a_new_one() -> None:
    core, conn = _core(resend_retries=1), _conn()
    rec = _asking(core, conn)
    [post] = core.granted(rec.ref, conn, _FINAL, _grant(7), None, elapsed=0.01, now=1.1)
    assert isinstance(post, PostWrites) and core.book(post, separate=False)
    core.unbook(post, left=1, separate=False)  # the one write was not posted
    broken = NotPosted(TransportError("link: QP in error state", "IBV_WC_RETRY_EXC_ERR"))
    assert core.step_failed(rec.ref, conn, broken, now=1.2) == [
        DropLink(conn, "link unusable: link: QP in error state", gone=False),
        Count("resends"), RunStep(rec.ref)]
    assert core.peers.by_address(DECODE) is None  # out of the registry at once
    assert rec.resends == 1 and rec.conn is None and rec.step is Step.RUNNING
    assert core.step(rec.ref, now=1.3) == [Connect(DECODE)]  # a new link


def test_a_dead_link_with_no_resend_left_fails_the_request_and_tells_decode() -> None:
    core, conn = _core(), _conn()
    rec = _asking(core, conn)
    [post] = core.granted(rec.ref, conn, _FINAL, _grant(7), None, elapsed=0.01, now=1.1)
    assert isinstance(post, PostWrites) and core.book(post, separate=False)
    core.unbook(post, left=1, separate=False)
    broken = NotPosted(TransportError("link: QP in error state", "IBV_WC_RETRY_EXC_ERR"))
    drop, tell = core.step_failed(rec.ref, conn, broken, now=1.2)
    assert drop == DropLink(conn, "link unusable: link: QP in error state", gone=False)
    assert tell.request_id == "r" and tell.conn is conn  # type: ignore[union-attr]
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.PEER_FAILED


def test_decode_that_forgot_us_is_dropped_and_the_request_handshakes_again_once() -> None:
    core, conn = _core(), _conn()
    rec = _asking(core, conn)
    forgot = SendFailed(FailureReason.PEER_FAILED, "decode restarted: NotHandshaken",
                        peer_lost=True)
    assert core.step_failed(rec.ref, conn, forgot, now=1.1) == [
        DropLink(conn, str(forgot), gone=True), RunStep(rec.ref)]
    assert rec.rehandshake and rec.conn is None and list(rec.chunks) == [_FINAL]
    assert core.step(rec.ref, now=1.2) == [Connect(DECODE)]
    conn2 = _conn()
    assert core.connected(DECODE, conn2, None, began=1.1, now=1.2) == [RunStep(rec.ref)]
    assert core.step(rec.ref, now=1.3) == [Count("offers", "missed"),
                                       AskGrant(rec.ref, rec.seq_len, conn2, _FINAL)]
    # The second time is a failure: the peer failed.
    drop, *_ = core.step_failed(rec.ref, conn2, forgot, now=1.4)
    assert drop == DropLink(conn2, str(forgot), gone=True)
    assert core.status("r").reason is FailureReason.PEER_FAILED


def test_a_request_aborted_before_its_grant_posts_nothing() -> None:
    core, conn = _core(), _conn()
    rec = _asking(core, conn)
    failed = core.abort("r", from_peer=False, detail="scheduler", now=1.05)
    assert failed is not None and failed[0] == rec.ref
    assert core.granted(rec.ref, conn, _FINAL, _grant(7), None, elapsed=0.01, now=1.1) == []
    assert rec.attempt.outstanding == 0 and rec.step is Step.IDLE


def test_the_core_module_imports_nothing_that_does_io() -> None:
    """No executor, clock, socket, RPC, digest pool or fault hook in prefill's core: the
    I/O is its driver's (a change that adds one fails here)."""
    tree = ast.parse(Path(prefill.__file__).read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert names & {"time", "socket", "grpc", "concurrent.futures", "kvbeam.server.peers.calls",
                    "kvbeam.server.faults", "kvbeam.pools.digest_pool",
                    "kvbeam.server.core.prefill_driver"} == set()


def test_an_offer_for_a_request_that_failed_here_is_refused_and_decode_told_at_once() -> None:
    # The Send's wait for decode ran out before decode reserved (a loaded decode): the
    # Offer that follows must not be kept, or decode's reservation would sit in
    # Bootstrapping until its own deadline for a request prefill will never send.
    core, conn = _core(send_wait_s=5.0), _conn()
    core.peers.add(conn)
    assert core.send("r", SEQ, DECODE, [], True, now=1.0,
                     indices=slot_lists(core, 1, SEQ)) == []  # parked: no offer yet
    assert core.table.fail("r", FailureReason.TIMEOUT, "no reservation within 5.0 s",
                           now=2.0)
    kept, actions = core.offer("r", conn.instance_id, SEQ, _grant(), 10.0, now=7.0)
    assert not kept and not core.offers.has("r")
    assert actions == [Count("offers", "refused"), TellDecode(
        conn, DECODE, "r",
        "prefill failed before decode reserved: timeout: no reservation within 5.0 s")]


def test_an_offer_for_a_request_that_succeeded_here_is_refused_without_an_abort() -> None:
    # Its bytes went under an earlier grant: a second reservation of the id is refused,
    # and nothing here fails decode's requests.
    core, conn = _core(), _conn()
    rec = _asking(core, conn)
    [post] = core.granted(rec.ref, conn, _FINAL, _grant(7), None, elapsed=0.01, now=1.1)
    assert isinstance(post, PostWrites) and core.book(post, separate=False)
    core.table.advance("r", TransferState.SUCCESS, now=2.0)
    kept, actions = core.offer("r", conn.instance_id, SEQ, _grant(8), 10.0, now=2.0)
    assert (kept, actions) == (False, [Count("offers", "refused")])


def test_an_offer_for_a_failed_request_whose_writes_are_in_flight_waits_for_the_drain(
        ) -> None:
    # Decode is told only once none of the request's writes can still land: the drain
    # tells it (as for any failure), not the Offer.
    core, conn = _core(), _conn()
    rec = _asking(core, conn)
    [post] = core.granted(rec.ref, conn, _FINAL, _grant(7), None, elapsed=0.01, now=1.1)
    assert isinstance(post, PostWrites) and core.book(post, separate=False)
    core.table.fail("r", FailureReason.ABORTED, "aborted by the scheduler", now=2.0)
    assert not rec.drained
    kept, actions = core.offer("r", conn.instance_id, SEQ, _grant(8), 10.0, now=2.0)
    assert (kept, actions) == (False, [Count("offers", "refused")])


# ---- decode-initiated pairing: a Send that names no decode ---------------------------
def test_a_send_naming_no_decode_parks_until_a_decodes_offer_names_it_and_goes_there(
        ) -> None:
    """The Send comes first with no decode address (a proxy that speaks vLLM's NIXL
    contract gives prefill none): it parks, connects nowhere, and the sweep's BeginWrite
    fallback leaves it alone; the Offer of whichever decode reserved the request binds it
    to that decode, and its step writes there without asking."""
    core, conn = _core(send_wait_s=5.0), _conn()
    core.peers.add(conn)
    assert core.send("r", SEQ, "", [], True, now=1.0,
                     indices=slot_lists(core, 1, SEQ)) == []  # parked at once
    rec = _rec(core)
    assert rec.step is Step.PARKED and rec.decode_address == "" and rec.conn is None
    assert core.status("r").state is TransferState.WAITING_FOR_INPUT
    assert core.periodic(now=1.0 + 10 * prefill.OFFER_GRACE_S) == []  # no BeginWrite: to whom?
    kept, actions = core.offer("r", conn.instance_id, SEQ, _grant(9), lease_s=1.0, now=1.2)
    assert kept and actions == [Count("offers", "received"), RunStep(rec.ref)]
    bound = _rec(core)  # the same record, bound now
    assert (bound.decode_address, bound.conn) == (DECODE, conn)
    assert core.status("r").peer == DECODE
    [used, post] = core.step(rec.ref, now=1.2)
    assert used == Count("offers", "used")
    assert isinstance(post, PostWrites) and post.conn is conn and post.grant.transfer_id == 9


def test_an_offer_before_a_send_naming_no_decode_is_taken_at_once() -> None:
    core, conn = _core(send_wait_s=5.0), _conn()
    core.peers.add(conn)
    kept, _ = core.offer("r", conn.instance_id, SEQ, _grant(9), lease_s=5.0, now=1.0)
    assert kept
    [step] = core.send("r", SEQ, "", [], True, now=1.1, indices=slot_lists(core, 1, SEQ))
    rec = _rec(core)
    assert step == RunStep(rec.ref) and (rec.decode_address, rec.conn) == (DECODE, conn)
    [used, post] = core.step(rec.ref, now=1.1)
    assert used == Count("offers", "used") and isinstance(post, PostWrites)


def test_a_send_naming_no_decode_that_nobody_offers_ends_at_its_lease_telling_nobody() -> None:
    """Its wait is the --send-wait-s lease; the failure names what it waited for, and no
    decode is told (there is none to tell: no Abort to an empty address)."""
    core = _core(send_wait_s=5.0)
    core.send("r", SEQ, "", [], True, now=1.0, indices=slot_lists(core, 1, SEQ))
    [expired] = core.table.expire(time.monotonic() + 6.0)
    assert expired.detail.startswith("no progress in WaitingForInput for 5.0 s (decode's "
                                     "reservation: the Send named no decode and no decode "
                                     "daemon offered"), expired.detail
    assert core.handle_deadline(expired) == []


def test_a_send_naming_no_decode_must_be_one_final_chunk_under_a_lease() -> None:
    leased, unleased = _core(send_wait_s=5.0), _core()
    with pytest.raises(FrameError, match=r"decode_address: empty .* one final SEND"):
        leased.send("r", SEQ, "", [(0, 64)], False, now=1.0,
                    indices=slot_lists(leased, 1, SEQ))
    with pytest.raises(FrameError, match="needs --send-wait-s above 0"):
        unleased.send("r", SEQ, "", [], True, now=1.0, indices=slot_lists(unleased, 1, SEQ))


def test_an_abort_of_a_send_naming_no_decode_before_any_offer_tells_nobody() -> None:
    core = _core(send_wait_s=5.0)
    core.send("r", SEQ, "", [], True, now=1.0, indices=slot_lists(core, 1, SEQ))
    failed = core.abort("r", from_peer=False, detail="engine gave up", now=1.5)
    assert failed is not None
    rec, detail = failed
    assert core.abort_answered(rec, from_peer=False, drained=True, detail=detail) == []
    assert core.status("r").reason is FailureReason.ABORTED


def test_a_send_naming_no_decode_drops_an_offer_whose_connection_closed_and_parks() -> None:
    """An Offer kept from a connection that has closed since binds nothing: the Send
    parks for a new Offer (its step does not run again and again)."""
    core, conn = _core(send_wait_s=5.0), _conn()
    core.peers.add(conn)
    kept, _ = core.offer("r", conn.instance_id, SEQ, _grant(9), lease_s=5.0, now=1.0)
    assert kept
    conn.closed = True
    assert core.send("r", SEQ, "", [], True, now=1.1,
                     indices=slot_lists(core, 1, SEQ)) == []  # parked at once
    rec = _rec(core)
    assert rec.step is Step.PARKED and rec.decode_address == "" and not core.offers.has("r")
