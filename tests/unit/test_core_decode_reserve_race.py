"""An Abort that arrives while Reserve is still putting the reservation together:
between the request's table entry and the core's record of it. Either it finds no
request (Reserve had not created it yet) or the whole reservation, whose slot it
then frees; never the entry without the record, which left the slot held for good.

Both calls run on the daemon's loop, one after the other: an Abort handed to the loop
while Reserve runs there waits for Reserve to finish."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvbeam.server.state.lifecycle import Deadlines, TransferTable
from kvbeam.states import FailureReason, TransferState, TransferStatus
from tests.core_fakes import started_loop, wait_for
from tests.unit.test_core_decode import PREFILL, _core

WAIT_S = 30  # a bound on the wait for the other thread, never reached when it works


class HookedTable(TransferTable):
    """A transfer table that calls ``after_create`` right after it created a request."""

    after_create: Callable[[], None] = staticmethod(lambda: None)

    def create(self, request_id: str, peer: str, *, now: float) -> TransferStatus:
        snap = super().create(request_id, peer, now=now)
        self.after_create()
        return snap


def test_an_abort_between_the_table_entry_and_the_record_leaks_no_slot() -> None:
    core, io, _prefill, _conn = _core()
    table = HookedTable(Deadlines())
    core.core.table = table
    free = core.slots.free
    core.loop = loop = started_loop()
    answers: list[TransferStatus] = []
    aborter = threading.Thread(
        target=lambda: answers.append(core.abort("r", from_peer=False, detail="scheduler")))
    queued: list[bool] = []

    def abort_now() -> None:  # on the loop: the request's table entry exists from here on
        table.after_create = lambda: None
        aborter.start()
        # The Abort is handed to the loop, which is busy with this Reserve: it waits.
        queued.append(wait_for(lambda: loop.queued > 0, WAIT_S))
        queued.append(not answers)

    table.after_create = abort_now
    try:
        res = core.reserve("r", 300, PREFILL)
        aborter.join(WAIT_S)
        assert not aborter.is_alive()
    finally:
        core.loop = None
        loop.stop()
    assert queued == [True, True], "the Abort ran beside Reserve instead of after it"
    io.run_all()  # the Abort's word to prefill (nothing was granted: none is writing)
    assert answers and answers[0].state is TransferState.FAILED
    assert answers[0].reason is FailureReason.ABORTED
    assert core.status("r").state is TransferState.FAILED
    assert core.slot_of("r") == -1, f"slot {res.slot} still held by an aborted request"
    assert core.slots.free == free, "the aborted reservation's slot leaked"
