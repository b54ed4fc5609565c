"""The attach server's loop with an engine channel, in process (no daemon): backpressure
on an engine that floods frames for the executor, and the re-attach of an engine whose
socket already closed."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvbeam.proto import engine_frames as ef
from kvbeam.proto.attach_codec import (
    AttachRequest,
    frame,
    read_message,
    reply_from_json,
    request_to_json,
)
from kvbeam.server.engines.attach import AttachServer, PeerCred
from kvbeam.server.engines.channel import MAX_QUEUED_FRAMES, EngineChannel
from tests.fixtures import side


class _Ops:
    """A core that counts DECLINEs (run on the executor) and the queue it saw."""

    def __init__(self) -> None:
        self.channel: EngineChannel | None = None
        self.declines = 0
        self.most_queued = 0
        self._lock = threading.Lock()

    def reserve(self, frame: ef.Reserve) -> None: ...

    def send(self, frame: ef.Send) -> None: ...

    def abort(self, frame: ef.Abort) -> None: ...

    def release(self, frame: ef.Release) -> None: ...

    def decline(self, frame: ef.Decline) -> None:
        assert self.channel is not None
        with self._lock:
            self.declines += 1
            self.most_queued = max(self.most_queued, self.channel._queued)

    def refused(self, frame: ef.EngineFrame, exc: Exception) -> None: ...

    def holds(self, request_id: str) -> bool:
        return False

    def known(self, request_id: str) -> bool:
        return False


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[AttachServer, _Ops, list[str]]]:
    tmp_path.chmod(0o700)
    ops = _Ops()
    detached: list[str] = []
    with ThreadPoolExecutor(4) as io:
        channel = EngineChannel(ops, io)
        ops.channel = channel

        def on_attach(req: AttachRequest, fds: list[int], cred: PeerCred) -> str:
            for fd in fds:
                os.close(fd)
            return "instance"

        srv = AttachServer(str(tmp_path / "a.sock"), (), on_attach, detached.append,
                           channel=channel)
        srv.start()
        try:
            yield srv, ops, detached
        finally:
            srv.stop()
            channel.close()


def _attach(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(frame(request_to_json(AttachRequest("attach", config=side(), components=()))))
    s.settimeout(10)
    data, _ = read_message(s)
    assert reply_from_json(data).ok, data
    return s


def _drain(s: socket.socket) -> None:
    """Read (and drop) what the daemon pushes until the socket is shut down."""
    while True:
        try:
            if not s.recv(1 << 16):
                return
        except OSError:
            return


def _send_all(s: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # shut down by the test
        s.sendall(data)


def test_a_flood_for_the_executor_is_read_no_faster_than_it_drains(
        server: tuple[AttachServer, _Ops, list[str]]) -> None:
    """100,000 DECLINEs (each an executor job): every one is handled, in order of
    arrival, while at most MAX_QUEUED_FRAMES wait for the executor at any time (the
    loop stops reading the socket meanwhile, and comes back when it drained)."""
    srv, ops, _ = server
    s = _attach(srv.path)
    s.settimeout(None)
    reader = threading.Thread(target=_drain, args=(s,), daemon=True)
    reader.start()
    n = 100_000
    flood = b"".join(ef.encode(ef.Decline(f"d{i}", "127.0.0.1:1")) for i in range(n))
    # From a thread: a loop that stopped reading for good would block the write forever.
    writer = threading.Thread(target=lambda: _send_all(s, flood), daemon=True)
    writer.start()
    end = time.monotonic() + 120
    while ops.declines < n and time.monotonic() < end:
        time.sleep(0.05)
    s.shutdown(socket.SHUT_RDWR)
    reader.join(5)
    writer.join(5)
    s.close()
    assert ops.declines == n, ops.declines
    assert MAX_QUEUED_FRAMES // 2 < ops.most_queued <= MAX_QUEUED_FRAMES, ops.most_queued


def test_an_engine_that_closed_is_detached_before_its_successor_attaches(
        server: tuple[AttachServer, _Ops, list[str]]) -> None:
    srv, _, detached = server
    for i in range(10):
        first = _attach(srv.path)
        first.close()
        second = _attach(srv.path)  # at once: the loop may not have seen the EOF yet
        second.close()
        deadline = time.monotonic() + 10
        while len(detached) < 2 * (i + 1) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(detached) == 20 and all("closed the attach socket" in d for d in detached), \
        detached
