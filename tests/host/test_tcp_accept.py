"""Inbound TCP data connections before their HELLO: no thread each, a cap, a timeout.

Anyone who can reach a daemon's data port can open connections to it; only the peer a
link was created for knows the token its HELLO must name. Until a connection has
named a live link it costs a socket, not a thread, and the number of such connections
is capped (the oldest is dropped first: a real peer sends its HELLO at once).
"""

from __future__ import annotations

import logging
import mmap
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack, closing
from pathlib import Path

import numpy as np
import pytest

from kvbeam.scheduler import run_request
from kvbeam.transport import Access, Blocks, EventKind, Region
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.tcp import TcpTransport, wire
from kvbeam.transport.tcp import transport as tcp_transport
from tests.daemon_helpers import pair
from tests.transport_peer import buffer_address
from tests.waiting import wait_until

IDLE = 120  # idle connections opened by the tests (below the listen backlog of 128)
SIZE = 1 << 20


def _idle_connections(port: int, n: int, stack: ExitStack) -> list[socket.socket]:
    """``n`` connections to ``port`` that send nothing, closed when ``stack`` closes."""
    return [stack.enter_context(socket.create_connection(("127.0.0.1", port), 10))
            for _ in range(n)]


@pytest.fixture
def buffers() -> Iterator[tuple[mmap.mmap, mmap.mmap]]:
    src, dst = mmap.mmap(-1, SIZE), mmap.mmap(-1, SIZE)
    src.write(np.random.default_rng(5).integers(0, 256, SIZE, np.uint8).tobytes())
    yield src, dst
    src.close()
    dst.close()


def test_idle_connections_get_no_thread_and_a_new_link_still_connects(
        buffers: tuple[mmap.mmap, mmap.mmap], caplog: pytest.LogCaptureFixture) -> None:
    src, dst = buffers
    opts = TransportOptions(op_timeout_s=10.0)
    with ExitStack() as stack:
        sender = stack.enter_context(closing(TcpTransport(options=opts)))
        receiver = stack.enter_context(closing(TcpTransport(options=opts)))
        sender.register([Region(buffer_address(src), SIZE)], Access.LOCAL)
        receiver.register([Region(buffer_address(dst), SIZE)], Access.REMOTE_WRITE)
        before = threading.active_count()
        caplog.set_level(logging.WARNING, logger=tcp_transport.__name__)
        _idle_connections(receiver.port, IDLE, stack)  # no HELLO from any of them
        # A real peer connects after all of them (accepted in order, so they were
        # all accepted before it) and writes.
        out, inbound = sender.create_link(), receiver.create_link()
        inbound.connect(out.endpoint)
        out.connect(inbound.endpoint)
        out.write(1, Blocks(np.array([buffer_address(src)], np.uint64),
                            np.array([buffer_address(dst)], np.uint64),
                            np.array([SIZE], np.uint64)))
        events = sender.events(30)
        assert [(e.kind, e.ok) for e in events] == [(EventKind.COMPLETED, True)], events
        assert dst[:] == src[:]
        # Both links connected both ways: one data plane thread per transport serves
        # every connection, so the links and the idle connections add no thread.
        grown = threading.active_count() - before
        assert grown == 0, f"{grown} threads more with {IDLE} idle connections open"
        assert any("unauthenticated" in r.getMessage() for r in caplog.records), \
            "no log line for the connections over the cap"


def test_a_connection_that_sends_no_hello_is_closed_after_the_hello_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp_transport, "HELLO_TIMEOUT_S", 0.5)
    with ExitStack() as stack:
        receiver = stack.enter_context(closing(TcpTransport()))
        (sock,) = _idle_connections(receiver.port, 1, stack)
        sock.settimeout(30)
        assert sock.recv(1) == b""  # the receiver closed it


def test_a_wrong_token_is_dropped_without_a_thread() -> None:
    with ExitStack() as stack:
        receiver = stack.enter_context(closing(TcpTransport()))
        (sock,) = _idle_connections(receiver.port, 1, stack)
        token = b"0" * 32
        sock.sendall(wire.frame(wire.HELLO, length=len(token)) + token)
        sock.settimeout(30)
        assert sock.recv(1) == b""


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise RuntimeError(f"no thread count for pid {pid}")


def test_a_daemon_flooded_with_idle_data_connections_keeps_its_threads_and_transfers() -> None:
    with pair() as (_prefill, decode, p, d), ExitStack() as stack:
        assert run_request(p, d, "warm", 1000, 0).ok
        found = re.search(r"data plane is TCP on [^:\s]+:(\d+)", decode.output)
        assert found, "decode did not log its TCP data port"
        pid = decode.proc.pid
        before = _threads(pid)
        _idle_connections(int(found.group(1)), IDLE, stack)
        # Whatever the daemon does with them, it has had them all for this long.
        wait_until(lambda: _threads(pid) >= before + IDLE, 3)
        grown = _threads(pid) - before
        assert grown < 16, f"decode runs {grown} threads more with {IDLE} idle connections"
        assert run_request(p, d, "flooded", 2000, 1).ok
        assert "unauthenticated" in decode.output
