"""The cores are called on the daemon's loop only.

A driver with a loop hands every call into its core from another thread (a gRPC
handler's Send or Abort, an executor job's handshake, grant and post) to the loop and
waits for it (``DriverBase.on_loop``): the core's methods never run on two threads at
once. Here a prefill driver over fakes, with a real loop and a thread-pool executor,
moves one request to Success and aborts another, and every call into its core is
recorded with the thread it ran on.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from kvbeam.server.core import base
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.states import TransferState
from tests.core_fakes import FakeLink, prefill_core, slot_lists, wait_for

ADDR = "127.0.0.1:9"
#: The core's methods that take events (its status reads the table, which locks itself).
EVENTS = ("send", "step", "connected", "granted", "book", "unbook", "posted", "step_failed",
          "handle_event", "abort", "abort_answered", "decode_of", "in_flight", "known")


def _record(core: PrefillDriver) -> list[tuple[str, str]]:
    """Wrap the core's event methods: each call appends (method, its thread's name)."""
    calls: list[tuple[str, str]] = []
    for name in EVENTS:
        method: Callable[..., Any] = getattr(core.core, name)

        @functools.wraps(method)
        def wrapped(*args: Any, _name: str = name, _method: Callable[..., Any] = method,
                    **kwargs: Any) -> Any:
            calls.append((_name, threading.current_thread().name))
            return _method(*args, **kwargs)

        setattr(core.core, name, wrapped)
    return calls


def test_every_call_into_the_core_runs_on_the_loop() -> None:
    core, _fake = prefill_core(integrity=False)  # its executor's threads: with a loop
    loop = core.loop
    assert loop is not None
    calls = _record(core)
    try:
        core.send("r", 300, ADDR, [], True,
                  indices=slot_lists(core, 0, 300))  # this thread: a gRPC handler's
        assert wait_for(lambda: core.peers.by_address(ADDR) is not None)
        conn = core.peers.by_address(ADDR)
        assert conn is not None
        link = conn.link
        assert isinstance(link, FakeLink)
        assert wait_for(lambda: len(link.writes) == 1)  # handshake, grant, post: executor
        tid, _notify = link.writes[0]
        loop.run_sync(lambda: core.on_event(link.completion(tid)))  # the transport's
        assert wait_for(lambda: core.status("r").state is TransferState.SUCCESS)
        core.send("a", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
        assert wait_for(lambda: core.in_flight("a") > 0 or
                        core.status("a").state is TransferState.TRANSFERRING)
        snap = core.abort("a", from_peer=False, detail="the scheduler gave up")
        assert snap.state is TransferState.FAILED
    finally:
        core.loop = None
        loop.stop()
    seen = {name for name, _thread in calls}
    assert {"send", "step", "connected", "granted", "book", "posted", "handle_event",
            "abort", "abort_answered"} <= seen, seen
    off = [(name, thread) for name, thread in calls if thread != "kvbeam-test-loop"]
    assert not off, off


def test_a_call_after_the_loop_stopped_runs_here_one_at_a_time() -> None:
    """Shutdown's stragglers call into the core after the loop stopped: on their own
    thread, under the lock that keeps them one at a time, as the loop ran them."""
    core, _fake = prefill_core(integrity=False)
    loop = core.loop
    assert loop is not None and loop.running
    loop.stop()
    seen = core.on_loop(lambda: (threading.current_thread().name, _held_elsewhere()))
    assert seen == (threading.current_thread().name, True)
    assert not _held_elsewhere()  # released once the call returned


def _held_elsewhere() -> bool:
    """Whether another thread holds the after-the-loop lock (tried from a new thread)."""
    free: list[bool] = []

    def attempt() -> None:
        taken = base._AFTER_LOOP.acquire(blocking=False)
        free.append(taken)
        if taken:
            base._AFTER_LOOP.release()

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(5)
    return free == [False]
