"""The interface between a link and the transport that owns it.

A link never reaches into its transport: everything it needs (the local key table,
the regions its endpoint advertises, counting, emitting events, leaving the
transport) goes through :class:`LinkHost`, which each transport implements and
hands to every link it creates. The verbs transport adds what an RDMA link needs
on top (:class:`kvbeam.transport.verbs.linkhost.VerbsHost`), and so does TCP
(:class:`kvbeam.transport.tcp.link.TcpHost`). Unit tests drive links against a
fake host implementing the same protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvbeam.transport.base import Event
from kvbeam.transport.core import EventQueue, RegistrationBook
from kvbeam.transport.endpoint import RemoteRegion
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.regions import RegionTable
from kvbeam.transport.stats import TransferMeter


class LinkHost(Protocol):
    """What every link may ask of its transport; each method is thread-safe."""

    @property
    def options(self) -> TransportOptions:
        """The transport's settings (slice size, deadlines, queue depths)."""

    def local_keys(self) -> RegionTable:
        """The registered local regions with their local keys (a consistent snapshot)."""

    def link_regions(self, link_id: int) -> tuple[RemoteRegion, ...]:
        """The regions (with keys) that link ``link_id``'s endpoint lets its peer write."""

    def submitted(self, link_id: int, transfer_id: int, nbytes: int, nblocks: int) -> None:
        """Count a write the link accepted; call before its completion can be emitted."""

    def link_failed(self, status: str) -> None:
        """Count a link failure with its status (a verbs status, TIMEOUT, a TCP status)."""

    def emit(self, event: Event) -> None:
        """Count and queue an event for :meth:`kvbeam.transport.base.Transport.events`."""

    def stage(self, event: Event) -> None:
        r"""Count and queue an event without waking the event thread: the caller
        :meth:`deliver`\ s it once it holds no lock."""

    def deliver(self) -> None:
        """Hand the queued events over on this thread now: to the handler (see
        :meth:`kvbeam.transport.base.Transport.deliver_to`), else to the event thread.
        The caller holds no lock."""

    def forget(self, link_id: int) -> None:
        """The link is released: drop it from the transport's books."""


class LinkHostBase:
    """The :class:`LinkHost` methods both transports implement alike, over their
    registration book, transfer meter and event queue (which it creates)."""

    def __init__(self) -> None:
        self._book = RegistrationBook()
        self._meter = TransferMeter()
        self._events = EventQueue()

    def events(self, timeout: float | None = 0.0) -> list[Event]:
        """Queued events, waiting up to ``timeout`` for the first."""
        return self._events.drain(timeout)

    def local_keys(self) -> RegionTable:
        """Registered local regions with their local keys."""
        return self._book.local

    def submitted(self, link_id: int, transfer_id: int, nbytes: int, nblocks: int) -> None:
        """Count an accepted write."""
        self._meter.submitted(link_id, transfer_id, nbytes, nblocks)

    def link_failed(self, status: str) -> None:
        """Count a link failure."""
        self._meter.link_failed(status)

    def emit(self, event: Event) -> None:
        """Count and queue an event (the event thread is woken to take it)."""
        self._meter.on_event(event)
        self._events.put(event)

    def stage(self, event: Event) -> None:
        """Count and queue an event for this thread's :meth:`deliver`."""
        self._meter.on_event(event)
        self._events.put(event, wake=False)

    def deliver(self) -> None:
        """Deliver the queued events on this thread (no lock held)."""
        self._events.deliver()

    def deliver_to(self, handler: Callable[[Event], None]) -> None:
        """Events go to ``handler``, on the transport thread that saw them where it can
        (:class:`~kvbeam.transport.core.EventQueue`); :meth:`pump` delivers the rest."""
        self._events.deliver_to(handler)

    def pump(self, timeout: float) -> None:
        """Deliver queued events to the handler, waiting up to ``timeout`` for one."""
        self._events.pump(timeout)

    def wake_with(self, waker: Callable[[], None]) -> None:
        """Call ``waker`` whenever an event waits for :meth:`pump`
        (:meth:`~kvbeam.transport.core.EventQueue.wake_with`)."""
        self._events.wake_with(waker)
