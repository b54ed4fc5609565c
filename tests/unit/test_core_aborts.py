"""Bounded aborts (issue 22, item 7): an Abort answers within its caller's deadline,
few handler threads ever wait on a drain, and an abort prefill does not confirm fails
only its own request on decode."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import pytest

from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.prefill_driver import ABORT_WAITERS
from kvbeam.server.state.peers import PeerConn
from kvbeam.states import FailureReason, TransferState
from tests.core_fakes import FakeLink, prefill_core, slot_lists, wait_for
from tests.unit.test_core_decode import PREFILL, FakePrefill, QueueExecutor, _core
from tests.unit.test_core_prefill import ADDR, _conn_link, _link, _queued, _sweep_clock


def test_prefills_abort_answers_within_the_callers_time_and_tells_decode_once_drained(
        ) -> None:
    # A drain that would outlast any caller.
    core, fake = prefill_core(drain_s=30.0, integrity=False)
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    link = _link(core)
    assert wait_for(lambda: len(link.writes) == 1)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(core.abort, "r", from_peer=True, detail="decode timed out",
                             wait_s=0.2)
        st = answer.result(timeout=10)  # the caller had 0.2 s: answered, not after 30 s
    assert st.state is TransferState.FAILED
    assert core.in_flight("r") == 1  # the answer says the write is still in flight
    assert fake.aborts == []
    core.on_event(link.completion(link.writes[0][0], ok=False))  # now it drained
    assert wait_for(lambda: fake.aborts == ["r"]), "decode was not told once it drained"
    assert core.in_flight("r") == 0


def test_many_aborts_at_once_hold_few_handler_threads() -> None:
    core, _fake = prefill_core(drain_s=30.0, workers=8, integrity=False)
    n = 40  # more than the 16 handler threads of a daemon
    for i in range(n):
        core.send(f"r{i}", 300, ADDR, [], True, indices=slot_lists(core, i % 4, 300))
    link = _link(core)
    assert wait_for(lambda: len(link.writes) == n)
    with ThreadPoolExecutor(n) as pool:
        answers = [pool.submit(core.abort, f"r{i}", from_peer=True, detail="x")
                   for i in range(n)]  # no caller deadline at all
        # All but the few that may wait on a drain answer at once; none waits 30 s.
        assert wait_for(lambda: sum(a.done() for a in answers) >= n - ABORT_WAITERS, 10), \
            f"{sum(a.done() for a in answers)} of {n} aborts answered"
        for a in answers:
            assert a.result(timeout=20).state is TransferState.FAILED
    assert all(core.in_flight(f"r{i}") == 1 for i in range(n))


def _two_granted(core: DecodeDriver, conn: PeerConn) -> None:
    for rid in ("r1", "r2"):
        core.reserve(rid, 300, PREFILL)
        core.begin_write(rid, conn.instance_id, 300, False)


class SilentPrefill(FakePrefill):
    """A prefill that never confirms aborts of the requests in ``silent``."""

    def __init__(self, silent: set[str]) -> None:
        super().__init__()
        self.silent = silent

    def abort(self, conn: PeerConn, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        super().abort(conn, request_id, detail, timeout)
        return request_id not in self.silent


def _silent_core(budget_s: float) -> tuple[DecodeDriver, QueueExecutor, SilentPrefill, PeerConn]:
    core, io, _prefill, conn = _core()
    prefill = SilentPrefill({"r1"})
    core.prefill = prefill
    core.core.transfer_budget = lambda _n: budget_s
    core.core.ask_again_s = 0.0  # ask again at every sweep
    _two_granted(core, conn)
    return core, io, prefill, conn


def test_an_abort_prefill_does_not_confirm_fails_only_that_request() -> None:
    core, io, prefill, conn = _silent_core(budget_s=60.0)
    core.abort("r1", from_peer=False, detail="scheduler")
    io.run_all()
    assert prefill.aborts == ["r1"]
    # Before: the whole peer was torn down and r2 failed with it.
    assert core.status("r2").state is TransferState.TRANSFERRING, core.status("r2")
    assert not conn.closed and not cast(FakeLink, conn.link).released
    assert core.slot_of("r1") != -1  # prefill may still be writing: held
    core.periodic()  # asks again, still unconfirmed
    io.run_all()
    assert prefill.aborts == ["r1", "r1"] and core.slot_of("r1") != -1
    # Prefill's own Abort once it drained (from the granted instance) frees it.
    core.abort("r1", from_peer=True, detail="drained", instance_id=conn.instance_id)
    assert core.slot_of("r1") == -1
    assert core.status("r2").state is TransferState.TRANSFERRING


def test_an_abort_never_confirmed_releases_that_link_only_and_frees_its_slot() -> None:
    core, io, _prefill, conn = _silent_core(budget_s=0.0)  # the bound passed at once
    core.abort("r1", from_peer=False, detail="scheduler")
    io.run_all()
    assert core.slot_of("r1") != -1
    time.sleep(0.01)
    core.periodic()
    io.run_all()
    # The link is released (no write of r1 can land now), its slot freed; r2 is only on
    # a dead link, kept for prefill's resend as after any link failure.
    assert cast(FakeLink, conn.link).released and core.slot_of("r1") == -1
    assert core.status("r1").reason is FailureReason.ABORTED
    assert core.status("r2").state is TransferState.TRANSFERRING and core.slot_of("r2") != -1


def test_writes_that_never_drain_release_their_link_but_fail_only_their_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's clock is moved past ``drain_s`` (no sleep), and the Abort's caller has
    no time left (``wait_s=0``): it answers at once."""
    core, fake, io = _queued(drain_s=0.1, resend_retries=1, integrity=False)
    clock = _sweep_clock(core)
    for rid in ("slow", "other"):
        core.send(rid, 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    io.run_all()
    link = _conn_link(core)
    assert len(link.writes) == 2
    # Its write never completes.
    core.abort("slow", from_peer=False, detail="scheduler", wait_s=0.0)
    core.periodic()
    clock.advance(0.15)
    core.periodic()  # past drain_s: the link is released, so no write of it can read on
    assert not link.released and len(io.queue) == 1
    io.run_all()
    assert link.released
    assert fake.aborts == ["slow"]  # its writes can no longer read: decode is told now
    for tid, _ in list(link.writes):  # as a released link flushes its writes
        core.on_event(link.completion(tid, ok=False))
    # Only the link went: the other request is resent on a new one, not failed.
    io.run_all()
    new = _conn_link(core)
    assert new is not link and fake.begins[-1] == ("other", new.id) and len(fake.begins) == 3
    assert len(new.writes) == 1
    assert core.status("other").state is TransferState.TRANSFERRING, core.status("other")
    assert fake.aborts == ["slow"], "decode was not told it drained, or told twice"
