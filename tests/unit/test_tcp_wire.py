"""The TCP wire's WRITEV frames: exact landing, partial sends, refusals, the retired WRITE."""

from __future__ import annotations

import ctypes
import mmap
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbeam.server.faults import skip_remote_check
from kvbeam.transport import Access, Blocks, Event, EventKind, Region
from kvbeam.transport import status as st
from kvbeam.transport.tcp import TcpLink, TcpTransport, iov, wire

SIZE = 8 << 20


def _addr(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _scattered(rng: np.random.Generator, n: int, src: int, dst: int) -> Blocks:
    """``n`` non-overlapping blocks of 1..3000 bytes in shuffled order."""
    lengths = rng.integers(1, 3000, n).astype(np.uint64)
    offs = np.cumsum(np.concatenate(([0], lengths[:-1] + 64))).astype(np.uint64)
    order = rng.permutation(n)
    shift = np.uint64(SIZE // 2)
    return Blocks(np.uint64(src) + offs[order], np.uint64(dst) + shift - offs[order]
                  - lengths[order], lengths[order])


def _expected(source: mmap.mmap, blocks: Blocks, dst_base: int, n: int | None = None) -> bytes:
    want = bytearray(SIZE)
    for s, d, k in list(zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.lengths.tolist(),
                            strict=True))[:n]:
        s -= _addr(source)
        d -= dst_base
        want[d:d + k] = source[s:s + k]
    return bytes(want)


@pytest.fixture
def bufs() -> Iterator[tuple[mmap.mmap, mmap.mmap]]:
    src, dst = mmap.mmap(-1, SIZE), mmap.mmap(-1, SIZE)
    src.write(np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8).tobytes())
    yield src, dst
    src.close()
    dst.close()


def test_writev_frames_land_every_block_through_partial_sends(
        bufs: tuple[mmap.mmap, mmap.mmap]) -> None:
    src, dst = bufs
    blocks = _scattered(np.random.default_rng(1), 2 * wire.MAX_VEC + 7, _addr(src), _addr(dst))
    a, b = socket.socketpair()
    for s in (a, b):  # like a link's socket: non-blocking underneath, so calls may be partial
        s.settimeout(5.0)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    calls: list[int] = []
    sender = threading.Thread(target=wire.send_writev, args=(
        a, blocks.src, blocks.dst, blocks.lengths, lambda: calls.append(1)))
    sender.start()
    frames = 0
    got = 0
    while got < len(blocks):
        header = wire.recv_header(b)
        assert header is not None and header[0] == wire.WRITEV
        addrs, lengths = wire.recv_descs(b, header[4])
        iov.transfer(b, addrs, lengths, reading=True)
        got += header[4]
        frames += 1
    sender.join(10)
    assert frames == 3  # MAX_VEC blocks per frame at most
    assert len(calls) > frames  # partial sends continued where they stopped
    assert dst[:] == _expected(src, blocks, _addr(dst))
    a.close()
    b.close()


def test_oversized_writev_frame_is_a_protocol_error() -> None:
    a, b = socket.socketpair()
    with pytest.raises(ConnectionError, match="WRITEV frame with"):
        wire.recv_descs(b, wire.MAX_VEC + 1)
    a.close()
    b.close()


@pytest.fixture
def pair(bufs: tuple[mmap.mmap, mmap.mmap]) -> Iterator[tuple[TcpTransport, TcpTransport,
                                                              TcpLink]]:
    src, dst = bufs
    a, b = TcpTransport(), TcpTransport()
    a.register([Region(_addr(src), SIZE)], Access.LOCAL)
    b.register([Region(_addr(dst), SIZE)], Access.REMOTE_WRITE)
    link = a.create_link()
    link.connect(b.create_link().endpoint)
    yield a, b, link
    a.close()
    b.close()


def _completion(t: TcpTransport) -> Event:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done = [e for e in t.events(0.5) if e.kind is EventKind.COMPLETED]
        if done:
            return done[0]
    raise AssertionError("no completion")


def test_refused_block_lands_what_came_before_it_and_naks(
        pair: tuple[TcpTransport, TcpTransport, TcpLink],
        bufs: tuple[mmap.mmap, mmap.mmap]) -> None:
    a, b, link = pair
    src, dst = bufs
    blocks = _scattered(np.random.default_rng(2), 1500, _addr(src), _addr(dst))
    bad = 1200  # in the second frame: the first frame and 1200 - MAX_VEC blocks land
    dsts = blocks.dst.copy()
    dsts[bad] = np.uint64(_addr(dst) + SIZE)  # just past the region
    skip_remote_check(link)  # let the receiver catch it
    link.write(7, Blocks(blocks.src, dsts, blocks.lengths))
    done = _completion(a)
    assert (done.transfer_id, done.ok, done.status) == (7, False, st.TCP_REMOTE_ACCESS_ERR)
    assert f"block at {_addr(dst) + SIZE:#x}" in done.detail
    assert dst[:] == _expected(src, blocks, _addr(dst), bad)
    assert b.stats().received_bytes == int(blocks.lengths[:bad].sum())


def test_retired_write_frame_drops_the_connection_and_fails_the_transfer(
        pair: tuple[TcpTransport, TcpTransport, TcpLink],
        bufs: tuple[mmap.mmap, mmap.mmap]) -> None:
    """Kind 2, the one-block WRITE frame only protocol 1 and 2 builds sent, lands nothing."""
    a, b, link = pair
    src, dst = bufs
    sock = link._sock
    assert sock is not None
    link._queue.put(None)  # stop the sender thread: this test writes the frames itself
    time.sleep(0.1)
    link._inflight.append(9)
    # One send: the receiver closes on the first header, so a second one could meet a reset.
    wire.send_all(sock, wire.frame(2, 0, _addr(dst) + 100, 5000) + src[10:5010]
                  + wire.frame(wire.END, 9, flags=wire.FLAG_NOTIFY))
    done = _completion(a)
    assert (done.transfer_id, done.ok, done.status) == (9, False, st.TCP_CONNECTION_LOST)
    assert dst[100:5100] == bytes(5000)
    assert b.stats().received_bytes == 0
    assert not [e for e in b.events(0.2) if e.kind is EventKind.NOTIFIED]
