"""An Abort that arrives while Reserve is still putting the reservation together:
between the request's table entry and the core's record of it. Either it finds no
request (Reserve had not created it yet) or the whole reservation, whose slot it
then frees; never the entry without the record, which left the slot held for good."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

from kvbeam.server.state.lifecycle import Deadlines, TransferTable
from kvbeam.states import FailureReason, TransferState, TransferStatus
from tests.unit.test_core_decode import PREFILL, _core

WAIT_S = 30  # a bound on the wait for the other thread, never reached when it works


class HookedTable(TransferTable):
    """A transfer table that calls ``after_create`` right after it created a request."""

    after_create: Callable[[], None] = staticmethod(lambda: None)

    def create(self, request_id: str, peer: str) -> TransferStatus:
        snap = super().create(request_id, peer)
        self.after_create()
        return snap


class WatchedLock:
    """The core's lock, telling ``contended`` when a caller has to wait for it."""

    def __init__(self, contended: threading.Event) -> None:
        self._lock = threading.Lock()
        self._contended = contended

    def __enter__(self) -> bool:
        if not self._lock.acquire(blocking=False):
            self._contended.set()
            self._lock.acquire()
        return True

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_an_abort_between_the_table_entry_and_the_record_leaks_no_slot() -> None:
    core, io, _prefill, _conn = _core()
    table = HookedTable(Deadlines())
    core.core.table = table
    free = core.slots.free
    # Set once the interleaved Abort has finished, or has to wait for the core's lock
    # (Reserve holds it): Reserve goes on then, and the Abort runs after it.
    abort_done_or_waiting = threading.Event()
    core.core._lock = cast(Any, WatchedLock(abort_done_or_waiting))
    answers: list[TransferStatus] = []

    def abort() -> None:
        answers.append(core.abort("r", from_peer=False, detail="scheduler"))
        abort_done_or_waiting.set()

    aborter = threading.Thread(target=abort)

    def abort_now() -> None:  # the request's table entry exists from here on
        table.after_create = lambda: None
        aborter.start()
        assert abort_done_or_waiting.wait(WAIT_S), "the Abort neither finished nor waited"

    table.after_create = abort_now
    res = core.reserve("r", 300, PREFILL)
    aborter.join(WAIT_S)
    assert not aborter.is_alive()
    io.run_all()  # the Abort's word to prefill (nothing was granted: none is writing)
    assert answers and answers[0].state is TransferState.FAILED
    assert answers[0].reason is FailureReason.ABORTED
    assert core.status("r").state is TransferState.FAILED
    assert core.slot_of("r") == -1, f"slot {res.slot} still held by an aborted request"
    assert core.slots.free == free, "the aborted reservation's slot leaked"
