"""The verbs transport on a real (or soft-RoCE) device, between two processes.

This process writes from an mmap buffer; a spawned peer process (kvbeam's
tests/transport_peer.py, no torch) owns the remote-writable buffer. Peer start-up costs ~15 s
under qemu TCG, so one peer serves most tests (re-handshaking with a new link
where a test breaks one) and only the kill test spawns its own.
"""

from __future__ import annotations

import dataclasses
import mmap
import re
import resource
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbeam.errors import RegionError, TransportError
from kvbeam.server.faults import skip_remote_check
from kvbeam.transport import Access, Blocks, Event, EventKind, Region, RemoteRegion
from kvbeam.transport import status as st
from kvbeam.transport.options import TransportOptions
from tests.rdma.conftest import RdmaDevice
from tests.transport_helpers import FILL, N, expected_after, plan
from tests.transport_peer import PeerConfig, PeerProcess, random_source, rdma_peer

pytestmark = pytest.mark.rdma

verbs = pytest.importorskip("kvbeam.transport.verbs")  # a skip here fails (conftest)

# Small slices, a small SQ and frequent signals, so a few MiB exercise slicing,
# chains, selective signalling and waiting for SQ room many times over.
OPTIONS = TransportOptions(slice_bytes=40_000, sq_depth=32, signal_every=8, max_chain=16,
                           op_timeout_s=10.0)


@pytest.fixture(scope="module")
def source() -> Iterator[tuple[mmap.mmap, int]]:
    yield random_source(N, 5)


@pytest.fixture(scope="module")
def peer(rdma_device: RdmaDevice) -> Iterator[PeerProcess]:
    p = rdma_peer(rdma_device.name, rdma_device.gid_index, N, FILL, OPTIONS)
    yield p
    p.close()


class Side:
    """Our transport and a link connected to the peer's (fresh) link."""

    def __init__(self, device: RdmaDevice, source: int, peer: PeerProcess,
                 options: TransportOptions = OPTIONS) -> None:
        self.t = verbs.VerbsTransport(device.name, device.gid_index, options)
        self.t.register([Region(source, N)], Access.LOCAL)
        self.link = self.t.create_link()
        self.peer = peer
        peer.call("fill", 0, bytes([FILL]) * N)
        peer.call("clear")
        peer_endpoint = peer.new_link()
        peer.connect(self.link.endpoint)
        self.link.connect(peer_endpoint)

    def events(self, count: int, timeout: float) -> list[Event]:
        out: list[Event] = []
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            out += self.t.events(deadline - time.monotonic())
        return out

    def close(self) -> None:
        self.t.close()


@pytest.fixture
def side(rdma_device: RdmaDevice, source: tuple[mmap.mmap, int],
         peer: PeerProcess) -> Iterator[Side]:
    s = Side(rdma_device, source[1], peer)
    yield s
    s.close()


def scattered_rows(seed: int, count: int) -> list[tuple[int, int, int]]:
    """Non-overlapping destination blocks in random order, random sources, sizes 1 B-200 KB."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 200_000, count)
    gaps = rng.integers(0, 3000, count)
    starts = np.cumsum(gaps + sizes) - sizes
    assert starts[-1] + sizes[-1] <= N
    order = rng.permutation(count)
    return [(int(rng.integers(0, N - sizes[i])), int(starts[i]), int(sizes[i])) for i in order]


@pytest.mark.parametrize("poster", ["compiled", "pyverbs"])
def test_multi_block_plan_lands_exactly(rdma_device: RdmaDevice, source: tuple[mmap.mmap, int],
                                        peer: PeerProcess, poster: str) -> None:
    s = Side(rdma_device, source[1], peer, dataclasses.replace(OPTIONS, poster=poster))
    try:
        assert s.t.poster == poster
        rows = scattered_rows(1, 30)  # ~3 MB: ~90 slices of 40 KB, SQ of 32, signal every 8
        s.link.write(0xC0DE0001, plan(source[1], peer.addr, rows))
        events = s.events(1, 60)
        assert events == [Event(EventKind.COMPLETED, s.link.id, 0xC0DE0001, True, st.OK)]
        notes = peer.events(1, 60)
        assert [(e.kind, e.transfer_id) for e in notes] == [(EventKind.NOTIFIED, 0xC0DE0001)]
        got = np.frombuffer(peer.read(), dtype=np.uint8)
        want = expected_after(source[0], rows)
        assert np.array_equal(got, want), f"{int((got != want).sum())} bytes differ"
        stats = s.link.stats
        assert stats.wrs > OPTIONS.sq_depth  # had to wait for SQ room
        assert stats.posts > 1
    finally:
        s.close()


def test_many_transfers_in_order_with_and_without_notify(side: Side,
                                                         source: tuple[mmap.mmap, int]) -> None:
    all_rows = []
    for i in range(12):
        rows = [(i * 300_000, i * 300_000 + 17, 250_000 + i)]
        all_rows += rows
        side.link.write(i, plan(source[1], side.peer.addr, rows), notify=i % 3 != 0)
    side.link.write(100, Blocks.empty(), notify=True)  # a bare marker
    side.link.write(101, Blocks.empty(), notify=False)  # nothing at all
    events = side.events(14, 60)
    assert sorted(e.transfer_id or 0 for e in events) == [*range(12), 100, 101]
    assert all(e.ok and e.kind is EventKind.COMPLETED for e in events)
    done = [e.transfer_id for e in events if e.transfer_id != 101]
    assert done == [*range(12), 100]  # completions in posting order
    notes = side.peer.events(9, 60)
    assert [e.transfer_id for e in notes] == [i for i in range(12) if i % 3] + [100]
    got = np.frombuffer(side.peer.read(), dtype=np.uint8)
    assert np.array_equal(got, expected_after(source[0], all_rows))


def test_out_of_bounds_plan_is_refused_before_posting(side: Side,
                                                      source: tuple[mmap.mmap, int]) -> None:
    good = [(0, 0, 4096)] * 5
    for bad in [(0, N - 10, 11), (N - 10, 0, 11), (0, N, 1), (0, 1 << 40, 1)]:
        with pytest.raises(RegionError, match="nothing was posted"):
            side.link.write(5, plan(source[1], side.peer.addr, [*good, bad]))
    assert side.link.stats.wrs == 0
    assert side.t.events(0.5) == []
    assert side.peer.read() == bytes([FILL]) * N
    side.link.write(6, plan(source[1], side.peer.addr, good[:1]))  # still usable
    assert [e.ok for e in side.events(1, 30)] == [True]


@pytest.mark.parametrize("fault", ["outside-mr", "bad-rkey"])
def test_bad_remote_write_drives_qp_to_error(rdma_device: RdmaDevice, side: Side,
                                             source: tuple[mmap.mmap, int], fault: str) -> None:
    if fault == "outside-mr":
        skip_remote_check(side.link)  # let the peer's NIC catch it
        side.link.write(9, plan(source[1], side.peer.addr, [(0, N - 100, 200)]))
    else:  # our checks pass, but the rkey we were told is wrong
        side.link.release()
        side.link = side.t.create_link()
        peer_endpoint = side.peer.new_link()
        side.peer.connect(side.link.endpoint)
        region = peer_endpoint.regions[0]
        side.link.connect(dataclasses.replace(peer_endpoint, regions=(
            RemoteRegion(region.addr, region.length, region.rkey ^ 0x00A5_A500),)))
        side.link.write(9, plan(source[1], side.peer.addr, [(0, 0, 200)]))
    events = side.events(1, 30)
    assert [(e.transfer_id, e.ok, e.status) for e in events] == [
        (9, False, "IBV_WC_REM_ACCESS_ERR")]
    error = events[0].error()
    assert isinstance(error, TransportError) and error.status == "IBV_WC_REM_ACCESS_ERR"
    with pytest.raises(TransportError, match="create a new link") as exc:
        side.link.write(10, Blocks.empty())
    assert exc.value.status == "IBV_WC_REM_ACCESS_ERR"
    # The responder's QP went to the error state too: its receive WRs were flushed.
    peer_events = side.peer.events(1, 30, EventKind.LINK_FAILED)
    assert [(e.ok, e.status) for e in peer_events] == [(False, "IBV_WC_WR_FLUSH_ERR")]
    assert side.peer.read() == bytes([FILL]) * N
    # A new handshake gives a working link again.
    fresh = side.t.create_link()
    peer_endpoint = side.peer.new_link()
    side.peer.connect(fresh.endpoint)
    fresh.connect(peer_endpoint)
    fresh.write(11, plan(source[1], side.peer.addr, [(0, 0, 1000)]))
    assert [(e.link, e.transfer_id, e.ok) for e in side.events(1, 30)] == [(fresh.id, 11, True)]
    assert [e.transfer_id for e in side.peer.events(1, 30, EventKind.NOTIFIED)] == [11]


def by_own_deadline(event: Event, options: TransportOptions) -> bool:
    """Whether ``event`` failed by the transport's own deadline as ``options`` configure it
    (transport/verbs/link.py): "no completion within 3 s with 12 WRs outstanding (QP 17
    state IBV_QPS_RTS)"."""
    return re.fullmatch(rf"no completion within {re.escape(f'{options.op_timeout_s:g}')} s "
                        r"with [1-9][0-9]* WRs outstanding \(QP [0-9]+ state \S+\)",
                        event.detail) is not None


def test_own_deadline_fires_when_the_nic_would_wait(rdma_device: RdmaDevice,
                                                    source: tuple[mmap.mmap, int],
                                                    peer: PeerProcess) -> None:
    # The peer destroys its QP; our NIC's own retry would take ~8 x 4.3 s (timeout 20,
    # retry_cnt 7): the transport's deadline must fail the transfer first.
    options = TransportOptions(op_timeout_s=3.0, qp_timeout=20, retry_cnt=7)
    s = Side(rdma_device, source[1], peer, options)
    try:
        peer.call("release_link")
        s.link.write(1, plan(source[1], peer.addr, [(0, 0, N)]))
        events = s.events(1, 30)
        assert [(e.transfer_id, e.ok) for e in events] == [(1, False)]
        # Our own deadline ended it (its status: TIMEOUT, or the QP state it found), and
        # its detail names the configured seconds with the WRs still outstanding: not
        # the NIC's retries running out (IBV_WC_RETRY_EXC_ERR, a send completion error).
        assert events[0].status in (st.TIMEOUT, "IBV_QPS_ERR"), events
        assert by_own_deadline(events[0], options), events
    finally:
        s.close()


def test_peer_killed_mid_transfer(rdma_device: RdmaDevice, source: tuple[mmap.mmap, int]) -> None:
    options = TransportOptions(op_timeout_s=5.0)
    victim = PeerProcess(PeerConfig("rdma", N, Access.REMOTE_WRITE, fill=FILL,
                                    device=rdma_device.name, gid_index=rdma_device.gid_index,
                                    options=options))
    t = verbs.VerbsTransport(rdma_device.name, rdma_device.gid_index, options)
    try:
        t.register([Region(source[1], N)], Access.LOCAL)
        link = t.create_link()
        victim.connect(link.endpoint)
        link.connect(victim.endpoint)
        whole = plan(source[1], victim.addr, [(0, 0, N)])
        for i in range(30):
            link.write(i, whole)
        victim.kill()
        killed = time.monotonic()
        events: list[Event] = []
        while len(events) < 30 and time.monotonic() - killed < 60:  # a wait, not a bound
            events += t.events(1.0)
        assert len(events) == 30  # every transfer got exactly one outcome
        failed = [e for e in events if not e.ok]
        assert failed
        # Each failure is the device's word (a work completion's status: the dead peer's
        # refusal, the NIC's retries, a WR flushed behind them) or our own deadline's,
        # naming its configured seconds: none waited for anything else.
        for e in failed:
            assert by_own_deadline(e, options) or (
                e.status.startswith("IBV_WC_") and "completion error" in e.detail), e
        status = failed[0].status
        # REM_ACCESS_ERR: the killed peer's memory windows go before its QPs (a link
        # creates its QPs first: transport/verbs), so a write in flight can find its
        # window revoked before the QP is gone.
        assert status in ("IBV_WC_RETRY_EXC_ERR", st.TIMEOUT, "IBV_QPS_ERR",
                          "IBV_WC_REM_ACCESS_ERR"), failed[0]
        with pytest.raises(TransportError) as exc:
            link.write(99, whole)
        assert exc.value.status == status
    finally:
        t.close()
        victim.close()


def test_idle_transport_does_not_spin(side: Side) -> None:
    time.sleep(0.5)
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(2.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.2, f"{cpu:.3f} s of CPU in 2 s idle"  # generous: TCG is 16-40x slower
