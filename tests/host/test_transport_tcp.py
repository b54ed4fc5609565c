"""The TCP transport end to end: this process writes, a spawned peer process receives."""

from __future__ import annotations

import logging
import mmap
import os
import resource
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbeam.errors import RegionError, TransportError
from kvbeam.server.faults import skip_remote_check
from kvbeam.transport import Access, Blocks, Event, EventKind, Region, open_transport
from kvbeam.transport import status as st
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.tcp import TcpLink, TcpTransport
from tests.transport_helpers import FILL, N, expected_after, plan
from tests.transport_peer import PeerConfig, PeerProcess, buffer_address

OPTIONS = TransportOptions(slice_bytes=100_000, op_timeout_s=2.0)


@pytest.fixture
def source() -> Iterator[tuple[mmap.mmap, int]]:
    buf = mmap.mmap(-1, N)
    buf.write(np.random.default_rng(3).integers(0, 256, N, dtype=np.uint8).tobytes())
    yield buf, buffer_address(buf)
    buf.close()


@pytest.fixture
def pair(source: tuple[mmap.mmap, int]) -> Iterator[tuple[TcpTransport, TcpLink, PeerProcess]]:
    """A TCP transport here (LOCAL source) linked to a peer process (REMOTE_WRITE buffer)."""
    peer = PeerProcess(PeerConfig("tcp", N, Access.REMOTE_WRITE, fill=FILL, options=OPTIONS))
    transport = TcpTransport(options=OPTIONS)
    transport.register([Region(source[1], N)], Access.LOCAL)
    link = transport.create_link()
    peer.connect(link.endpoint)
    link.connect(peer.endpoint)
    yield transport, link, peer
    transport.close()
    peer.close()


def wait_events(transport: TcpTransport, count: int, timeout: float) -> list[Event]:
    events: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(events) < count and time.monotonic() < deadline:
        events += transport.events(deadline - time.monotonic())
    return events


def test_multi_block_write_lands_exactly(pair: tuple[TcpTransport, TcpLink, PeerProcess],
                                        source: tuple[mmap.mmap, int]) -> None:
    transport, link, peer = pair
    # Scattered, out of order, some longer than slice_bytes, one zero-length.
    rows = [(0, 3 << 20, 300_000), (1 << 20, 7, 4096), (2 << 20, 1 << 20, 1), (5000, 999_999, 0),
            (3 << 20, 2 << 20, 1 << 20)]
    link.write(41, plan(source[1], peer.addr, rows))
    events = wait_events(transport, 1, 10)
    assert events == [Event(EventKind.COMPLETED, link.id, 41, True, st.OK)]
    notes = peer.events(1, 10)
    assert [(e.kind, e.transfer_id, e.ok) for e in notes] == [(EventKind.NOTIFIED, 41, True)]
    got = np.frombuffer(peer.read(), dtype=np.uint8)
    assert np.array_equal(got, expected_after(source[0], rows))


def test_notify_false_and_empty_transfers(pair: tuple[TcpTransport, TcpLink, PeerProcess],
                                          source: tuple[mmap.mmap, int]) -> None:
    transport, link, peer = pair
    link.write(1, plan(source[1], peer.addr, [(0, 0, 100)]), notify=False)
    link.write(2, Blocks.empty(), notify=True)
    link.write(3, Blocks.empty(), notify=False)
    events = wait_events(transport, 3, 10)
    assert sorted(e.transfer_id or 0 for e in events if e.ok) == [1, 2, 3]
    notes = peer.events(2, 3)
    assert [e.transfer_id for e in notes] == [2]  # only the notify=True transfer


def test_out_of_region_block_raises_and_writes_nothing(
        pair: tuple[TcpTransport, TcpLink, PeerProcess], source: tuple[mmap.mmap, int]) -> None:
    transport, link, peer = pair
    good = (0, 0, 4096)
    for bad in [(0, N - 10, 11), (N - 10, 0, 11), (0, N, 1)]:
        with pytest.raises(RegionError, match="nothing was posted"):
            link.write(5, plan(source[1], peer.addr, [good, bad]))
    with pytest.raises(RegionError):  # below the region
        link.write(5, Blocks(np.array([source[1]], np.uint64),
                             np.array([peer.addr - 1], np.uint64), np.array([2], np.uint64)))
    assert transport.events(0.3) == []
    assert peer.read() == bytes([FILL]) * N
    link.write(6, plan(source[1], peer.addr, [good]))  # the link is still fine
    assert [e.ok for e in wait_events(transport, 1, 10)] == [True]


def test_receiver_refuses_what_the_sender_did_not_check(
        pair: tuple[TcpTransport, TcpLink, PeerProcess], source: tuple[mmap.mmap, int]) -> None:
    transport, link, peer = pair
    skip_remote_check(link)
    link.write(9, plan(source[1], peer.addr, [(0, N - 100, 200)]))
    events = wait_events(transport, 1, 10)
    assert [(e.transfer_id, e.ok, e.status) for e in events] == [
        (9, False, st.TCP_REMOTE_ACCESS_ERR)]
    error = events[0].error()
    assert error is not None and "outside every remote-writable region" in str(error)
    peer_events = peer.events(1, 10)
    assert [(e.kind, e.status) for e in peer_events] == [
        (EventKind.LINK_FAILED, st.TCP_REMOTE_ACCESS_ERR)]
    assert peer.read() == bytes([FILL]) * N
    with pytest.raises(TransportError, match="create a new link") as exc:
        link.write(10, Blocks.empty())
    assert exc.value.status == st.TCP_REMOTE_ACCESS_ERR


def test_peer_killed_fails_transfers_within_deadline(
        pair: tuple[TcpTransport, TcpLink, PeerProcess], source: tuple[mmap.mmap, int]) -> None:
    transport, link, peer = pair
    whole = plan(source[1], peer.addr, [(0, 0, N)])
    for i in range(50):
        link.write(100 + i, whole)
    peer.kill()
    events = wait_events(transport, 50, OPTIONS.op_timeout_s + 5)
    failed = [e for e in events if not e.ok]
    assert failed, events
    # Failed by the lost connection, at once: the operation timeout would say TIMEOUT
    # ("no acknowledgement within 2 s").
    assert {e.status for e in failed} == {st.TCP_CONNECTION_LOST}, failed
    assert len(events) == 50  # every transfer got exactly one outcome
    with pytest.raises(TransportError) as exc:
        link.write(200, whole)
    assert exc.value.status == st.TCP_CONNECTION_LOST


def test_stalled_peer_times_out(pair: tuple[TcpTransport, TcpLink, PeerProcess],
                                source: tuple[mmap.mmap, int]) -> None:
    transport, link, peer = pair
    assert peer.process.pid is not None
    os.kill(peer.process.pid, signal.SIGSTOP)  # alive, connected, never answers
    try:
        link.write(7, plan(source[1], peer.addr, [(0, 0, N)]))
        events = wait_events(transport, 1, OPTIONS.op_timeout_s * 3 + 5)
        assert [(e.transfer_id, e.ok, e.status) for e in events] == [(7, False, st.TIMEOUT)]
        # The configured operation timeout ended it, not another, longer one.
        error = events[0].error()
        assert error is not None and "no acknowledgement within 2 s" in str(error), error
    finally:
        os.kill(peer.process.pid, signal.SIGCONT)


def test_link_can_be_recreated_after_failure(pair: tuple[TcpTransport, TcpLink, PeerProcess],
                                             source: tuple[mmap.mmap, int]) -> None:
    transport, link, peer = pair
    skip_remote_check(link)
    link.write(1, plan(source[1], peer.addr, [(0, N, 1)]))
    assert [e.ok for e in wait_events(transport, 1, 10)] == [False]
    peer.call("clear")
    link.release()
    fresh = transport.create_link()
    peer_endpoint = peer.new_link()
    peer.connect(fresh.endpoint)
    fresh.connect(peer_endpoint)
    fresh.write(2, plan(source[1], peer.addr, [(0, 0, 1000)]))
    assert [(e.link, e.transfer_id, e.ok) for e in wait_events(transport, 1, 10)] == [
        (fresh.id, 2, True)]
    assert [e.transfer_id for e in peer.events(1, 10, EventKind.NOTIFIED)] == [2]


def test_peer_writes_to_us(pair: tuple[TcpTransport, TcpLink, PeerProcess]) -> None:
    """The reverse direction: our REMOTE_WRITE region receives, we get the notification."""
    transport, link, peer = pair
    inbox = mmap.mmap(-1, 1 << 16)
    transport.register([Region(buffer_address(inbox), len(inbox))], Access.REMOTE_WRITE)
    # The peer's link was connected to an endpoint without our new region: reconnect.
    link.release()
    fresh = transport.create_link()
    peer_endpoint = peer.new_link()
    peer.connect(fresh.endpoint)
    fresh.connect(peer_endpoint)
    peer.write(77, [0, 100], [buffer_address(inbox) + 10, buffer_address(inbox) + 5000],
               [50, 60])
    events = wait_events(transport, 1, 10)
    assert [(e.kind, e.link, e.transfer_id) for e in events] == [
        (EventKind.NOTIFIED, fresh.id, 77)]
    assert inbox[10:60] == bytes([FILL]) * 50 and inbox[5000:5060] == bytes([FILL]) * 60
    assert inbox[:10] == bytes(10) and inbox[60:5000] == bytes(4940)
    inbox.close()


def test_write_before_connect_and_after_release(source: tuple[mmap.mmap, int]) -> None:
    with TcpTransport(options=OPTIONS) as transport:
        link = transport.create_link()
        with pytest.raises(TransportError, match="not connected"):
            link.write(1, Blocks.empty())
        link.release()
        with pytest.raises(TransportError):
            link.write(1, Blocks.empty())
        with pytest.raises(TransportError, match="lacks address or token"):
            transport.create_link().connect(link.endpoint.__class__(kind="tcp"))
        with pytest.raises(TransportError, match="'rdma'"):
            transport.create_link().connect(link.endpoint.__class__(kind="rdma"))


def test_idle_transport_does_not_spin(pair: tuple[TcpTransport, TcpLink, PeerProcess]) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.1, f"{cpu:.3f} s of CPU in 1 s idle"


def test_factory_tcp_and_auto_fallback_warn(caplog: pytest.LogCaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBEAM_RDMA_DEVICE", raising=False)
    monkeypatch.setattr("kvbeam.transport.factory.rdma_devices", lambda: [])
    with caplog.at_level(logging.WARNING):
        with open_transport("tcp") as t:
            assert t.kind == "tcp"
        assert "not RDMA" in caplog.text
        caplog.clear()
        with open_transport("auto") as t:
            assert t.kind == "tcp"
        assert "no RDMA device found" in caplog.text
    with pytest.raises(TransportError, match="no RDMA device"):
        open_transport("rdma")
    with pytest.raises(ValueError):
        open_transport("udp")  # type: ignore[arg-type]
