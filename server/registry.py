"""The verified peers of a control server, by instance id; detects peer restarts."""

from __future__ import annotations

import logging
import threading

from kvbeam.errors import NotHandshakenError
from kvbeam.server.handshake import VerifiedPeer

log = logging.getLogger(__name__)


class PeerRegistry:
    """Thread-safe map instance id -> :class:`VerifiedPeer` (gRPC handlers run in a pool).

    A peer that handshakes again from the same ``control_address`` with a new
    instance id has restarted: its old entry is dropped, so transfers that name
    the old instance fail with :class:`NotHandshakenError` instead of writing into
    memory the new process never registered.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, VerifiedPeer] = {}

    def add(self, peer: VerifiedPeer) -> list[VerifiedPeer]:
        """Record a verified peer; returns the entries it replaced because the peer restarted."""
        with self._lock:
            stale = [p for iid, p in self._peers.items()
                     if peer.control_address and p.control_address == peer.control_address
                     and iid != peer.instance_id]
            for p in stale:
                del self._peers[p.instance_id]
            self._peers[peer.instance_id] = peer
        for p in stale:
            log.warning("peer at %s restarted: instance %s replaces %s; the old instance's "
                        "transfers must fail", peer.control_address, peer.instance_id,
                        p.instance_id)
        return stale

    def get(self, instance_id: str) -> VerifiedPeer | None:
        """The verified peer with this instance id, or None."""
        with self._lock:
            return self._peers.get(instance_id)

    def require(self, instance_id: str) -> VerifiedPeer:
        """The verified peer with this instance id.

        Raises:
            NotHandshakenError: no successful handshake with that instance (never
                handshaken, removed, or restarted since).
        """
        peer = self.get(instance_id)
        if peer is None:
            raise NotHandshakenError(
                f"no successful handshake with peer instance {instance_id!r}: the peer must "
                "handshake first (or again, if it restarted) before any transfer")
        return peer

    def remove(self, instance_id: str) -> VerifiedPeer | None:
        """Forget a peer (e.g. after its link failed); returns the entry, if any."""
        with self._lock:
            return self._peers.pop(instance_id, None)

    def peers(self) -> list[VerifiedPeer]:
        """A snapshot of the verified peers."""
        with self._lock:
            return list(self._peers.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._peers)

    def __contains__(self, instance_id: object) -> bool:
        with self._lock:
            return instance_id in self._peers
