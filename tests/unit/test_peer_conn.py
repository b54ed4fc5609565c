"""PeerConn: the control client it dials lazily, and never once it is closed; the peer
channel it closes (or keeps, as decode's watch on a prefill whose link failed); which
closed channel proves its peer lost (lost_peer)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvbeam.server.handshake import VerifiedPeer
from kvbeam.server.peers import PeerConn, Peers, lost_peer
from kvbeam.transport.base import Link
from tests.core_fakes import FakeLink


class _Client:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Channel:
    """A peer channel's closing, as PeerConn and lost_peer see it."""

    def __init__(self, conn: PeerConn | None = None) -> None:
        self.bound = conn
        self.closed = False
        self.orderly = False
        self.peer = "prefill p1"
        if conn is not None:
            conn.channel = self

    def close(self, reason: str, *, bye: bool = False) -> None:
        if not self.closed:
            self.closed, self.orderly = True, bye

    def eof(self) -> _Channel:
        """The peer's process went: the channel closes without a BYE."""
        self.close("the peer closed the connection")
        return self


def _conn(dialed: list[_Client]) -> PeerConn:
    def dial(_address: str) -> Any:
        dialed.append(_Client())
        return dialed[-1]

    peer = SimpleNamespace(instance_id="decode-1", control_address="127.0.0.1:9")
    return PeerConn(cast(VerifiedPeer, peer), cast(Link, FakeLink()), dial)


def test_the_client_is_dialed_once_and_closed_with_the_connection() -> None:
    dialed: list[_Client] = []
    conn = _conn(dialed)
    assert conn.client() is conn.client()
    assert len(dialed) == 1
    conn.close()
    assert dialed[0].closed


def test_a_closed_connection_dials_nothing() -> None:
    # A caller that took the connection before it closed (a heartbeat, an Abort) must not
    # open a gRPC channel no one will close.
    dialed: list[_Client] = []
    conn = _conn(dialed)
    conn.close()
    with pytest.raises(ValueError, match=r"connection to peer decode-1 .* is closed"):
        conn.client()
    assert dialed == []


def test_closing_the_connection_retires_its_channel_with_a_bye() -> None:
    conn = _conn([])
    channel = _Channel(conn)
    conn.close()
    assert channel.closed and channel.orderly


def test_a_link_only_drop_keeps_the_channel_as_the_peers_watch() -> None:
    # Decode, when only the link failed: the prefill closes the channel (a BYE) when it
    # drops its side; if instead it died, the channel's EOF must still say so.
    conn = _conn([])
    channel = _Channel(conn)
    conn.close(keep_channel=True)
    assert conn.closed and not channel.closed
    assert lost_peer(channel.eof(), Peers()) is conn


def test_an_eof_proves_the_peer_lost_whichever_socket_was_handled_first() -> None:
    # The CI failure: the data link's EOF was handled first (the connection dropped,
    # closed), then the channel's EOF arrived, and was ignored: the request timed out.
    peers = Peers()
    conn = _conn([])
    channel = _Channel(conn)
    peers.add(conn)
    assert lost_peer(channel.eof(), peers) is conn  # the channel first
    peers.remove(conn)
    conn.close()  # the link first: closing found the channel closed already
    assert lost_peer(channel, peers) is conn


def test_a_bye_a_replaced_channel_or_a_newer_connection_lose_no_peer() -> None:
    peers = Peers()
    conn = _conn([])
    retired = _Channel(conn)
    retired.close("replaced", bye=True)
    assert lost_peer(retired, peers) is None
    replaced = _Channel(conn)
    _Channel(conn)  # the same prefill's newer channel on the same connection
    assert lost_peer(replaced.eof(), peers) is None
    assert lost_peer(_Channel().eof(), peers) is None  # never bound (no HELLO)
    # The connection was dropped for its link and the prefill handshook again: the old
    # channel's EOF (it never sent its BYE) does not fail the requests of the new one.
    old = _Channel(conn)
    conn.close(keep_channel=True)
    newer = _conn([])
    _Channel(newer)
    peers.add(newer)
    assert lost_peer(old.eof(), peers) is None
    peers.remove(newer)
    newer.close()
    assert lost_peer(old, peers) is conn  # gone too: nothing says the peer lives
