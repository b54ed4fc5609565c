"""Plain counters a transport keeps about its own work, for whoever wants to publish them.

The transports count; they never export. :class:`TransferMeter` is the counting
half (thread-safe, a handful of integer additions per transfer, nothing per
block or WR beyond what posting already does), :class:`TransportStats` the
immutable snapshot :meth:`kvbeam.transport.base.Transport.stats` returns. The
daemons turn snapshots into Prometheus metrics at scrape time
(:mod:`kvbeam.server.metrics`); this package imports no metrics library.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvbeam.transport import status as st
from kvbeam.transport.base import Event, EventKind


@dataclass(frozen=True)
class TransportStats:
    """A snapshot of one transport's counters (monotonic unless named ``inflight``).

    ``None`` means the transport cannot know the value, which is not the same as 0:
    RDMA WRITEs land without the receiving CPU seeing them, so an RDMA receiver has
    no byte count; TCP has no work requests.
    """

    sent_bytes: int = 0  # bytes of transfers the peer acknowledged (completion OK / ACK)
    sent_blocks: int = 0  # blocks of those transfers, as the caller passed them (before slicing)
    completions: Mapping[str, int] = field(default_factory=dict)  # COMPLETED events by status
    inflight_writes: int = 0  # transfers written and not yet COMPLETED
    notifications: int = 0  # NOTIFIED events: a peer's transfer landed here
    link_failures: Mapping[str, int] = field(default_factory=dict)  # by status (QP errors, ...)
    links: int = 0  # links currently open
    received_bytes: int | None = None  # bytes that landed here (TCP only)
    posted_wrs: int | None = None  # work requests posted (RDMA only)
    inflight_wrs: int | None = None  # work requests posted and not yet completed (RDMA only)


class TransferMeter:
    """The counters behind :class:`TransportStats`; every method is thread-safe.

    A transport calls :meth:`submitted` when it accepts a write (before its
    completion can possibly be emitted) and :meth:`on_event` for every event it
    emits. A link completes its transfers in the order it accepted them (RC QPs
    and TCP streams are ordered), so a FIFO per link pairs each COMPLETED event
    with the size of the write it ends, even when one transfer id is written in
    several chunks.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, deque[tuple[int, int, int]]] = {}
        self._inflight = 0
        self._sent_bytes = 0
        self._sent_blocks = 0
        self._completions: Counter[str] = Counter()
        self._notifications = 0
        self._link_failures: Counter[str] = Counter()
        self._received_bytes = 0
        self._posted_wrs = 0

    def submitted(self, link: int, transfer_id: int, nbytes: int, nblocks: int) -> None:
        """A write of ``nblocks`` blocks, ``nbytes`` bytes was accepted on ``link``."""
        with self._lock:
            self._pending.setdefault(link, deque()).append((transfer_id, nbytes, nblocks))
            self._inflight += 1

    def on_event(self, event: Event) -> None:
        """Count an event the transport emits."""
        if event.kind is EventKind.NOTIFIED:
            with self._lock:
                self._notifications += 1
            return
        if event.kind is not EventKind.COMPLETED:
            return
        with self._lock:
            self._completions[event.status if not event.ok else st.OK] += 1
            queue = self._pending.get(event.link)
            if not queue:
                return
            # Normally the head; search only if a link reported out of order.
            for i, entry in enumerate(queue):
                if entry[0] == event.transfer_id:
                    del queue[i]
                    break
            else:
                return
            _, nbytes, nblocks = entry
            if not queue:
                del self._pending[event.link]
            self._inflight -= 1
            if event.ok:
                self._sent_bytes += nbytes
                self._sent_blocks += nblocks

    def link_failed(self, status: str) -> None:
        """A link failed (QP in error, stream broken, own deadline): once per failure."""
        with self._lock:
            self._link_failures[status] += 1

    def received(self, nbytes: int) -> None:
        """``nbytes`` landed in our regions (transports that see inbound bytes)."""
        with self._lock:
            self._received_bytes += nbytes

    def posted(self, wrs: int) -> None:
        """``wrs`` work requests were posted."""
        with self._lock:
            self._posted_wrs += wrs

    def snapshot(self, *, links: int, received: bool = False, wrs: bool = False,
                 inflight_wrs: int | None = None) -> TransportStats:
        """The counters now; ``received``/``wrs`` say which optional ones this transport has."""
        with self._lock:
            return TransportStats(
                sent_bytes=self._sent_bytes, sent_blocks=self._sent_blocks,
                completions=MappingProxyType(dict(self._completions)),
                inflight_writes=self._inflight, notifications=self._notifications,
                link_failures=MappingProxyType(dict(self._link_failures)), links=links,
                received_bytes=self._received_bytes if received else None,
                posted_wrs=self._posted_wrs if wrs else None,
                inflight_wrs=inflight_wrs if wrs else None)
