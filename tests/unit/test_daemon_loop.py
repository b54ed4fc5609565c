"""The daemon's loop: sources get their own fds' readiness, their ticks when due or
poked, calls from other threads."""

from __future__ import annotations

import logging
import math
import selectors
import socket
import threading
import time
from typing import Any

import pytest

from kvbeam.loop import STALL_WARN_S, DaemonLoop, SourceSelector
from tests.waiting import wait_until


class Recorder:
    """A source that records what the loop hands it."""

    def __init__(self, loop: DaemonLoop, wait: float = 0.2) -> None:
        self.sel: SourceSelector = loop.add(self)
        self.ready_calls: list[tuple[Any, int]] = []
        self.ticks = 0
        self.threads: set[str] = set()
        self.wait = wait

    def ready(self, data: Any, mask: int) -> None:
        self.threads.add(threading.current_thread().name)
        self.ready_calls.append((data, mask))
        if isinstance(data, socket.socket):
            data.recv(4096)

    def tick(self, now: float) -> float:
        self.threads.add(threading.current_thread().name)
        self.ticks += 1
        return now + self.wait

    def watch_pair(self) -> tuple[socket.socket, socket.socket]:
        """A socket pair whose read end this source watches (the end is its data)."""
        r, w = socket.socketpair()
        self.sel.register(r, selectors.EVENT_READ, r)
        return r, w

def test_each_source_gets_its_own_fds_on_the_loop_thread() -> None:
    loop = DaemonLoop("test-loop")
    a, b = Recorder(loop), Recorder(loop)
    (a_r, a_w), (b_r, b_w) = a.watch_pair(), b.watch_pair()
    loop.start()
    try:
        a_w.send(b"x")
        assert wait_until(lambda: len(a.ready_calls) == 1, 5)
        assert b.ready_calls == []
        b_w.send(b"y")
        assert wait_until(lambda: len(b.ready_calls) == 1, 5)
        assert a.ready_calls == [(a_r, selectors.EVENT_READ)]
        assert a.threads == b.threads == {"test-loop"}
        assert b.sel.watched(b_r) == (selectors.EVENT_READ, b_r)
    finally:
        loop.stop()
        for s in (a_r, a_w, b_r, b_w):
            s.close()


def test_a_source_that_fails_does_not_stop_the_others() -> None:
    loop = DaemonLoop("test-loop")
    good = Recorder(loop, wait=0.01)

    class Bad(Recorder):
        def tick(self, now: float) -> float:
            raise RuntimeError("boom")

    Bad(loop, wait=0.01)
    loop.start()
    try:
        before = good.ticks
        assert wait_until(lambda: good.ticks > before + 3, 5)
    finally:
        loop.stop()


def test_a_source_is_ticked_when_it_asked_or_was_poked_not_on_every_pass() -> None:
    """The loop's timers: a source that asks for no tick (inf) is not ticked when other
    sources' fds keep the loop passing; a poke from another thread ticks it at the next
    pass, one on the loop (from its own ``ready``) at the end of that same pass."""
    loop = DaemonLoop("test-loop")
    idle = Recorder(loop, wait=math.inf)
    busy = Recorder(loop, wait=math.inf)
    order: list[str] = []
    idle_ready = idle.ready
    idle_tick = idle.tick

    def ready(data: Any, mask: int) -> None:
        idle_ready(data, mask)
        order.append("ready")
        loop.poke(idle)

    def tick(now: float) -> float:
        order.append("tick")
        return idle_tick(now)

    idle.ready, idle.tick = ready, tick  # type: ignore[method-assign]
    (b_r, b_w), (i_r, i_w) = busy.watch_pair(), idle.watch_pair()
    loop.start()
    try:
        assert wait_until(lambda: idle.ticks == 1 and busy.ticks == 1, 5)  # first: at once
        for i in range(5):
            b_w.send(b"x")
            assert wait_until(lambda i=i: len(busy.ready_calls) == i + 1, 5)
        assert loop.run_sync(lambda: (idle.ticks, busy.ticks)) == (1, 1)
        loop.poke(idle)  # another thread's poke
        assert wait_until(lambda: idle.ticks == 2, 5)
        assert busy.ticks == 1
        order.clear()
        i_w.send(b"y")  # its ready pokes it on the loop: ticked in the same pass
        assert wait_until(lambda: order == ["ready", "tick"], 5)
    finally:
        loop.stop()
        for s in (b_r, b_w, i_r, i_w):
            s.close()


def test_a_poke_during_a_sources_own_tick_stands_and_a_removed_source_is_not_ticked(
        ) -> None:
    loop = DaemonLoop("test-loop")
    again = Recorder(loop, wait=math.inf)
    gone = Recorder(loop, wait=math.inf)
    tick = again.tick

    def pokes_itself_once(now: float) -> float:
        after = tick(now)
        if again.ticks == 1:
            loop.poke(again)  # queued work found during the tick: tick once more
        return after

    again.tick = pokes_itself_once  # type: ignore[method-assign]
    loop.start()
    try:
        assert wait_until(lambda: again.ticks == 2, 5)
        assert loop.run_sync(lambda: gone.ticks) == 1
        loop.run_sync(lambda: loop.remove(gone))
        loop.poke(gone)
        loop.run_sync(lambda: None)  # a pass after the poke was taken
        assert loop.run_sync(lambda: gone.ticks) == 1
        assert loop.run_sync(lambda: again.ticks) == 2  # no tick it did not ask for
    finally:
        loop.stop()


def test_a_source_is_ticked_again_at_the_time_it_asked_for() -> None:
    loop = DaemonLoop("test-loop")
    timed = Recorder(loop, wait=0.01)
    loop.start()
    try:
        assert wait_until(lambda: timed.ticks >= 5, 5)  # no fd, no poke: its timer alone
    finally:
        loop.stop()


def test_calls_from_other_threads_run_on_the_loop_in_order() -> None:
    loop = DaemonLoop("test-loop")
    Recorder(loop, wait=10.0)  # asks for long sleeps: the wake-up must cut them short
    loop.start()
    try:
        seen: list[tuple[int, str]] = []
        for i in range(5):
            loop.call_soon_threadsafe(lambda i=i: seen.append(  # type: ignore[misc]
                (i, threading.current_thread().name)))
        assert wait_until(lambda: len(seen) == 5, 2)
        assert seen == [(i, "test-loop") for i in range(5)]
        assert loop.run_sync(lambda: threading.current_thread().name) == "test-loop"
        with pytest.raises(ValueError, match="bad"):
            loop.run_sync(lambda: int("bad"))
    finally:
        loop.stop()


def test_run_sync_runs_inline_without_a_running_loop_and_remove_unregisters() -> None:
    loop = DaemonLoop("test-loop")
    rec = Recorder(loop)
    r, w = rec.watch_pair()
    assert loop.run_sync(lambda: 7) == 7  # not started: on the caller's thread
    loop.remove(rec)
    assert rec.sel.watched(r) is None
    loop.start()
    try:
        w.send(b"x")
        assert not wait_until(lambda: bool(rec.ready_calls), 0.3)  # no longer served
    finally:
        loop.stop()
        r.close()
        w.close()


def test_a_call_that_keeps_the_loop_is_counted_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """Nothing on the loop may block: a call that does (here a sleep past STALL_WARN_S)
    is counted, and logged once per kind within STALL_LOG_EVERY_S."""
    loop = DaemonLoop("kvbeam-test-loop")
    loop.start()
    try:
        def blocks() -> None:
            time.sleep(STALL_WARN_S * 1.5)

        with caplog.at_level(logging.WARNING, logger="kvbeam.loop"):
            loop.run_sync(blocks)
            loop.run_sync(blocks)
            loop.run_sync(lambda: None)  # quick: not a stall
        assert loop.run_sync(lambda: loop.stalls) == 2
        stalls = [r for r in caplog.records if "kept the loop" in r.getMessage()]
        assert len(stalls) == 1 and "blocks" in stalls[0].getMessage()
    finally:
        loop.stop()


def test_calls_left_when_the_loop_stops_run_at_its_stop() -> None:
    """A call handed over that the loop's thread did not run before it ended (or, here,
    a loop never started) runs at ``stop``: whoever waits for it does not wait out its
    timeout (an executor job's call into the core at a daemon's shutdown)."""
    loop = DaemonLoop("test-loop")
    ran: list[str] = []
    loop.call_soon_threadsafe(lambda: ran.append(threading.current_thread().name))
    assert ran == []
    loop.stop()
    assert ran == [threading.current_thread().name]


def test_a_loop_started_without_a_thread_is_served_by_its_caller_until_stopped() -> None:
    """A daemon's main thread serves the loop itself (server/main.py): calls handed over
    before it serves wait for it; stop() from another thread returns once run() ended."""
    loop = DaemonLoop("test-here")
    seen: list[str] = []
    ended = threading.Event()
    handed: list[str] = []

    def main() -> None:
        loop.start(thread=False)
        assert loop.on_loop  # its own calls run inline from now on
        assert loop.run_sync(lambda: "inline") == "inline"
        started.set()
        assert wait_until(lambda: loop.queued == 1, 5)  # the other thread's, waiting
        loop.run()
        ended.set()

    def other() -> None:
        started.wait(5)
        handed.append(loop.run_sync(lambda: threading.current_thread().name))

    started = threading.Event()
    serving = threading.Thread(target=main, name="the-main")
    asking = threading.Thread(target=other)
    serving.start()
    asking.start()
    asking.join(5)
    assert handed == ["test-here"]  # run by run() on the thread that started it (named so)
    loop.run_sync(lambda: seen.append(threading.current_thread().name))
    assert seen == ["test-here"]
    loop.stop()  # returns once run() ended
    assert not loop.running
    serving.join(5)
    assert ended.is_set()


def test_run_refuses_a_thread_that_did_not_start_the_loop_there() -> None:
    loop = DaemonLoop("test-here")
    with pytest.raises(RuntimeError, match="run\\(\\) serves on the thread that called"):
        loop.run()
    loop.start()
    try:
        with pytest.raises(RuntimeError):
            loop.run()
    finally:
        loop.stop()
