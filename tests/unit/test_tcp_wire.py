"""The TCP wire's WRITEV frames: exact landing, partial sends, refusals (an oversized frame,
a block outside the regions), the retired WRITE."""

from __future__ import annotations

import ctypes
import logging
import mmap
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbeam.server.faults import skip_remote_check
from kvbeam.transport import Access, Blocks, Event, EventKind, Region, core
from kvbeam.transport import status as st
from kvbeam.transport.tcp import TcpLink, TcpTransport, iov, wire
from kvbeam.transport.tcp.link import INLINE_SEND_BYTES
from tests import tcp_blocking

SIZE = 8 << 20


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def blocks_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test on both paths: the compiled blocks helper's and numpy's (where the
    helper was not built)."""
    monkeypatch.setattr(core, "COMPILED", request.param == "compiled")


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


def _receive(sock: socket.socket, blocks: int) -> tuple[int, tuple[int, ...] | None]:
    """Read WRITEV frames until ``blocks`` blocks landed, then the END: (frames, END)."""
    frames = got = 0
    while got < blocks:
        header = tcp_blocking.recv_header(sock)
        assert header is not None and header[0] == wire.WRITEV
        addrs, lengths = tcp_blocking.recv_descs(sock, header[4])
        tcp_blocking.transfer(sock, addrs, lengths, reading=True)
        got += header[4]
        frames += 1
    return frames, tcp_blocking.recv_header(sock)


def test_a_transfer_stream_lands_every_block_through_partial_sends(
        bufs: tuple[mmap.mmap, mmap.mmap]) -> None:
    """One stream: WRITEV frames of at most MAX_VEC blocks, then END; the socket takes a
    few KB per call, so every call is partial: each ``move`` stops where the socket is
    full and the next resumes there (what a link's writer and the data plane's thread
    do). The frames are read here one by one (:mod:`tests.tcp_blocking`) to count them."""
    src, dst = bufs
    blocks = _scattered(np.random.default_rng(1), 2 * wire.MAX_VEC + 7, _addr(src), _addr(dst))
    a, b = socket.socketpair()
    for s in (a, b):  # like a link's socket: non-blocking underneath, so calls may be partial
        s.settimeout(5.0)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    stream = wire.transfer_stream(77, blocks.src, blocks.dst, blocks.lengths, notify=True)
    calls: list[int] = []
    moves: list[bool] = []

    def send() -> None:
        while not stream.move(a, reading=False, progress=lambda: calls.append(1)):
            moves.append(False)
            time.sleep(0.001)
        moves.append(True)

    sender = threading.Thread(target=send)
    sender.start()
    frames, end = _receive(b, len(blocks))
    sender.join(10)
    assert frames == 3  # MAX_VEC blocks per frame at most
    assert end is not None and end[:3] == (wire.END, wire.FLAG_NOTIFY, 77)
    assert len(calls) > frames  # partial sends continued where they stopped
    assert moves[-1] and len(moves) > 2
    assert stream.done == stream.total
    assert dst[:] == _expected(src, blocks, _addr(dst))
    a.close()
    b.close()


def test_an_idle_links_writer_sends_a_small_transfer_itself(
        pair: tuple[TcpTransport, TcpTransport, TcpLink],
        bufs: tuple[mmap.mmap, mmap.mmap], monkeypatch: pytest.MonkeyPatch) -> None:
    """No hand-off to the data plane's thread for a transfer the socket takes at once: the
    writing thread sent it whole (END included) before write() returned."""
    a, _b, link = pair
    src, dst = bufs
    blocks = _scattered(np.random.default_rng(3), 40, _addr(src), _addr(dst))
    movers: list[tuple[str, bool]] = []
    real = iov.Vectors.move

    def move(self: iov.Vectors, *args: Any, **kw: Any) -> bool:
        done = real(self, *args, **kw)
        if not kw["reading"]:  # the receiving side's moves (same process) may come first
            movers.append((threading.current_thread().name, done))
        return done

    monkeypatch.setattr(iov.Vectors, "move", move)
    link.write(5, blocks)
    assert movers == [(threading.current_thread().name, True)]
    with link._lock:
        assert not link._pending and not link._streaming  # nothing left for the data plane's thread
    done = _completion(a)
    assert (done.transfer_id, done.ok) == (5, True)
    assert dst[:] == _expected(src, blocks, _addr(dst))


def test_a_large_transfer_goes_to_the_data_plane_thread(
        pair: tuple[TcpTransport, TcpTransport, TcpLink],
        bufs: tuple[mmap.mmap, mmap.mmap], monkeypatch: pytest.MonkeyPatch) -> None:
    """Over INLINE_SEND_BYTES the writer only queues: a loopback socket keeps taking bytes
    as its reader drains them, so the writer's thread would copy the whole transfer."""
    a, _b, link = pair
    src, dst = bufs
    movers: list[str] = []
    real = iov.Vectors.move

    def move(self: iov.Vectors, *args: Any, **kw: Any) -> bool:
        if not kw["reading"]:  # the receiver reads through Vectors too
            movers.append(threading.current_thread().name)
        return real(self, *args, **kw)

    monkeypatch.setattr(iov.Vectors, "move", move)
    n = INLINE_SEND_BYTES + 4096
    link.write(6, Blocks(np.array([_addr(src)], dtype=np.uint64),
                         np.array([_addr(dst)], dtype=np.uint64),
                         np.array([n], dtype=np.uint64)))
    done = _completion(a)
    assert (done.transfer_id, done.ok) == (6, True)
    assert movers and threading.current_thread().name not in movers
    assert set(movers) == {"kvbeam-tcp"}, movers  # the transport's one thread
    assert dst[:n] == src[:n]


def test_writes_behind_a_full_socket_queue_in_order(
        pair: tuple[TcpTransport, TcpTransport, TcpLink],
        bufs: tuple[mmap.mmap, mmap.mmap]) -> None:
    """Transfers written while one streams wait their turn, none interleaved: every one
    completes, in order, each block where it belongs."""
    a, _b, link = pair
    src, dst = bufs
    rng = np.random.default_rng(4)
    half = SIZE // 2
    big = Blocks(np.array([_addr(src)], dtype=np.uint64),
                 np.array([_addr(dst)], dtype=np.uint64), np.array([half], dtype=np.uint64))
    link.write(1, big)  # 4 MiB: more than the socket takes at once
    small = []
    for tid in range(2, 8):
        off = half + (tid - 2) * 4096
        small.append(Blocks(np.array([_addr(src) + off], dtype=np.uint64),
                            np.array([_addr(dst) + off], dtype=np.uint64),
                            np.array([int(rng.integers(1, 4096))], dtype=np.uint64)))
        link.write(tid, small[-1])
    order: list[tuple[int | None, bool]] = []
    deadline = time.monotonic() + 10
    while len(order) < 7 and time.monotonic() < deadline:
        order += [(e.transfer_id, e.ok) for e in a.events(0.5) if e.kind is EventKind.COMPLETED]
    assert order == [(tid, True) for tid in range(1, 8)]
    assert dst[:half] == src[:half]
    for b in small:
        lo = int(b.src[0]) - _addr(src)
        n = int(b.lengths[0])
        assert dst[lo:lo + n] == src[lo:lo + n]


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


def _own_sending_side(link: TcpLink) -> None:
    """Mark transfer 9 in flight on ``link`` with its stream taken: the test writes the
    frames on its socket itself."""
    with link._lock:
        link._streaming = True
        link._inflight.append(9)


def _assert_transfer_9_lost_and_nothing_landed(a: TcpTransport, b: TcpTransport,
                                               dst: mmap.mmap) -> None:
    """The receiver dropped the connection: transfer 9 failed on ``a``, and nothing of it
    landed in ``dst`` on ``b`` or notified there."""
    done = _completion(a)
    assert (done.transfer_id, done.ok, done.status) == (9, False, st.TCP_CONNECTION_LOST)
    assert dst[100:5100] == bytes(5000)
    assert b.stats().received_bytes == 0
    assert not [e for e in b.events(0.2) if e.kind is EventKind.NOTIFIED]


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


def test_oversized_writev_frame_drops_the_connection_and_fails_the_transfer(
        pair: tuple[TcpTransport, TcpTransport, TcpLink],
        bufs: tuple[mmap.mmap, mmap.mmap], caplog: pytest.LogCaptureFixture) -> None:
    """A WRITEV frame of more than MAX_VEC blocks is a protocol error: the receiver drops
    the connection on its header, before a descriptor, and lands nothing of it."""
    a, b, link = pair
    src, dst = bufs
    sock = link._sock
    assert sock is not None
    caplog.set_level(logging.INFO, logger="kvbeam.transport.tcp.transport")
    _own_sending_side(link)
    # Its first descriptor is a valid block, its payload follows: none of it may land.
    wire.send_all(sock, wire.frame(wire.WRITEV, length=wire.MAX_VEC + 1)
                  + np.array([_addr(dst) + 100, 5000], dtype="<u8").tobytes() + src[10:5010]
                  + wire.frame(wire.END, 9, flags=wire.FLAG_NOTIFY))
    _assert_transfer_9_lost_and_nothing_landed(a, b, dst)
    assert f"WRITEV frame with {wire.MAX_VEC + 1} blocks" in caplog.text


def test_retired_write_frame_drops_the_connection_and_fails_the_transfer(
        pair: tuple[TcpTransport, TcpTransport, TcpLink],
        bufs: tuple[mmap.mmap, mmap.mmap]) -> None:
    """Kind 2, the one-block WRITE frame only protocol 1 and 2 builds sent, lands nothing."""
    a, b, link = pair
    src, dst = bufs
    sock = link._sock
    assert sock is not None
    _own_sending_side(link)
    # One send: the receiver closes on the first header, so a second one could meet a reset.
    wire.send_all(sock, wire.frame(2, 0, _addr(dst) + 100, 5000) + src[10:5010]
                  + wire.frame(wire.END, 9, flags=wire.FLAG_NOTIFY))
    _assert_transfer_9_lost_and_nothing_landed(a, b, dst)
