"""Several RC QPs per verbs link on a real (or soft-RoCE) device, between two processes.

A spawned peer (tests/transport_peer.py) owns the remote-writable buffer and runs with the
same ``qps_per_peer``. Requests striped over 2 and 4 QPs must land byte for byte, and the
peer must never be notified while one QP's share of a request has not even been posted.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import pytest

from kvbeam.transport import Access, Event, EventKind, Region
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.verbs import VerbsLink, VerbsTransport
from tests.rdma.conftest import RdmaDevice
from tests.transport_helpers import FILL, N, expected_after, plan
from tests.transport_peer import PeerProcess, random_source, rdma_peer
from tests.verbs_fakes import lane_held

pytestmark = pytest.mark.rdma


class Peer(NamedTuple):
    proc: PeerProcess
    qps: int


class Side(NamedTuple):
    t: VerbsTransport
    link: VerbsLink


def options(qps: int) -> TransportOptions:
    return TransportOptions(slice_bytes=256 << 10, sq_depth=64, signal_every=8, max_chain=32,
                            op_timeout_s=20.0, qps_per_peer=qps)


@pytest.fixture(scope="module")
def source() -> Iterator[tuple[mmap.mmap, int]]:
    yield random_source(N, 11)


@pytest.fixture(scope="module", params=[2, 4], ids=["2qps", "4qps"])
def peer(request: pytest.FixtureRequest, rdma_device: RdmaDevice) -> Iterator[Peer]:
    qps = int(request.param)
    p = rdma_peer(rdma_device.name, rdma_device.gid_index, N, FILL, options(qps))
    yield Peer(p, qps)
    p.close()


@pytest.fixture
def side(rdma_device: RdmaDevice, source: tuple[mmap.mmap, int],
         peer: Peer) -> Iterator[Side]:
    t = VerbsTransport(rdma_device.name, rdma_device.gid_index, options(peer.qps))
    try:
        t.register([Region(source[1], N)], Access.LOCAL)
        link = t.create_link()
        peer.proc.call("fill", 0, bytes([FILL]) * N)
        peer.proc.call("clear")
        peer_endpoint = peer.proc.new_link()
        assert len(peer_endpoint.qpns) == len(link.endpoint.qpns) == peer.qps
        peer.proc.connect(link.endpoint)
        link.connect(peer_endpoint)
        yield Side(t, link)
    finally:
        t.close()


def events(t: VerbsTransport, count: int, timeout: float) -> list[Event]:
    out: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        out += t.events(deadline - time.monotonic())
    return out


def test_requests_striped_over_qps_land_exactly(side: Side, peer: Peer,
                                                source: tuple[mmap.mmap, int]) -> None:
    t, link = side
    dst = peer.proc.addr
    big = [(0, 0, 3 << 20)]  # one contiguous 3 MiB run: sliced so every QP gets a share
    chunk1 = [(i * 8192 + 7, (3 << 20) + i * 8192, 4096) for i in range(16)]  # small: one QP
    chunk2 = [(i * 8192 + 99, (3 << 20) + 4096 + i * 8192, 4000) for i in range(16)]
    link.write(1, plan(source[1], dst, big))
    link.write(2, plan(source[1], dst, chunk1), notify=False)
    link.write(2, plan(source[1], dst, chunk2))
    done = events(t, 3, 120)
    assert sorted((e.transfer_id, e.ok) for e in done) == [(1, True), (2, True), (2, True)]
    notes = peer.proc.events(2, 60)
    assert sorted((e.kind, e.transfer_id) for e in notes) == [
        (EventKind.NOTIFIED, 1), (EventKind.NOTIFIED, 2)]
    got = np.frombuffer(peer.proc.read(), dtype=np.uint8)
    assert np.array_equal(got, expected_after(source[0], big + chunk1 + chunk2))
    assert all(lane.seq > 0 for lane in link._lanes)  # every QP carried part of it


def test_never_notified_while_a_share_on_another_qp_is_not_written(
        side: Side, peer: Peer, source: tuple[mmap.mmap, int]) -> None:
    t, link = side
    n, dst, proc = peer.qps, peer.proc.addr, peer.proc
    with lane_held(link, 0):  # QP 0 posts nothing until released
        rows = [(0, 0, N)]
        link.write(7, plan(source[1], dst, rows))
        share = N // n
        expected = expected_after(source[0], rows)
        deadline = time.monotonic() + 60
        got = np.frombuffer(proc.read(), dtype=np.uint8)
        while not np.array_equal(got[share:], expected[share:]) and time.monotonic() < deadline:
            time.sleep(0.5)  # the other QPs' shares land
            got = np.frombuffer(proc.read(), dtype=np.uint8)
        assert np.array_equal(got[share:], expected[share:])
        time.sleep(2.0)  # time enough for a wrongly posted marker to arrive
        assert proc.events(1, 1.0, EventKind.NOTIFIED) == []  # no proof of arrival yet
        assert t.events(0) == []
        got = np.frombuffer(proc.read(0, share), dtype=np.uint8)
        assert (got == FILL).all()  # QP 0's share is not there
    t.wake()
    assert [(e.transfer_id, e.ok) for e in events(t, 1, 60)] == [(7, True)]
    assert [e.transfer_id for e in proc.events(1, 60, EventKind.NOTIFIED)] == [7]
    assert np.array_equal(np.frombuffer(proc.read(), dtype=np.uint8), expected)
