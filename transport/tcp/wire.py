"""The TCP transport's wire format and the socket I/O that reads and writes raw memory.

Every frame starts with one fixed header; HELLO and NAK frames carry ``length``
payload bytes after it. A WRITEV frame, the one frame that carries data, holds
``length`` blocks: that many (destination address, length) pairs (little-endian
u64), then their payloads back to back; senders batch a transfer's blocks into
WRITEV frames of at most :data:`MAX_VEC` blocks so that one ``writev`` (and on the
receiver one ``readv``, :mod:`kvbeam.transport.tcp.iov`) moves a whole frame. Kind 2,
the one-block WRITE frame (two system calls and ~20 us of Python per block on each
side), is retired: only builds of protocol 1 and 2 sent it, and those are refused at
the handshake (protocol version); a receiver drops a connection that sends one.
Payloads move between the socket and process memory directly (``readv``/``writev``
on the blocks' addresses), with no intermediate copy.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvbeam.transport.tcp import iov

HEADER = struct.Struct("<BBHIQQ")  # kind, flags, reserved, transfer_id, addr, length

HELLO = 1  # sender -> receiver: payload = the token of the receiver's link
# 2: the retired one-block WRITE frame (never reuse the number)
END = 3  # sender -> receiver: transfer ``transfer_id`` is complete; flags & NOTIFY
ACK = 4  # receiver -> sender: every byte of ``transfer_id`` landed
NAK = 5  # receiver -> sender: ``transfer_id`` was refused; payload = "STATUS detail"
WRITEV = 6  # sender -> receiver: ``length`` (addr, length) pairs, then their payloads

FLAG_NOTIFY = 1

_CHUNK = 4 << 20  # per send/recv call, so a timeout means "no progress", not "too big"
#: Blocks per WRITEV frame: its header and descriptors plus every payload in one call.
MAX_VEC = iov.IOV_MAX - 1
_DESC = np.dtype("<u8")


def frame(kind: int, transfer_id: int = 0, addr: int = 0, length: int = 0, flags: int = 0) -> bytes:
    """One header."""
    return HEADER.pack(kind, flags, 0, transfer_id, addr, length)


def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """Send everything; each call may wait up to the socket timeout for progress."""
    mv = memoryview(data).cast("B")
    off = 0
    while off < len(mv):
        off += sock.send(mv[off:off + _CHUNK])


def recv_into(sock: socket.socket, target: memoryview, idle_ok: bool = False) -> bool:
    """Fill ``target`` from the socket. False on a clean EOF before the first byte.

    With ``idle_ok`` a timeout before the first byte just keeps waiting (an idle
    peer between transfers); a timeout or EOF once bytes flowed raises.
    """
    off = 0
    while off < len(target):
        try:
            n = sock.recv_into(target[off:off + _CHUNK])
        except TimeoutError:
            if idle_ok and off == 0:
                continue
            raise
        if n == 0:
            if off == 0:
                return False
            raise ConnectionError(f"peer closed the connection mid-frame ({off}/{len(target)})")
        off += n
    return True


def recv_header(sock: socket.socket, idle_ok: bool = True) -> tuple[int, int, int, int, int] | None:
    """The next header as (kind, flags, transfer_id, addr, length); None on a clean EOF."""
    buf = bytearray(HEADER.size)
    if not recv_into(sock, memoryview(buf), idle_ok=idle_ok):
        return None
    kind, flags, _, transfer_id, addr, length = HEADER.unpack(buf)
    return kind, flags, transfer_id, addr, length


def recv_bytes(sock: socket.socket, length: int) -> bytes:
    """Exactly ``length`` payload bytes (small payloads: tokens, NAK details)."""
    buf = bytearray(length)
    if length and not recv_into(sock, memoryview(buf)):
        raise ConnectionError("peer closed the connection mid-frame")
    return bytes(buf)


def discard(sock: socket.socket, length: int) -> None:
    """Read and drop ``length`` payload bytes (a refused block) to stay in step."""
    buf = bytearray(min(length, _CHUNK))
    left = length
    while left:
        n = min(left, len(buf))
        if not recv_into(sock, memoryview(buf)[:n]):
            raise ConnectionError("peer closed the connection mid-frame")
        left -= n


def send_writev(sock: socket.socket, src: npt.NDArray[np.uint64], dst: npt.NDArray[np.uint64],
                lengths: npt.NDArray[np.uint64], progress: Callable[[], None]) -> None:
    """Blocks as WRITEV frames of at most :data:`MAX_VEC` blocks, payloads read in place.

    ``progress`` is called after every system call that sent bytes.
    """
    for lo in range(0, len(src), MAX_VEC):
        hi = min(lo + MAX_VEC, len(src))
        head = np.empty(HEADER.size + (hi - lo) * 16, dtype=np.uint8)
        HEADER.pack_into(head.data, 0, WRITEV, 0, 0, 0, 0, hi - lo)
        desc = head[HEADER.size:].view(_DESC).reshape(hi - lo, 2)
        desc[:, 0] = dst[lo:hi]
        desc[:, 1] = lengths[lo:hi]
        addrs = np.concatenate(([head.ctypes.data], src[lo:hi])).astype(np.uint64)
        sizes = np.concatenate(([head.nbytes], lengths[lo:hi])).astype(np.uint64)
        iov.transfer(sock, addrs, sizes, reading=False, progress=progress)


def recv_descs(sock: socket.socket, count: int) -> tuple[npt.NDArray[np.uint64],
                                                          npt.NDArray[np.uint64]]:
    """A WRITEV frame's ``count`` destination addresses and lengths."""
    if not 0 < count <= MAX_VEC:
        raise ConnectionError(f"WRITEV frame with {count} blocks (at most {MAX_VEC})")
    raw = bytearray(count * 2 * _DESC.itemsize)
    if not recv_into(sock, memoryview(raw)):
        raise ConnectionError("peer closed the connection mid-frame")
    pairs = np.frombuffer(raw, dtype=_DESC).reshape(count, 2).astype(np.uint64)
    return pairs[:, 0], pairs[:, 1]
