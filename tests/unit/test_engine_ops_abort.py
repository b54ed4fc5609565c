"""Prefill's abort never waits on the daemon's loop for writes to drain.

The engine channel's frames (an engine's ABORT) are handled on the daemon's loop, the
same thread that brings the transport's completions (TCP's ACKs, RDMA's completion
events): an abort that waited there for the request's writes to drain would stall the
whole daemon for ``ABORT_WAIT_S`` and wait in vain. Off the loop (a gRPC handler) the
abort waits a bounded while for the drain, on an event the loop sets.
"""

from __future__ import annotations

import threading

from kvbeam.server.core.actions import RecordRef
from kvbeam.states import TransferState
from tests.core_fakes import FakeLink, prefill_core, slot_lists, wait_for

ADDR = "127.0.0.1:9"


def test_an_abort_on_the_loop_does_not_wait_for_the_drain_and_one_off_it_does() -> None:
    core, _fake = prefill_core(integrity=False)
    loop = core.loop
    assert loop is not None
    watched: list[str] = []  # the requests whose drain an abort waited for
    watch = core.core.watch_drain

    def watch_drain(ref: RecordRef) -> threading.Event | None:
        watched.append(ref.request_id)
        return watch(ref)

    core.core.watch_drain = watch_drain  # type: ignore[method-assign]
    for rid in ("on-loop", "off-loop"):
        core.send(rid, 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    assert wait_for(lambda: core.peers.by_address(ADDR) is not None)
    conn = core.peers.by_address(ADDR)
    assert conn is not None and isinstance(conn.link, FakeLink)
    link = conn.link
    assert wait_for(lambda: len(link.writes) == 2)  # both in flight: never completed
    snap = loop.run_sync(lambda: core.abort("on-loop", from_peer=False, detail="engine"))
    assert snap.state is TransferState.FAILED
    assert watched == [], "an abort on the loop waited for the drain"
    snap = core.abort("off-loop", from_peer=False, detail="scheduler", wait_s=0.05)
    assert snap.state is TransferState.FAILED
    assert watched == ["off-loop"], "an abort off the loop did not wait for the drain"
