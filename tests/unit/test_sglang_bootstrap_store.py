"""The sglang bootstrap store bounds every read (kvbeam/integrations/sglang/bootstrap.py).

It serves one connection at a time, so a client that connects and sends nothing, or
dribbles a line without its end, must not keep it from everyone else: each request
has a deadline and a largest size, past which the store answers (when it can) and
closes the connection.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from kvbeam.integrations.sglang import bootstrap


@pytest.fixture
def store() -> Iterator[bootstrap.BootstrapServer]:
    server = bootstrap.BootstrapServer("127.0.0.1", 0)
    try:
        yield server
    finally:
        server.close()


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=30)


@pytest.mark.parametrize("sent", [b"", b'{"op": "get", "key": "ro'])
def test_a_silent_client_does_not_stall_another(store: bootstrap.BootstrapServer,
                                                sent: bytes) -> None:
    with _connect(store.address) as silent:
        silent.sendall(sent)  # then nothing more, the connection left open
        # Served after the silent client's deadline, well within this call's timeout.
        timeout = bootstrap.REQUEST_DEADLINE_S + 10
        bootstrap.call(store.address, "put", "room.7", {"daemon": "d:1"}, timeout=timeout)
        assert bootstrap.call(store.address, "get", "room.7", timeout=timeout) == {
            "daemon": "d:1"}
        silent.settimeout(timeout)
        assert silent.recv(1) == b""  # the store hung up on it


def test_a_line_past_the_limit_is_refused_naming_it(store: bootstrap.BootstrapServer) -> None:
    with _connect(store.address) as big:
        big.sendall(b"x" * (bootstrap.MAX_LINE + 1))  # the store reads just this far
        with big.makefile("rb") as f:
            reply = json.loads(f.readline())
    assert reply["ok"] is False
    assert f"longer than {bootstrap.MAX_LINE} bytes" in reply["error"], reply
    bootstrap.call(store.address, "put", "room.8", 1)  # and it serves the next one
