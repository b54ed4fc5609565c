"""The TCP transport's wire format and the socket I/O that reads and writes raw memory.

Every frame starts with one fixed header; WRITE, HELLO and NAK frames carry
``length`` payload bytes after it. Payloads move between the socket and process
memory directly (ctypes views of the addresses), with no intermediate copy.
"""

from __future__ import annotations

import ctypes
import socket
import struct

HEADER = struct.Struct("<BBHIQQ")  # kind, flags, reserved, transfer_id, addr, length

HELLO = 1  # sender -> receiver: payload = the token of the receiver's link
WRITE = 2  # sender -> receiver: write ``length`` bytes of payload at ``addr``
END = 3  # sender -> receiver: transfer ``transfer_id`` is complete; flags & NOTIFY
ACK = 4  # receiver -> sender: every byte of ``transfer_id`` landed
NAK = 5  # receiver -> sender: ``transfer_id`` was refused; payload = "STATUS detail"

FLAG_NOTIFY = 1

_CHUNK = 4 << 20  # per send/recv call, so a timeout means "no progress", not "too big"


def frame(kind: int, transfer_id: int = 0, addr: int = 0, length: int = 0, flags: int = 0) -> bytes:
    """One header."""
    return HEADER.pack(kind, flags, 0, transfer_id, addr, length)


def view(addr: int, length: int) -> memoryview:
    """A byte view of ``length`` bytes of this process's memory at ``addr`` (no copy)."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """Send everything; each call may wait up to the socket timeout for progress."""
    mv = memoryview(data).cast("B")
    off = 0
    while off < len(mv):
        off += sock.send(mv[off:off + _CHUNK])


def send_write(sock: socket.socket, addr: int, dst: int, length: int) -> None:
    """A WRITE frame whose payload is read straight from local memory at ``addr``."""
    header = frame(WRITE, 0, dst, length)
    payload = view(addr, length)
    sent = sock.sendmsg([header, payload[:_CHUNK]])  # header and first chunk in one syscall
    if sent < len(header):
        send_all(sock, header[sent:])
        sent = len(header)
    send_all(sock, payload[sent - len(header):])


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
