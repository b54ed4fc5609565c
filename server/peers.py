"""A daemon's connections to its verified peers: link, control channel, peer buffer addresses.

One :class:`PeerConn` per verified peer instance. It exists only for a
:class:`~kvbeam.server.handshake.VerifiedPeer` (so no data path without a
handshake) and owns the per-peer transport link and control channel; closing it
releases both, which also guarantees the peer can no longer write into us.
"""

from __future__ import annotations

import logging
import threading

from kvbeam.errors import ProtocolError
from kvbeam.logs import fields
from kvbeam.pools.layout import SideLayout
from kvbeam.server.handshake import VerifiedPeer
from kvbeam.server.options import ControlOptions
from kvbeam.server.peer_client import ControlClient
from kvbeam.transport.base import Link

log = logging.getLogger(__name__)


def peer_buffer_addrs(layout: SideLayout, peer: VerifiedPeer) -> list[int]:
    """The peer's buffer base addresses, aligned with ``layout.flat_buffers``.

    A kvbeam daemon registers one region per tensor, in tensor order, so buffer
    ``b`` lives at ``regions[b.tensor].addr + b.offset``. Anything else is refused.
    """
    regions = peer.endpoint.regions
    tensors = layout.tensors
    if len(regions) != len(tensors):
        raise ProtocolError("side.endpoint.regions",
                            f"{len(regions)} regions for {len(tensors)} tensors")
    for i, (r, t) in enumerate(zip(regions, tensors, strict=True)):
        if r.length != t.nbytes:
            raise ProtocolError(f"side.endpoint.regions[{i}].length",
                                f"{r.length} bytes, but tensor {t.name} has {t.nbytes}")
    return [regions[b.tensor].addr + b.offset for b in layout.flat_buffers]


class PeerConn:
    """One verified peer: its data link, a control channel to it, its buffer addresses."""

    def __init__(self, peer: VerifiedPeer, link: Link, options: ControlOptions,
                 addrs: list[int] | None = None) -> None:
        self.peer = peer
        self.link = link
        self.options = options
        #: The peer's buffer addresses (prefill needs decode's; decode needs none).
        self.addrs = addrs or []
        self._client: ControlClient | None = None
        self._lock = threading.Lock()
        self.closed = False
        self.missed_heartbeats = 0

    @property
    def instance_id(self) -> str:
        """The peer's instance id."""
        return self.peer.instance_id

    @property
    def control_address(self) -> str:
        """Where the peer's control server listens."""
        return self.peer.control_address

    def client(self) -> ControlClient:
        """The control channel to the peer (opened on first use)."""
        with self._lock:
            if self._client is None:
                self._client = ControlClient(self.control_address, options=self.options)
            return self._client

    def close(self) -> None:
        """Release the link (the peer can no longer write into us) and the channel."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            client, self._client = self._client, None
        try:
            self.link.release()
        finally:
            if client is not None:
                client.close()
        log.info("connection to peer %s (%s) closed", self.instance_id, self.control_address,
                 extra=fields(peer=self.control_address))


class PeerSet:
    """The live :class:`PeerConn` objects, by instance id and by link id (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_instance: dict[str, PeerConn] = {}
        self._by_link: dict[int, PeerConn] = {}

    def add(self, conn: PeerConn) -> None:
        """Record a connection (replacing none: a new instance id is a new peer)."""
        with self._lock:
            self._by_instance[conn.instance_id] = conn
            self._by_link[conn.link.id] = conn

    def get(self, instance_id: str) -> PeerConn | None:
        """The connection to a peer instance, if live."""
        with self._lock:
            return self._by_instance.get(instance_id)

    def by_link(self, link_id: int) -> PeerConn | None:
        """The connection owning a transport link."""
        with self._lock:
            return self._by_link.get(link_id)

    def by_address(self, control_address: str) -> PeerConn | None:
        """The live connection to whichever instance listens at ``control_address``."""
        with self._lock:
            for conn in self._by_instance.values():
                if conn.control_address == control_address:
                    return conn
            return None

    def remove(self, conn: PeerConn) -> bool:
        """Forget a connection; True if it was recorded."""
        with self._lock:
            known = self._by_instance.get(conn.instance_id) is conn
            if known:
                del self._by_instance[conn.instance_id]
                self._by_link.pop(conn.link.id, None)
            return known

    def all(self) -> list[PeerConn]:
        """A snapshot of the live connections."""
        with self._lock:
            return list(self._by_instance.values())
