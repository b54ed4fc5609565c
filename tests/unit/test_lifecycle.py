"""The transfer state machine: every transition, deadlines, the bounded table."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from kvbeam.errors import DuplicateRequest, IllegalTransition, TooManyTransfers
from kvbeam.server.lifecycle import Deadlines, TransferTable, legal
from kvbeam.states import FailureReason, TransferState

B, W, T, S, F = (TransferState.BOOTSTRAPPING, TransferState.WAITING_FOR_INPUT,
                 TransferState.TRANSFERRING, TransferState.SUCCESS, TransferState.FAILED)
ALLOWED = {(B, W), (B, F), (W, T), (W, F), (T, S), (T, F)}
PATH = {B: [], W: [W], T: [W, T], S: [W, T, S]}


def _table(**kw: float) -> TransferTable:
    return TransferTable(Deadlines(**kw))


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(TransferState, TransferState)))
def test_every_transition(src: TransferState, dst: TransferState) -> None:
    assert legal(src, dst) == ((src, dst) in ALLOWED)
    table = _table()
    table.create("r", "peer")
    if src is F:
        table.fail("r", FailureReason.ABORTED, "setup")
    else:
        for s in PATH[src]:
            table.advance("r", s)
    assert table.get("r") is not None and table.get("r").state is src  # type: ignore[union-attr]
    if (src, dst) in ALLOWED:
        if dst is F:
            snap = table.fail("r", FailureReason.TRANSPORT_ERROR, "boom")
            assert snap is not None and snap.reason is FailureReason.TRANSPORT_ERROR
        else:
            assert table.advance("r", dst).state is dst
    elif dst is F:
        # failing a terminal transfer changes nothing
        assert table.fail("r", FailureReason.ABORTED, "late") is None
        assert table.get("r").state is src  # type: ignore[union-attr]
    else:
        with pytest.raises(IllegalTransition):
            table.advance("r", dst)
        assert table.get("r").state is src  # type: ignore[union-attr]


def test_duplicates_refused_even_after_the_end() -> None:
    table = _table()
    table.create("r", "p")
    with pytest.raises(DuplicateRequest):
        table.create("r", "p")
    table.fail("r", FailureReason.ABORTED, "x")
    with pytest.raises(DuplicateRequest):
        table.create("r", "p")


def test_capacity_is_backpressure() -> None:
    table = TransferTable(Deadlines(), capacity=2)
    table.create("a", "p")
    table.create("b", "p")
    with pytest.raises(TooManyTransfers):
        table.create("c", "p")
    table.fail("a", FailureReason.ABORTED, "x")
    table.create("c", "p")


def test_terminal_history_is_bounded() -> None:
    table = TransferTable(Deadlines(), keep_terminal=3)
    for i in range(10):
        table.create(str(i), "p")
        table.fail(str(i), FailureReason.ABORTED, "x")
    assert table.get("0") is None and table.get("9") is not None


def test_each_state_has_a_deadline() -> None:
    # Deadlines long enough that a loaded machine cannot pass them before the first check.
    table = _table(bootstrapping=10, waiting_for_input=20, transferring=30)
    for rid, steps in (("b", []), ("w", [W]), ("t", [W, T])):
        table.create(rid, "p")
        for s in steps:
            table.advance(rid, s)
    assert table.expire() == []
    expired = table.expire(time.monotonic() + 31)
    assert {e.request_id for e in expired} == {"b", "w", "t"}
    assert all(e.state is F and e.reason is FailureReason.TIMEOUT for e in expired)
    assert "WaitingForInput" in next(e.detail for e in expired if e.request_id == "w")


def test_watch_streams_until_terminal() -> None:
    table = _table()
    table.create("r", "p")

    def drive() -> None:
        for s in (W, T, S):
            time.sleep(0.02)
            table.advance("r", s)

    threading.Thread(target=drive).start()
    states = [s.state for s in table.watch("r", timeout=5)]
    assert states[-1] is S
    assert states[0] in (B, W)


def test_watch_times_out_without_hanging() -> None:
    table = _table()
    table.create("r", "p")
    t0 = time.monotonic()
    assert [s.state for s in table.watch("r", timeout=0.2)] == [B]
    assert time.monotonic() - t0 < 2


def test_on_change_sees_every_change() -> None:
    seen: list[TransferState] = []
    table = TransferTable(Deadlines(), on_change=lambda s: seen.append(s.state))
    table.create("r", "p")
    table.advance("r", W)
    table.fail("r", FailureReason.SHUTDOWN, "bye")
    assert seen == [B, W, F]


def test_a_move_through_states_is_one_change_and_checked_whole() -> None:
    seen: list[tuple[TransferState, int]] = []
    table = TransferTable(Deadlines(), on_change=lambda s: seen.append((s.state, s.version)))
    table.create("r", "p")
    snap = table.advance("r", T, through=(W,))
    assert (snap.state, snap.version) == (T, 2)
    assert seen == [(B, 0), (T, 2)]  # observers (the engine's pushes) see one change
    table.create("q", "p")
    with pytest.raises(IllegalTransition, match="Transferring -> Transferring"):
        table.advance("q", T, through=(W, T))  # refused before any move is made
    assert table.get("q").state is B  # type: ignore[union-attr]
    with pytest.raises(IllegalTransition, match=r"use fail\(\)"):
        table.advance("q", T, through=(F,))
