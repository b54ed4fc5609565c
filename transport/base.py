"""The transport interface: one object, a handful of verbs, handles with explicit release.

In the spirit of NIXL's agent API. A side opens a :class:`Transport` on a device,
registers its memory (:meth:`Transport.register`), and per peer creates a
:class:`Link` whose local :attr:`Link.endpoint` goes into the handshake; after
:meth:`Link.connect` with the peer's endpoint it may :meth:`Link.write` blocks.
Outcomes arrive as :class:`Event` values from :meth:`Transport.events`: the writer
gets one ``COMPLETED`` event per transfer (ok or failed, with the verbs status),
the peer gets one ``NOTIFIED`` event per transfer written with ``notify=True``,
after every byte of it has landed.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from kvbeam.errors import TransportError
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.endpoint import DmaBufRegion, Endpoint, Region, RemoteRegion

if TYPE_CHECKING:
    from kvbeam.transport.stats import TransportStats


class Access(enum.Enum):
    """Who may touch a registered region besides the local process."""

    LOCAL = "local"  # source of our writes only (prefill): no remote access at all
    REMOTE_WRITE = "remote_write"  # peers may write into it (decode); never remote read


class EventKind(enum.Enum):
    """What an :class:`Event` reports."""

    COMPLETED = "completed"  # writer side: a transfer finished, ``ok`` says how
    NOTIFIED = "notified"  # receiver side: a peer's transfer landed completely
    LINK_FAILED = "link_failed"  # a link broke while none of our transfers was on it


@dataclass(frozen=True)
class Event:
    """One data-plane outcome. ``link`` is the local :attr:`Link.id`."""

    kind: EventKind
    link: int
    transfer_id: int | None
    ok: bool = True
    status: str = "OK"  # verbs work-completion status name, e.g. IBV_WC_RETRY_EXC_ERR
    detail: str = ""

    def error(self) -> TransportError | None:
        """The failure as an exception (``None`` when ``ok``)."""
        if self.ok:
            return None
        what = f"transfer {self.transfer_id}" if self.transfer_id is not None else "link"
        return TransportError(f"{what} on link {self.link} failed: {self.status}: {self.detail}",
                              self.status)


class Registration:
    """Handle for registered regions; :meth:`release` deregisters them.

    ``remote`` lists the regions with the registration's shared key. TCP needs no
    keys (0; a link's endpoint token names it instead). RDMA gives each link its
    own rkeys for REMOTE_WRITE regions (in :attr:`Link.endpoint`, revoked when the
    link goes); the shared key here grants no remote access at all.
    """

    def __init__(self, regions: Sequence[Region], access: Access,
                 remote: Sequence[RemoteRegion], release: Callable[[Registration], None]) -> None:
        self.regions = tuple(regions)
        self.access = access
        self.remote = tuple(remote)
        self._release: Callable[[Registration], None] | None = release

    def release(self) -> None:
        """Deregister; wait for transfers that use these regions to complete first."""
        release, self._release = self._release, None
        if release is not None:
            release(self)


class Link(ABC):
    """One connection to one peer. Created by :meth:`Transport.create_link`."""

    id: int

    @property
    @abstractmethod
    def endpoint(self) -> Endpoint:
        """What the peer needs to connect and to write into our regions (for the handshake)."""

    @abstractmethod
    def connect(self, peer: Endpoint) -> None:
        """Connect to the peer described by its endpoint; raises TransportError on failure."""

    @abstractmethod
    def write(self, transfer_id: int, blocks: Blocks, notify: bool = True) -> None:
        """Queue ``blocks`` (src local, dst in the peer) as transfer ``transfer_id`` (32 bits).

        Every block is checked first: one outside the registered local regions or
        the peer's regions raises RegionError and nothing is posted. Returns once
        queued; the outcome arrives as a COMPLETED event, and with ``notify`` the
        peer gets a NOTIFIED event after all the data landed. Raises TransportError
        when the link is not connected or has failed (create a new link then).
        """

    @abstractmethod
    def release(self) -> None:
        """Tear the link down; transfers still queued fail."""


class Transport(ABC):
    """A data plane on one device (or TCP). Close it to release everything."""

    kind: str

    @abstractmethod
    def register(self, regions: Sequence[Region], access: Access) -> Registration:
        """Register memory regions (non-overlapping) for transfers."""

    def register_dmabuf(self, regions: Sequence[DmaBufRegion], access: Access) -> Registration:
        """Register dma-buf memory (a device's: the CPU need not reach it) at the regions'
        iovas. Only the RDMA transport can; the others refuse (TransportError)."""
        raise TransportError(f"the {self.kind} transport cannot register dma-buf memory "
                             "(only RDMA registers it; TCP moves bytes with the CPU)")

    @abstractmethod
    def create_link(self) -> Link:
        """A new link; put its ``endpoint`` into the handshake, then ``connect``."""

    @abstractmethod
    def template_endpoint(self) -> Endpoint:
        """An endpoint of this transport's kind and address, for a side's metadata
        before any link exists; it names no link (nothing can connect to it) and
        costs nothing. Handshakes carry each peer's own link's endpoint instead."""

    @abstractmethod
    def events(self, timeout: float | None = 0.0) -> list[Event]:
        """Events so far, waiting up to ``timeout`` seconds (None: forever) for one."""

    @abstractmethod
    def deliver_to(self, handler: Callable[[Event], None]) -> None:
        """Hand every event to ``handler`` instead of :meth:`events`: called on the
        transport thread that saw the completion, where it holds no lock (one thread at a
        time, in order), or by :meth:`pump`. ``handler`` must not block or raise."""

    @abstractmethod
    def pump(self, timeout: float) -> None:
        """With a handler set: deliver the events no transport thread delivered,
        waiting up to ``timeout`` for one (one thread calls it in a loop)."""

    @abstractmethod
    def wake_with(self, waker: Callable[[], None]) -> None:
        """Call ``waker`` (any thread, maybe under a lock: it must only wake a loop)
        whenever an event waits for :meth:`pump`, so a loop that pumps without waiting
        learns of it at once."""

    @abstractmethod
    def close(self) -> None:
        """Release links and registrations and stop background work. Idempotent."""

    def stats(self) -> TransportStats:
        """A snapshot of this transport's counters (bytes, completions, failures, in flight).

        Cheap and thread-safe; meant to be read at metrics scrape time. The default
        reports nothing (all zero).
        """
        from kvbeam.transport.stats import TransportStats  # stats imports this module

        return TransportStats()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
