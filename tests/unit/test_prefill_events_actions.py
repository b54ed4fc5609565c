"""Prefill's event handlers as a state machine: feed them events, compare the actions.

The handlers of :class:`~kvbeam.server.core.prefill_events.PrefillEvents` (a write's
completion, a failed link, a deadline, a dropped link, the sweep) do no I/O: they
return what the core must do (:mod:`kvbeam.server.core.prefill_actions`). Each test
gets a request posted with a queue executor (nothing runs until the test says so),
then calls a handler and compares its list; no threads, no sleeps, no clock.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import cast

from kvbeam.server.core import prefill_events
from kvbeam.server.core.actions import Count, DropLink
from kvbeam.server.core.outgoing import AttemptState, Outgoing
from kvbeam.server.core.prefill import PrefillCore
from kvbeam.server.core.prefill_actions import RunStep, TellDecode
from kvbeam.server.state.peers import PeerConn
from kvbeam.states import FailureReason, TransferState
from kvbeam.transport import Event, EventKind
from tests.core_fakes import FakeLink, prefill_core, slot_lists
from tests.unit.test_core_decode import QueueExecutor

ADDR = "127.0.0.1:9"
SEQ = 300


def _posted(retries: int = 0, drain_s: float = 5.0
            ) -> tuple[PrefillCore, QueueExecutor, PeerConn, Outgoing, int]:
    """A request whose one write is posted and outstanding (integrity off: one write)."""
    io = QueueExecutor()
    driver, _fake = prefill_core(io=io, digest_threads=0, integrity=False,
                                 resend_retries=retries, drain_s=drain_s)
    driver.send("r", SEQ, ADDR, [], True, indices=slot_lists(driver, 1, SEQ))
    core = driver.core
    io.run_all()  # the handshake, BeginWrite, the post
    conn = core.peers.by_address(ADDR)
    assert conn is not None
    link = cast(FakeLink, conn.link)
    [(tid, _notify)] = link.writes
    rec = core._out["r"]
    assert rec.attempt.outstanding == 1 and not io.queue
    return core, io, conn, rec, tid


def test_a_completion_is_success_and_asks_for_nothing() -> None:
    core, _io, conn, _rec, tid = _posted()
    assert core.handle_event(cast(FakeLink, conn.link).completion(tid), 2.0) == []
    assert core.status("r").state is TransferState.SUCCESS


def test_a_failed_write_with_a_resend_left_resends_and_drops_only_the_link() -> None:
    core, io, conn, rec, tid = _posted(retries=1)
    failed = cast(FakeLink, conn.link).completion(tid, ok=False, status="IBV_WC_RETRY_EXC_ERR")
    assert core.handle_event(failed, 2.0) == [
        Count("resends"), RunStep(rec.ref),
        DropLink(conn, "write failed: IBV_WC_RETRY_EXC_ERR", gone=False)]
    assert core.peers.by_address(ADDR) is None  # no new step picks the dead link
    assert core.status("r").state is TransferState.TRANSFERRING and not io.queue


def test_a_failed_write_without_a_resend_fails_and_tells_decode_once() -> None:
    core, _io, conn, _rec, tid = _posted(retries=0)
    failed = cast(FakeLink, conn.link).completion(tid, ok=False, status="IBV_WC_RETRY_EXC_ERR")
    [tell, drop] = core.handle_event(failed, 2.0)
    assert isinstance(tell, TellDecode) and tell.conn is conn and tell.request_id == "r"
    assert tell.detail.startswith("prefill failed: transport_error: write failed")
    assert drop == DropLink(conn, "write failed: IBV_WC_RETRY_EXC_ERR", gone=False)
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.TRANSPORT_ERROR
    # Its deadline passing later tells decode nothing more.
    assert core.handle_deadline(st) == []


def test_a_link_failure_event_is_a_dropped_link() -> None:
    core, _io, conn, _rec, _tid = _posted()
    event = Event(EventKind.LINK_FAILED, conn.link.id, None, ok=False, status="QP_ERR",
                  detail="x")
    assert core.handle_event(event, 2.0) == [DropLink(conn, "link failed: QP_ERR: x", gone=False)]


def test_a_deadline_tells_decode_only_once_the_writes_drained() -> None:
    core, _io, conn, rec, tid = _posted()
    core.table.fail("r", FailureReason.TIMEOUT, "transferring took too long", now=2.0)
    st = core.status("r")
    assert core.handle_deadline(st) == []  # its write is still in flight
    # The write completes (it failed with the request): decode is told now, once.
    [tell] = core.handle_event(cast(FakeLink, conn.link).completion(tid), 2.0)
    assert isinstance(tell, TellDecode) and tell.conn is conn and tell.request_id == "r"
    assert tell.detail == "prefill failed: transferring took too long"
    assert core.handle_deadline(st) == [] and rec.told_decode


def test_a_dropped_link_resends_what_it_may_and_a_lost_peer_fails_it_all() -> None:
    core, _io, conn, rec, _tid = _posted(retries=1)
    core.peers.remove(conn)
    assert core.link_dropped(conn, "link failed", gone=False, now=2.0) == []  # a write outstanding
    assert rec.resend_owed and rec.attempt.broken_by == "link failed"
    core2, _io2, conn2, _rec2, _tid2 = _posted(retries=1)
    core2.peers.remove(conn2)
    assert core2.link_dropped(conn2, "heartbeats lost", gone=True, now=2.0) == []  # no one to tell
    st = core2.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.PEER_FAILED


def test_the_sweep_abandons_writes_that_do_not_drain_by_dropping_their_link() -> None:
    core, _io, conn, rec, _tid = _posted(drain_s=2.0)
    core.table.fail("r", FailureReason.ABORTED, "aborted", now=2.0)
    assert core.sweep(now=100.0) == [] and rec.attempt.hung_since == 100.0
    assert core.sweep(now=101.0) == []
    assert core.sweep(now=102.5) == [DropLink(conn, "writes of r did not drain", gone=False)]
    assert rec.attempt.state is AttemptState.RELEASED and rec.drained
    assert core.sweep(now=103.0) == []  # once


def test_shutdown_lists_every_live_request_once() -> None:
    core, _io, conn, _rec, _tid = _posted()
    assert core.fail_live("bye", 2.0) == [(conn, ADDR, "r")]
    assert core.fail_live("bye", 2.0) == []
    assert core.status("r").reason is FailureReason.SHUTDOWN


def test_the_event_handlers_module_imports_nothing_that_does_io() -> None:
    """No executor, clock, socket or RPC in prefill's event handlers: the I/O is the
    driver's (a change that adds one fails here)."""
    tree = ast.parse(Path(prefill_events.__file__).read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert names & {"time", "socket", "grpc", "concurrent.futures",
                    "kvbeam.server.peers.calls"} == set()
