"""An engine's ABORT on prefill never waits on the daemon's loop for writes to drain.

The engine channel's frames are handled on the daemon's loop, the same thread that
brings the transport's completions (TCP's ACKs, RDMA's completion events): an abort
that waited there for the request's writes to drain would stall the whole daemon for
``ABORT_WAIT_S`` and wait in vain.
"""

from __future__ import annotations

from typing import Any, cast

from kvbeam.proto import engine_frames as ef
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.engines.channel import CoreOps
from kvbeam.states import TransferStatus


class _AbortRecorder(PrefillDriver):
    """A prefill driver that only records its aborts (nothing else is called)."""

    def __init__(self) -> None:  # no core: the ops call abort alone
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def abort(self, request_id: str, **kwargs: Any) -> TransferStatus:
        self.calls.append((request_id, kwargs))
        return cast(TransferStatus, None)


def test_an_engine_abort_on_prefill_does_not_wait_for_the_drain() -> None:
    driver = _AbortRecorder()
    ops = CoreOps("prefill", lambda: driver, lambda: 4096)
    ops.abort(ef.Abort("r1", ""))
    ops.abort(ef.Abort("r2", "the engine gave up"))
    assert driver.calls == [
        ("r1", {"from_peer": False, "detail": "aborted by the engine", "wait_s": 0.0}),
        ("r2", {"from_peer": False, "detail": "the engine gave up", "wait_s": 0.0})]
