"""The TCP transport's wire format and the socket I/O that reads and writes raw memory.

Every frame starts with one fixed header; HELLO and NAK frames carry ``length``
payload bytes after it. A WRITEV frame, the one frame that carries data, holds
``length`` blocks: that many (destination address, length) pairs (little-endian
u64), then their payloads back to back; senders batch a transfer's blocks into
WRITEV frames of at most :data:`MAX_VEC` blocks so that one ``writev`` (and on the
receiver one ``readv``, :mod:`kvbeam.transport.tcp.iov`) moves a whole frame (a frame
per block would cost two system calls and ~20 us of Python per block on each side).
Kind 2 is reserved; a receiver drops a connection that sends it.
Payloads move between the socket and process memory directly (``readv``/``writev``
on the blocks' addresses), with no intermediate copy.
"""

from __future__ import annotations

import socket
import struct

import numpy as np
import numpy.typing as npt

from kvbeam.transport.core import blocks_helper
from kvbeam.transport.tcp import iov

HEADER = struct.Struct("<BBHIQQ")  # kind, flags, reserved, transfer_id, addr, length

HELLO = 1  # sender -> receiver: payload = the token of the receiver's link
# 2: reserved (never reuse the number)
END = 3  # sender -> receiver: transfer ``transfer_id`` is complete; flags & NOTIFY
ACK = 4  # receiver -> sender: every byte of ``transfer_id`` landed
NAK = 5  # receiver -> sender: ``transfer_id`` was refused; payload = "STATUS detail"
WRITEV = 6  # sender -> receiver: ``length`` (addr, length) pairs, then their payloads

FLAG_NOTIFY = 1
#: The longest NAK text a sender reads (a receiver's is one line).
MAX_NAK = 1 << 16

_CHUNK = 4 << 20  # per send call, so a timeout means "no progress", not "too big"
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


def fill(sock: socket.socket, buf: bytearray, at: int) -> int:
    """Read into ``buf[at:]`` what a non-blocking socket holds now; the new fill level
    (``len(buf)``: full). Raises EOFError when the peer closed the connection."""
    view = memoryview(buf)
    while at < len(buf):
        try:
            n = sock.recv_into(view[at:])
        except (BlockingIOError, InterruptedError):
            return at
        if n == 0:
            raise EOFError(f"peer closed the connection ({at}/{len(buf)} bytes of a frame)")
        at += n
    return at


def transfer_stream(transfer_id: int, src: npt.NDArray[np.uint64], dst: npt.NDArray[np.uint64],
                    lengths: npt.NDArray[np.uint64], notify: bool) -> iov.Vectors:
    """A whole transfer as one outgoing stream: its blocks as WRITEV frames of at most
    :data:`MAX_VEC` blocks (payloads read in place), then its END frame.

    One ``writev`` sends a small transfer whole, END included; the headers live in one
    buffer the stream keeps. Laid out by the compiled blocks helper where it is in use
    (transport/_blocks.c), else here with numpy: the same bytes.
    """
    helper = blocks_helper()
    if helper is not None:
        rows, heads, total = helper.stream(transfer_id, notify, src, dst, lengths, MAX_VEC)
        return iov.Vectors.from_iov(rows, total, keep=heads)
    n = len(src)
    frames = [(lo, min(lo + MAX_VEC, n)) for lo in range(0, n, MAX_VEC)]
    heads = np.empty(HEADER.size * (len(frames) + 1) + 16 * n, dtype=np.uint8)
    base = heads.ctypes.data
    addrs = np.empty(n + len(frames) + 1, dtype=np.uint64)
    sizes = np.empty(n + len(frames) + 1, dtype=np.uint64)
    at = row = 0  # a byte offset in heads; a row of the stream
    for lo, hi in frames:
        k = hi - lo
        HEADER.pack_into(heads.data, at, WRITEV, 0, 0, 0, 0, k)
        desc = heads[at + HEADER.size:at + HEADER.size + 16 * k].view(_DESC).reshape(k, 2)
        desc[:, 0] = dst[lo:hi]
        desc[:, 1] = lengths[lo:hi]
        addrs[row], sizes[row] = base + at, HEADER.size + 16 * k
        addrs[row + 1:row + 1 + k] = src[lo:hi]
        sizes[row + 1:row + 1 + k] = lengths[lo:hi]
        at += HEADER.size + 16 * k
        row += 1 + k
    HEADER.pack_into(heads.data, at, END, FLAG_NOTIFY if notify else 0, 0, transfer_id, 0, 0)
    addrs[row], sizes[row] = base + at, HEADER.size
    return iov.Vectors(addrs, sizes, keep=heads)
