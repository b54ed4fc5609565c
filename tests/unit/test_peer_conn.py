"""PeerConn: the control client it dials lazily, and never once it is closed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvbeam.server.handshake import VerifiedPeer
from kvbeam.server.peers import PeerConn
from kvbeam.transport.base import Link
from tests.core_fakes import FakeLink


class _Client:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


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
