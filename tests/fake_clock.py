"""A clock tests move instead of sleeping, for the parts that take a ``clock``
(TransferTable, PeerChannels, EndLog, the cores' drivers)."""

from __future__ import annotations

import threading

from tests.core_fakes import wait_for


class FakeClock:
    """Monotonic seconds that change only when the test calls :meth:`advance`.

    Callable like ``time.monotonic``; safe to read from any thread. It counts its
    reads, so a test can wait until a part's own thread has read the new time
    (:meth:`wait_reads`).
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._lock = threading.Lock()
        self.now = start
        self.reads = 0
        self._reads_at_advance = 0

    def __call__(self) -> float:
        with self._lock:
            self.reads += 1
            return self.now

    def advance(self, seconds: float) -> float:
        """Move the clock ``seconds`` on; the new time."""
        with self._lock:
            self.now += seconds
            self._reads_at_advance = self.reads
            return self.now

    def wait_reads(self, times: int = 3, timeout: float = 10.0) -> bool:
        """Wait (real time, bounded) until the clock was read ``times`` times since the
        last :meth:`advance`. A part whose one thread reads it once or twice per pass
        (the peer channels' selector, with nothing arriving) has then run at least one
        whole pass on the new time."""
        return wait_for(lambda: self.reads >= self._reads_at_advance + times, timeout)
