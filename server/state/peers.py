"""The one registry of a daemon's peers: who passed the handshake, and the connection to each.

A peer enters by a successful handshake (either direction): :meth:`Peers.add_verified`
records the :class:`~kvbeam.server.state.handshake.VerifiedPeer` (and detects a restart: the
same control address with a new instance id), :meth:`Peers.add` its
:class:`PeerConn` (the data link and the pair's peer channel). Both roles update it
the same way; transfer RPCs require a verified peer (:meth:`Peers.require`), the
data path a connection (:meth:`Peers.get`, :meth:`Peers.by_link`).

No module here imports gRPC: the gRPC-free cores (:mod:`kvbeam.server.core`) use this
registry directly.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvbeam.errors import NotHandshakenError, ProtocolError
from kvbeam.logs import fields
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.mailbox import MAILBOX_KEY, Advert, RecordError, mailbox_region, parse_advert
from kvbeam.pools.sub_batches import SUB_BATCH_KEY, parse_sub_batch
from kvbeam.server.state.handshake import VerifiedPeer
from kvbeam.transport import Link

log = logging.getLogger(__name__)

def peer_mailbox(layout: SideLayout, peer: VerifiedPeer) -> Advert | None:
    """Decode's advertised digest mailbox (``extra[kvbeam-mailbox]``), checked against
    its endpoint's regions and the record size of ``layout``; None when it names none.

    Raises:
        ProtocolError: the advert is malformed, too small or outside decode's regions.
    """
    extra = getattr(peer.endpoint, "extra", None) or {}
    text = extra.get(MAILBOX_KEY, "")
    if not text:
        return None
    try:
        return parse_advert(text, len(layout.flat_buffers), tuple(peer.endpoint.regions))
    except RecordError as exc:
        raise ProtocolError(f"side.endpoint.extra[{MAILBOX_KEY}]", exc.detail) from None


def peer_sub_batch(peer: VerifiedPeer) -> int:
    """Decode's advertised sub-batch size in bytes (``extra[kvbeam-sub-batch]``); 0: none.

    Raises:
        ProtocolError: not a number of bytes in range.
    """
    extra = getattr(peer.endpoint, "extra", None) or {}
    return parse_sub_batch(extra.get(SUB_BATCH_KEY, ""))


def peer_buffer_addrs(layout: SideLayout, peer: VerifiedPeer) -> list[int]:
    """The peer's buffer base addresses, aligned with ``layout.flat_buffers``.

    A kvbeam daemon registers one region per tensor, in tensor order, so buffer
    ``b`` lives at ``regions[b.tensor].addr + b.offset``; decode's digest mailbox
    (its own region, wherever it comes) is not a tensor's and is left
    out. Anything else is refused.
    """
    box = mailbox_region(peer_mailbox(layout, peer), tuple(peer.endpoint.regions))
    regions = [r for r in peer.endpoint.regions if r is not box]
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
    """One verified peer: its data link, the pair's peer channel, its buffer addresses."""

    def __init__(self, peer: VerifiedPeer, link: Link, addrs: list[int] | None = None,
                 mailbox: Advert | None = None) -> None:
        self.peer = peer
        self.link = link
        #: The peer's buffer addresses (prefill needs decode's; decode needs none).
        self.addrs = addrs or []
        #: Decode's digest mailbox, as its handshake advertised it (prefill; None: none,
        #: or decode's view of a prefill). Checked by :func:`peer_buffer_addrs` first.
        self.mailbox = mailbox if mailbox is not None else (
            peer_mailbox(peer.layout, peer) if addrs else None)
        #: Decode's advertised sub-batch size (prefill; 0: none, or decode's view of a
        #: prefill): a large request's sub-batches are marked (pools/sub_batches.py).
        self.sub_batch_bytes = peer_sub_batch(peer) if addrs else 0
        #: The peer channel to this peer (kvbeam.server.peers.channel.PeerChannel) once
        #: one is bound: every per-request message goes over it. None before decode's
        #: is bound (prefill's connect opens its own or fails), and in the cores' tests,
        #: whose fake peers take the calls directly.
        self.channel: Any = None
        #: Decode: the token our handshake reply gave this peer for its channel's HELLO.
        self.channel_token = ""
        self._lock = threading.Lock()  # leaf: guards ``closed`` only
        self.closed = False
        #: When the connection last had an open peer channel, or was first looked at
        #: without one (None: not yet): one without an open channel for the peer timeout
        #: is dropped (:meth:`unchanneled_for`, on the daemon's clock).
        self.last_channeled: float | None = None

    @property
    def missed_heartbeats(self) -> int:
        """Heartbeats in a row the peer left unanswered on its open peer channel (0 with
        none open). Decode does not offer to such a peer, prefill does not wait for its
        offers."""
        channel = self.channel
        if channel is not None and not channel.closed:
            return int(channel.missed_heartbeats())
        return 0

    def unchanneled_for(self, now: float) -> float:
        """Seconds the connection has had no open peer channel (0 while it has one),
        counted from the first look without one (the daemon's sweep looks every
        ``SWEEP_S``, so a connection that never opens one is dropped at most a sweep
        later than the peer timeout after its making)."""
        channel = self.channel
        if self.last_channeled is None or (channel is not None and not channel.closed):
            self.last_channeled = now
            return 0.0
        return now - self.last_channeled

    def retired_channel(self) -> Any:
        """The connection's peer channel once it has closed, else None (it is open, or
        there is none yet). A channel closed with a BYE (the peer released or replaced
        that connection) leaves the connection unable to carry BeginWrite or Offer:
        prefill's core drops it and handshakes again (:meth:`PrefillCore.step`)."""
        channel = self.channel
        return channel if channel is not None and channel.closed else None

    @property
    def instance_id(self) -> str:
        """The peer's instance id."""
        return self.peer.instance_id

    @property
    def control_address(self) -> str:
        """Where the peer's control server listens."""
        return self.peer.control_address

    def close(self, *, keep_channel: bool = False) -> None:
        """Release the link (the peer can no longer write into us) and close the channel.

        ``keep_channel`` (when only the link failed): the peer channel stays open, bound
        to this closed connection. Decode keeps it as the prefill's liveness: the prefill
        closes it with a BYE when it handshakes again, while its EOF without a BYE (the
        process died) still fails the prefill's reservations at once (closing it here
        would race that EOF: whichever the kernel reported first decided). Prefill keeps
        it (:meth:`Peers.keep`) to still reach decode, whose reservations wait for a
        resend: when no new link connects, the Abort goes over it; it retires with a BYE
        once prefill's next handshake with that decode succeeds.
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
            channel = None if keep_channel else self.channel
        if channel is not None:  # orderly: the peer takes it as a link loss, not as gone
            channel.close("its connection was closed on this side", bye=True)
        self.link.release()
        log.info("connection to peer %s (%s) closed", self.instance_id, self.control_address,
                 extra=fields(peer=self.control_address))


class Peers:
    """Verified peers by instance id, and the live connection to each (thread-safe).

    A peer that handshakes again from the same ``control_address`` with a new
    instance id has restarted: its old entry is dropped, so transfers that name
    the old instance fail with :class:`NotHandshakenError` instead of writing into
    memory the new process never registered. ``len()`` and ``in`` count verified
    peers. The lock is a leaf: nothing is called while it is held.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._verified: dict[str, VerifiedPeer] = {}
        self._conns: dict[str, PeerConn] = {}
        self._by_link: dict[int, PeerConn] = {}
        #: Closed connections whose peer channel stays open (prefill, after a link-only
        #: failure: :meth:`keep`), by instance id, until a new connection retires them.
        self._kept: dict[str, list[PeerConn]] = {}

    # ---- verified peers -------------------------------------------------------------
    def add_verified(self, peer: VerifiedPeer) -> list[VerifiedPeer]:
        """Record a verified peer; returns the entries it replaced because the peer restarted."""
        with self._lock:
            stale = [p for iid, p in self._verified.items()
                     if peer.control_address and p.control_address == peer.control_address
                     and iid != peer.instance_id]
            for p in stale:
                del self._verified[p.instance_id]
            self._verified[peer.instance_id] = peer
        for p in stale:
            log.warning("peer at %s restarted: instance %s replaces %s; the old instance's "
                        "transfers must fail", peer.control_address, peer.instance_id,
                        p.instance_id)
        return stale

    def verified(self, instance_id: str) -> VerifiedPeer | None:
        """The verified peer with this instance id, or None."""
        with self._lock:
            return self._verified.get(instance_id)

    def require(self, instance_id: str) -> VerifiedPeer:
        """The verified peer with this instance id.

        Raises:
            NotHandshakenError: no successful handshake with that instance (never
                handshaken, removed, or restarted since).
        """
        peer = self.verified(instance_id)
        if peer is None:
            raise NotHandshakenError(
                f"no successful handshake with peer instance {instance_id!r}: the peer must "
                "handshake first (or again, if it restarted) before any transfer")
        return peer

    def forget(self, instance_id: str) -> VerifiedPeer | None:
        """Forget a verified peer (it must handshake again); returns the entry, if any."""
        with self._lock:
            return self._verified.pop(instance_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._verified)

    def __contains__(self, instance_id: object) -> bool:
        with self._lock:
            return instance_id in self._verified

    # ---- connections ------------------------------------------------------------------
    def add(self, conn: PeerConn) -> list[VerifiedPeer]:
        """Record a connection and its verified peer; returns restarted peers it replaced.
        The peer's kept channels (:meth:`keep`) retire with a BYE: the new connection
        opens its own."""
        stale = self.add_verified(conn.peer)
        with self._lock:
            self._conns[conn.instance_id] = conn
            self._by_link[conn.link.id] = conn
            retired = self._kept.pop(conn.instance_id, [])
            for peer in stale:
                retired += self._kept.pop(peer.instance_id, [])
        _retire(retired, "a new connection to the peer replaced it")
        return stale

    def keep(self, conn: PeerConn) -> None:
        """``conn`` was closed for a link failure only and kept its peer channel open
        (:meth:`PeerConn.close`): the channel still reaches the peer (an Abort for a
        request whose resend could not connect a new link) and still watches it (its
        EOF proves the peer gone), until a new connection to the peer retires it."""
        with self._lock:
            # Those whose channel closed meanwhile (the peer went) are history.
            self._kept = {iid: live for iid, conns in self._kept.items()
                          if (live := [c for c in conns if c.channel is not None
                                       and not c.channel.closed])}
            self._kept.setdefault(conn.instance_id, []).append(conn)

    def kept_channel(self, control_address: str) -> Any:
        """The newest open kept channel (a ``PeerChannel``) to the peer at
        ``control_address``, or None."""
        with self._lock:
            for conns in self._kept.values():
                for conn in reversed(conns):
                    channel = conn.channel
                    if (conn.control_address == control_address and channel is not None
                            and not channel.closed):
                        return channel
        return None

    def get(self, instance_id: str) -> PeerConn | None:
        """The connection to a peer instance, if live."""
        with self._lock:
            return self._conns.get(instance_id)

    def by_link(self, link_id: int) -> PeerConn | None:
        """The connection owning a transport link."""
        with self._lock:
            return self._by_link.get(link_id)

    def by_address(self, control_address: str) -> PeerConn | None:
        """The live connection to whichever instance listens at ``control_address``."""
        with self._lock:
            for conn in self._conns.values():
                if conn.control_address == control_address and not conn.closed:
                    return conn
            return None

    def remove(self, conn: PeerConn, *, forget: bool = False) -> bool:
        """Drop a connection (``forget``: the verified entry too); True if it was recorded."""
        with self._lock:
            known = self._conns.get(conn.instance_id) is conn
            if known:
                del self._conns[conn.instance_id]
                self._by_link.pop(conn.link.id, None)
            if forget:
                self._verified.pop(conn.instance_id, None)
            return known

    def all(self) -> list[PeerConn]:
        """A snapshot of the live connections."""
        with self._lock:
            return list(self._conns.values())

    def close_all(self) -> None:
        """Remove every connection and release its link (shutdown, an engine's detach):
        no write can land over one after; kept channels retire. Blocking (the links'
        release): no lock held while a connection closes."""
        for conn in self.all():
            self.remove(conn)
            conn.close()
        with self._lock:
            retired = [conn for conns in self._kept.values() for conn in conns]
            self._kept.clear()
        _retire(retired, "its daemon released its connections")


def _retire(conns: list[PeerConn], why: str) -> None:
    """Close the kept channels of ``conns`` with a BYE (the peer takes it as a link loss)."""
    for conn in conns:
        channel = conn.channel
        if channel is not None and not channel.closed:
            channel.close(f"kept channel retired: {why}", bye=True)


def lost_peer(channel: Any, peers: Peers) -> PeerConn | None:
    """The connection whose peer a closed peer channel proves lost, or None.

    Only a channel closed without a BYE (the peer's process went, it fell silent, it
    sent a bad frame) that is still its connection's channel counts: a BYE retires it
    (the peer released or replaced that connection), a replaced channel is history.
    Its connection may be closed already, dropped for a link failure that the same
    death caused (the kernel reports both sockets; either may be handled first) or
    kept open as decode's watch on the peer (:meth:`PeerConn.close`); then a newer
    live connection to the same instance means the peer handshook again and is alive.
    """
    conn = channel.bound
    if not isinstance(conn, PeerConn) or conn.channel is not channel or channel.orderly:
        return None
    if conn.closed:
        live = peers.get(conn.instance_id)
        if live is not None and live is not conn and not live.closed:
            log.info("the earlier peer channel to %s closed; the peer is connected again",
                     channel.peer)
            return None
    return conn
