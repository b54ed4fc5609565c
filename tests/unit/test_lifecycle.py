"""The transfer state machine: every transition, deadlines, the bounded table."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from kvbeam.errors import DuplicateRequest, IllegalTransition, TooManyTransfers
from kvbeam.server.state.lifecycle import Deadlines, TransferTable, follow, legal
from kvbeam.states import FailureReason, TransferState
from tests.fake_clock import FakeClock

B, W, T, S, F = (TransferState.BOOTSTRAPPING, TransferState.WAITING_FOR_INPUT,
                 TransferState.TRANSFERRING, TransferState.SUCCESS, TransferState.FAILED)
ALLOWED = {(B, W), (B, F), (W, T), (W, F), (T, S), (T, F)}
PATH = {B: [], W: [W], T: [W, T], S: [W, T, S]}


def _table(clock: FakeClock | None = None, **kw: float) -> TransferTable:
    return TransferTable(Deadlines(**kw))


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(TransferState, TransferState)))
def test_every_transition(src: TransferState, dst: TransferState) -> None:
    assert legal(src, dst) == ((src, dst) in ALLOWED)
    table = _table()
    table.create("r", "peer", now=0.0)
    if src is F:
        table.fail("r", FailureReason.ABORTED, "setup", now=0.0)
    else:
        for s in PATH[src]:
            table.advance("r", s, now=0.0)
    assert table.get("r") is not None and table.get("r").state is src  # type: ignore[union-attr]
    if (src, dst) in ALLOWED:
        if dst is F:
            snap = table.fail("r", FailureReason.TRANSPORT_ERROR, "boom", now=0.0)
            assert snap is not None and snap.reason is FailureReason.TRANSPORT_ERROR
        else:
            assert table.advance("r", dst, now=0.0).state is dst
    elif dst is F:
        # failing a terminal transfer changes nothing
        assert table.fail("r", FailureReason.ABORTED, "late", now=0.0) is None
        assert table.get("r").state is src  # type: ignore[union-attr]
    else:
        with pytest.raises(IllegalTransition):
            table.advance("r", dst, now=0.0)
        assert table.get("r").state is src  # type: ignore[union-attr]


def test_duplicates_refused_even_after_the_end() -> None:
    table = _table()
    table.create("r", "p", now=0.0)
    with pytest.raises(DuplicateRequest):
        table.create("r", "p", now=0.0)
    table.fail("r", FailureReason.ABORTED, "x", now=0.0)
    with pytest.raises(DuplicateRequest):
        table.create("r", "p", now=0.0)


def test_capacity_is_backpressure() -> None:
    table = TransferTable(Deadlines(), capacity=2)
    table.create("a", "p", now=0.0)
    table.create("b", "p", now=0.0)
    with pytest.raises(TooManyTransfers):
        table.create("c", "p", now=0.0)
    table.fail("a", FailureReason.ABORTED, "x", now=0.0)
    table.create("c", "p", now=0.0)


def test_terminal_history_is_bounded() -> None:
    table = TransferTable(Deadlines(), keep_terminal=3)
    for i in range(10):
        table.create(str(i), "p", now=0.0)
        table.fail(str(i), FailureReason.ABORTED, "x", now=0.0)
    assert table.get("0") is None and table.get("9") is not None


def test_each_state_has_a_deadline() -> None:
    clock = FakeClock()
    table = _table(clock, bootstrapping=10, waiting_for_input=20, transferring=30)
    for rid, steps in (("b", []), ("w", [W]), ("t", [W, T])):
        table.create(rid, "p", now=clock())
        for s in steps:
            table.advance(rid, s, now=clock())
    clock.advance(10)
    assert table.expire(clock()) == []  # a deadline is passed only after it
    for rid, budget in (("b", 10), ("w", 20), ("t", 30)):
        clock.now = 1000.0 + budget + 0.5
        expired = table.expire(clock())
        assert [e.request_id for e in expired] == [rid]
        assert expired[0].state is F and expired[0].reason is FailureReason.TIMEOUT
        assert expired[0].age_s == budget + 0.5
    assert "WaitingForInput" in table.get("w").detail  # type: ignore[union-attr]
    assert table.timeline("t") == ((B, 0.0), (W, 0.0), (T, 0.0), (F, 30.5))


def test_progress_extensions_and_leases_move_the_deadline_on_the_tables_clock() -> None:
    clock = FakeClock()
    table = _table(clock, bootstrapping=10)
    table.create("r", "p", now=clock())
    assert table.left("r", now=clock()) == 10
    clock.advance(4)
    assert table.left("r", now=clock()) == 6
    table.touch("r", now=clock())  # progress: the state's whole budget again
    assert table.left("r", now=clock()) == 10
    table.extend("r", 25, now=clock())
    assert table.left("r", now=clock()) == 25
    table.extend("r", 5, now=clock())  # never shortens
    assert table.left("r", now=clock()) == 25
    table.lease("r", 2, "the peer's grant", now=clock())  # a lease may shorten it
    assert table.left("r", now=clock()) == 2
    clock.advance(2)
    assert table.expire(clock()) == []
    clock.advance(0.5)
    [late] = table.expire(clock())
    assert late.detail == "no progress in Bootstrapping for 2 s (the peer's grant)"
    assert table.left("r", now=clock()) is None

def test_a_watcher_gets_every_status_from_the_current_one_to_the_terminal_one() -> None:
    table = _table()
    table.create("r", "p", now=0.0)
    table.advance("r", W, now=0.0)
    watch = table.subscribe("r")
    assert watch is not None
    table.advance("r", T, now=0.0)
    table.advance("r", S, now=0.0)
    seen = [(s.state, s.version) for s in follow(watch, timeout=5)]
    assert seen == [(W, 1), (T, 2), (S, 3)]  # the current status first, then each change
    assert table.subscribe("nope") is None


def test_a_watcher_off_the_loop_ends_with_the_terminal_status() -> None:
    table = _table()
    table.create("r", "p", now=0.0)
    watch = table.subscribe("r")
    assert watch is not None

    def drive() -> None:  # the loop's changes, while this thread follows
        for s in (W, T, S):
            time.sleep(0.02)
            table.advance("r", s, now=0.0)

    threading.Thread(target=drive).start()
    assert [s.state for s in follow(watch, timeout=5)] == [B, W, T, S]


def test_a_watch_ends_when_its_limit_passes_on_the_tables_clock() -> None:
    clock = FakeClock()
    table = _table(clock)
    table.create("r", "p", now=clock())
    watch = table.subscribe("r")
    assert watch is not None
    watching = follow(watch, timeout=5, clock=clock)
    assert next(watching).state is B  # the limit runs from the first status
    clock.advance(5.5)
    assert list(watching) == []  # no change, limit passed: it ends, not waits


def test_an_unsubscribed_watcher_gets_nothing_more() -> None:
    table = _table()
    table.create("r", "p", now=0.0)
    watch = table.subscribe("r")
    assert watch is not None
    table.unsubscribe("r", watch)
    table.advance("r", W, now=0.0)
    assert watch.get_nowait().state is B
    assert watch.empty()


def test_readers_see_only_what_each_change_published() -> None:
    clock = FakeClock()
    table = _table(clock)
    table.create("r", "p", now=clock())
    clock.advance(1.5)
    snap = table.get("r")
    assert snap is not None and snap.state is B and snap.age_s == 0.0  # as published
    status = table.status("r", clock())
    assert status is not None and status.age_s == 1.5  # a status reply's: as of now
    assert table.status("unknown", clock()) is None
    table.set_peer("r", "d")
    assert table.get("r").peer == "d"  # type: ignore[union-attr]
    assert table.get("r").age_s == 0.0  # type: ignore[union-attr]  # no change, no new age
    table.fail("r", FailureReason.SHUTDOWN, "bye", now=clock())
    assert table.state_of("r") is F and not table.is_live("r") and table.live_count() == 0


def test_on_change_sees_every_change() -> None:
    seen: list[TransferState] = []
    table = TransferTable(Deadlines(), on_change=lambda s: seen.append(s.state))
    table.create("r", "p", now=0.0)
    table.advance("r", W, now=0.0)
    table.fail("r", FailureReason.SHUTDOWN, "bye", now=0.0)
    assert seen == [B, W, F]


def test_a_move_through_states_is_one_change_and_checked_whole() -> None:
    seen: list[tuple[TransferState, int]] = []
    table = TransferTable(Deadlines(), on_change=lambda s: seen.append((s.state, s.version)))
    table.create("r", "p", now=0.0)
    snap = table.advance("r", T, through=(W,), now=0.0)
    assert (snap.state, snap.version) == (T, 2)
    assert seen == [(B, 0), (T, 2)]  # observers (the engine's pushes) see one change
    table.create("q", "p", now=0.0)
    with pytest.raises(IllegalTransition, match="Transferring -> Transferring"):
        table.advance("q", T, through=(W, T), now=0.0)  # refused before any move is made
    assert table.get("q").state is B  # type: ignore[union-attr]
    with pytest.raises(IllegalTransition, match=r"use fail\(\)"):
        table.advance("q", T, through=(F,), now=0.0)
