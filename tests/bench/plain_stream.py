"""The floor under integrity's cost for a large request: the same bytes over loopback TCP
between two plain Python processes, with and without digests, in the same run.

``bench_digest`` times the 61-layer request between two daemons over TCP with integrity
off and on. This moves the same pieces (one per buffer, the request's bytes in each)
between two processes on blocking sockets, nothing of kvbeam in between, and per
request either only moves them ("off") or also digests each piece with XXH3-128
(python-xxhash) on the thread that moves it, prefill before sending it and decode once it
landed, sending the digests after the data and comparing them on the receiving side
("on"). Requests alternate off, on, off, ... so the machine's moods fall on both alike.
Its on / off is what digesting both ends costs a program with no overhead of its own on
this machine: where the transfer already keeps the cores busy, no design of the daemons
makes integrity cheaper than this.

Run by ``bench_digest`` (the sender, :class:`PlainStream`, its requests interleaved with
the daemons'); the receiver is
``python -m tests.bench.plain_stream PORT SIZES_FILE`` in a fresh process.
"""

from __future__ import annotations

import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from tests.bench.bench_floor import recv_exact
from tests.bench.line_process import LineProcess

#: A request's header: its mode (0 off, 1 on).
_HEADER = struct.Struct("<B")
_DIGEST = 16


def _pieces(memory: memoryview, sizes: list[int]) -> list[memoryview]:
    out, at = [], 0
    for n in sizes:
        out.append(memory[at:at + n])
        at += n
    return out


def receive(port: int, sizes: list[int]) -> None:
    """The receiving process: lands each request's pieces, digests them when asked,
    compares with the sender's digests and answers one byte (1: equal or not asked)."""
    memory = memoryview(bytearray(sum(sizes)))
    pieces = _pieces(memory, sizes)
    record = bytearray(_DIGEST * len(sizes))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print("ready", flush=True)
    head = bytearray(_HEADER.size)
    while True:
        try:
            recv_exact(sock, memoryview(head))
        except ConnectionError:
            return
        (on,) = _HEADER.unpack(head)
        digests = []
        for piece in pieces:
            recv_exact(sock, piece)
            if on:
                digests.append(xxhash.xxh3_128_digest(piece))
        ok = True
        if on:
            recv_exact(sock, memoryview(record))
            ok = b"".join(digests) == bytes(record)
        sock.sendall(b"\x01" if ok else b"\x00")


class PlainStream:
    """The sending side: a receiver process started, connected, and the request's
    pieces in memory; :meth:`request` moves them once. Use as a context manager."""

    def __init__(self, sizes: list[int]) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvbeam-plain-")
        listener = socket.create_server(("127.0.0.1", 0))
        sizes_file = Path(self._tmp.name) / "sizes"
        sizes_file.write_text(" ".join(map(str, sizes)))
        self._child = LineProcess("tests.bench.plain_stream",
                                  [str(listener.getsockname()[1]), str(sizes_file)], "ready")
        self._sock, _ = listener.accept()
        listener.close()
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        memory = np.random.default_rng(1).integers(0, 255, sum(sizes), dtype=np.uint8).data
        self._pieces = _pieces(memory, sizes)

    def request(self, on: bool) -> tuple[float, float]:
        """Move the pieces once (``on``: digested at both ends and compared); the wall ms
        until the receiver answered, and this thread's CPU ms."""
        t0, c0 = time.perf_counter(), time.thread_time()
        self._sock.sendall(_HEADER.pack(on))
        digests = []
        for piece in self._pieces:
            if on:
                digests.append(xxhash.xxh3_128_digest(piece))
            self._sock.sendall(piece)
        if on:
            self._sock.sendall(b"".join(digests))
        answer = bytearray(1)
        recv_exact(self._sock, memoryview(answer))
        if answer[0] != 1:
            raise SystemExit("the plain stream's digests differ")
        return (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3

    def close(self) -> None:
        """Stop the receiver (it exits when the connection closes)."""
        self._sock.close()
        self._child.proc.wait(30)
        self._tmp.cleanup()

    def __enter__(self) -> PlainStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    receive(int(sys.argv[1]), [int(n) for n in Path(sys.argv[2]).read_text().split()])
