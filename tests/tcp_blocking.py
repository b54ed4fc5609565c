"""Blocking reads of the TCP wire for tests: a stand-in receiver that reads frame by frame.

The package reads and writes non-blocking on the selector loop
(:mod:`kvbeam.transport.tcp.transport`'s ``_Receiver``, :mod:`kvbeam.transport.tcp.link`);
these wait instead, up to the socket's timeout for each step of progress, so that a test
can read what a sender wrote one frame at a time.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvbeam.transport.tcp import iov, wire


def wait(sock: socket.socket, reading: bool) -> None:
    """Until ``sock`` is readable (or writable); TimeoutError after the socket's timeout."""
    timeout = sock.gettimeout()
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN if reading else select.POLLOUT)
    if not poller.poll(None if timeout is None else int(timeout * 1000) + 1):
        raise TimeoutError("timed out")


def move_all(stream: iov.Vectors, sock: socket.socket, *, reading: bool,
             progress: Callable[[], None] | None = None) -> None:
    """Move the whole stream, waiting (:func:`wait`) wherever the socket would block."""
    while not stream.move(sock, reading=reading, progress=progress):
        wait(sock, reading)


def transfer(sock: socket.socket, addrs: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64],
             *, reading: bool, progress: Callable[[], None] | None = None) -> None:
    """Write (or read into) every ``[addrs[i], addrs[i] + lengths[i])`` in order, all bytes."""
    if len(addrs):
        move_all(iov.Vectors(addrs, lengths), sock, reading=reading, progress=progress)


def recv_into(sock: socket.socket, target: memoryview) -> bool:
    """Fill ``target`` from the socket. False on a clean EOF before the first byte; a
    timeout, or EOF once bytes flowed, raises."""
    off = 0
    while off < len(target):
        n = sock.recv_into(target[off:])
        if n == 0:
            if off == 0:
                return False
            raise ConnectionError(f"peer closed the connection mid-frame ({off}/{len(target)})")
        off += n
    return True


def recv_header(sock: socket.socket) -> tuple[int, int, int, int, int] | None:
    """The next header as (kind, flags, transfer_id, addr, length); None on a clean EOF."""
    buf = bytearray(wire.HEADER.size)
    if not recv_into(sock, memoryview(buf)):
        return None
    kind, flags, _, transfer_id, addr, length = wire.HEADER.unpack(buf)
    return kind, flags, transfer_id, addr, length


def recv_descs(sock: socket.socket, count: int) -> tuple[npt.NDArray[np.uint64],
                                                          npt.NDArray[np.uint64]]:
    """A WRITEV frame's ``count`` destination addresses and lengths."""
    if not 0 < count <= wire.MAX_VEC:
        raise ConnectionError(f"WRITEV frame with {count} blocks (at most {wire.MAX_VEC})")
    raw = bytearray(16 * count)
    if not recv_into(sock, memoryview(raw)):
        raise ConnectionError("peer closed the connection mid-frame")
    pairs = np.frombuffer(raw, dtype="<u8").reshape(count, 2).astype(np.uint64)
    return pairs[:, 0], pairs[:, 1]
