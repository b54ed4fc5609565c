"""PeerConn: the peer channel it closes (or keeps, as decode's watch on a prefill whose
link failed); how long it has gone without an open channel; which closed channel proves
its peer lost (lost_peer)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from kvbeam.server.state.handshake import VerifiedPeer
from kvbeam.server.state.peers import PeerConn, Peers, lost_peer
from kvbeam.transport.base import Link
from tests.core_fakes import FakeLink


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


def _conn() -> PeerConn:
    peer = SimpleNamespace(instance_id="decode-1", control_address="127.0.0.1:9")
    return PeerConn(cast(VerifiedPeer, peer), cast(Link, FakeLink()))


def test_a_connection_counts_the_time_without_an_open_channel() -> None:
    # The channel carries the heartbeats: a connection without one is dropped by the
    # daemon's sweep after the peer timeout (DaemonServicer._drop_unchanneled).
    # No clock of its own: ``now`` is the daemon's (any number; here 100.0 onwards).
    conn = _conn()
    assert conn.unchanneled_for(100.0) == 0.0  # the first look without one starts the count
    assert conn.unchanneled_for(103.0) == 3.0  # none yet
    channel = _Channel(conn)
    assert conn.unchanneled_for(104.0) == 0.0  # open: the count restarts
    channel.close("gone")
    assert conn.unchanneled_for(106.5) == 2.5


def test_closing_the_connection_retires_its_channel_with_a_bye() -> None:
    conn = _conn()
    channel = _Channel(conn)
    conn.close()
    assert channel.closed and channel.orderly


def test_a_link_only_drop_keeps_the_channel_as_the_peers_watch() -> None:
    # Decode, when only the link failed: the prefill closes the channel (a BYE) when it
    # drops its side; if instead it died, the channel's EOF must still say so.
    conn = _conn()
    channel = _Channel(conn)
    conn.close(keep_channel=True)
    assert conn.closed and not channel.closed
    assert lost_peer(channel.eof(), Peers()) is conn


def test_an_eof_proves_the_peer_lost_whichever_socket_was_handled_first() -> None:
    # The CI failure: the data link's EOF was handled first (the connection dropped,
    # closed), then the channel's EOF arrived, and was ignored: the request timed out.
    peers = Peers()
    conn = _conn()
    channel = _Channel(conn)
    peers.add(conn)
    assert lost_peer(channel.eof(), peers) is conn  # the channel first
    peers.remove(conn)
    conn.close()  # the link first: closing found the channel closed already
    assert lost_peer(channel, peers) is conn


def test_a_bye_a_replaced_channel_or_a_newer_connection_lose_no_peer() -> None:
    peers = Peers()
    conn = _conn()
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
    newer = _conn()
    _Channel(newer)
    peers.add(newer)
    assert lost_peer(old.eof(), peers) is None
    peers.remove(newer)
    newer.close()
    assert lost_peer(old, peers) is conn  # gone too: nothing says the peer lives
