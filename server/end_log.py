"""One INFO line per ended transfer, rate-limited: what an operator greps for first.

Every transfer that reaches Success or Failed gets one line on logger
``kvbeam.transfers`` (:data:`kvbeam.logs.end_log`), whatever ``--log-requests`` says::

    request r-7: Success, 45056/45056 bytes landed in 20.3 ms; XXH3-128 verified: ...
    request r-8: Failed (timeout: no progress in ...), 0/45056 bytes landed in 10012.1 ms; ...

At most ``per_s`` lines a second (a token bucket holding one second's worth), so a
daemon ending thousands of transfers a second does not spend its CPU on them; the
ended transfers past that are counted, and one line every :data:`SUMMARY_S` seconds
says how many were not logged one by one (Success and Failed apart). Failures are
logged on their own at WARNING as well, never rate-limited.

The table's observer (:meth:`EndLog.ended`, on whichever thread ended the transfer:
the daemon's loop, a core's call) only appends the snapshot to a queue; the daemon's sweep
(:meth:`EndLog.flush`, every ``SWEEP_S`` on its events thread) formats and writes the
lines, reading what each transfer moved from its core
(:class:`~kvbeam.states.TransferFacts`) with no lock of the caller's held. A line is
therefore up to one sweep late; its figures are the transfer's own (its age when it
ended).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from kvbeam.logs import end_log, fields
from kvbeam.states import TransferFacts, TransferState, TransferStatus

#: Seconds between the lines that count the transfers not logged one by one.
SUMMARY_S = 10.0


class EndLog:
    """The end-of-transfer lines of one daemon (see the module docstring).

    ``per_s``: lines a second at most (0: none, nor summaries); ``facts``: what a
    request moved (the core's, or what its table kept); ``moved``: how the line
    names its bytes ("written" on prefill, "landed" on decode).
    """

    def __init__(self, per_s: float, facts: Callable[[str], TransferFacts], moved: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_s = per_s
        self._facts = facts
        self._moved = moved
        self._clock = clock
        self._ended: deque[TransferStatus] = deque()  # appended by any thread, popped by one
        self._tokens = per_s  # a full bucket: one second's lines
        self._refilled = clock()
        self._summary_from = self._refilled
        self._skipped: dict[TransferState, int] = {}

    def ended(self, snap: TransferStatus) -> None:
        """The table's observer: queue a terminal snapshot (anything else is ignored)."""
        if snap.state.terminal and self.per_s > 0:
            self._ended.append(snap)

    def flush(self, *, final: bool = False) -> None:
        """Log the queued ends within the rate, count the rest; the summary when due
        (``final``: now, the daemon stops). Called by one thread at a time (the
        events thread's sweep; the daemon's stop once that thread ended)."""
        now = self._clock()
        self._tokens = min(self.per_s, self._tokens + (now - self._refilled) * self.per_s)
        self._refilled = now
        while self._ended:
            snap = self._ended.popleft()
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                self._line(snap)
            else:
                self._skipped[snap.state] = self._skipped.get(snap.state, 0) + 1
        if self._skipped and (final or now - self._summary_from >= SUMMARY_S):
            total = sum(self._skipped.values())
            end_log.info("%d more transfer(s) ended in the last %.0f s, not logged one by one "
                         "(%d Success, %d Failed): at most %g lines a second "
                         "(--log-ends-per-s); kvbeam status and /metrics have them all",
                         total, now - self._summary_from,
                         self._skipped.get(TransferState.SUCCESS, 0),
                         self._skipped.get(TransferState.FAILED, 0), self.per_s)
            self._skipped.clear()
        if not self._skipped:
            self._summary_from = now

    def _line(self, snap: TransferStatus) -> None:
        if not end_log.isEnabledFor(logging.INFO):
            return
        facts = self._facts(snap.request_id)
        if snap.state is TransferState.FAILED:
            reason = snap.reason.value if snap.reason is not None else "?"
            outcome = f"Failed ({reason}: {snap.detail})"
        else:
            outcome = snap.state.value
        end_log.info("request %s: %s, %d/%d bytes %s in %.1f ms; %s", snap.request_id,
                     outcome, facts.bytes_done, facts.bytes_total, self._moved,
                     snap.age_s * 1000, facts.verification or "verification unknown",
                     extra=fields(snap.request_id, snap.peer))
