"""Both WR posters on a real (or soft-RoCE) device: the same requests land the same bytes.

The compiled poster (transport/verbs/_post.c, built in place by setup.py) and the pyverbs
fallback each move the same requests (scattered blocks of 1 B to 60 KB, sliced, several
chains per request, selective signalling, a marker each) into a fresh FILL buffer of the
peer process; the landed buffers must be identical, equal to what the blocks say, with
the same per-block XXH3-128 digests (kvbeam's integrity digest) as the source. A bad
descriptor handed to the compiled poster with a live QP is refused before ibv_post_send.
"""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xxhash

from kvbeam.transport import Access, Event, EventKind, Region
from kvbeam.transport import status as st
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.verbs import chain
from tests.rdma.conftest import RdmaDevice
from tests.transport_helpers import FILL, N, expected_after, plan
from tests.transport_peer import PeerProcess, random_source, rdma_peer

pytestmark = pytest.mark.rdma

verbs = pytest.importorskip("kvbeam.transport.verbs")  # a skip here fails (conftest)

# Small slices, a small SQ, short chains and frequent signals: each request is many posts.
OPTIONS = TransportOptions(slice_bytes=16_000, sq_depth=32, signal_every=8, max_chain=16,
                           op_timeout_s=30.0)
REQUESTS = 3


@pytest.fixture(scope="module")
def source() -> Iterator[tuple[mmap.mmap, int]]:
    yield random_source(N, 24)


@pytest.fixture(scope="module")
def peer(rdma_device: RdmaDevice) -> Iterator[PeerProcess]:
    p = rdma_peer(rdma_device.name, rdma_device.gid_index, N, FILL, OPTIONS)
    yield p
    p.close()


def request_rows(seed: int) -> list[list[tuple[int, int, int]]]:
    """REQUESTS requests of (source offset, destination offset, length) rows: each request's
    destinations in its own third of the buffer, in random order, sizes 1 B to 60 KB."""
    rng = np.random.default_rng(seed)
    span = N // REQUESTS
    out = []
    for r in range(REQUESTS):
        rows, at = [], r * span
        while True:
            size, gap = int(rng.integers(1, 60_000)), int(rng.integers(0, 2000))
            if at + gap + size > (r + 1) * span:
                break
            rows.append((int(rng.integers(0, N - size)), at + gap, size))
            at += gap + size
        out.append([rows[i] for i in rng.permutation(len(rows))])
    return out


class Mover:
    """A transport with the given poster, linked to the peer's fresh link."""

    def __init__(self, device: RdmaDevice, source: int, peer: PeerProcess, poster: str) -> None:
        self.t = verbs.VerbsTransport(device.name, device.gid_index,
                                      dataclasses.replace(OPTIONS, poster=poster))
        self.t.register([Region(source, N)], Access.LOCAL)
        self.link = self.t.create_link()
        self.peer = peer
        peer.call("fill", 0, bytes([FILL]) * N)
        peer.call("clear")
        peer_endpoint = peer.new_link()
        peer.connect(self.link.endpoint)
        self.link.connect(peer_endpoint)

    def completions(self, count: int, timeout: float) -> list[Event]:
        out: list[Event] = []
        while len(out) < count:
            got = self.t.events(timeout)
            assert got, f"{len(out)} of {count} completions after {timeout} s"
            out += got
        return out

    def move(self, source: int, requests: list[list[tuple[int, int, int]]]) -> bytes:
        """Write each request (with its marker); the peer's buffer once all are notified."""
        for i, rows in enumerate(requests):
            self.link.write(0xB0 + i, plan(source, self.peer.addr, rows), notify=True)
        events = self.completions(len(requests), 120)
        assert events == [Event(EventKind.COMPLETED, self.link.id, 0xB0 + i, True, st.OK)
                          for i in range(len(requests))]
        notes = self.peer.events(len(requests), 120)
        assert [(e.kind, e.transfer_id) for e in notes] == [
            (EventKind.NOTIFIED, 0xB0 + i) for i in range(len(requests))]
        return self.peer.read()

    def close(self) -> None:
        self.t.close()


def block_digests(buf: bytes, rows: list[tuple[int, int, int]], side: str) -> list[int]:
    """XXH3-128 of each block's bytes: at its destination (side "dst") or its source."""
    view = memoryview(buf)
    return [xxhash.xxh3_128_intdigest(view[do if side == "dst" else so:][:n])
            for so, do, n in rows]


def test_both_posters_land_the_same_bytes(rdma_device: RdmaDevice,
                                          source: tuple[mmap.mmap, int],
                                          peer: PeerProcess) -> None:
    requests = request_rows(7)
    rows = [row for request in requests for row in request]
    assert len(rows) > 100  # ~125 blocks, ~250 slices: many chains of at most max_chain WRs
    landed: dict[str, bytes] = {}
    posts: dict[str, tuple[int, int]] = {}
    for poster in ("compiled", "pyverbs"):
        m = Mover(rdma_device, source[1], peer, poster)
        try:
            assert m.t.poster == poster
            landed[poster] = m.move(source[1], requests)
            posts[poster] = (m.link.stats.posts, m.link.stats.wrs)
        finally:
            m.close()
    want = expected_after(source[0], rows)
    for poster, got in landed.items():
        diff = int((np.frombuffer(got, np.uint8) != want).sum())
        assert diff == 0, f"{poster}: {diff} bytes differ from what the blocks say"
    assert landed["compiled"] == landed["pyverbs"]
    src_digests = block_digests(bytes(source[0]), rows, "src")
    assert block_digests(landed["compiled"], rows, "dst") == src_digests
    assert block_digests(landed["pyverbs"], rows, "dst") == src_digests
    assert xxhash.xxh3_128_intdigest(landed["compiled"]) == xxhash.xxh3_128_intdigest(
        landed["pyverbs"])
    # The same WRs in the same chains: both posted every slice and marker, in as many posts.
    assert posts["compiled"] == posts["pyverbs"]
    assert posts["compiled"][1] > len(rows) + REQUESTS and posts["compiled"][0] > 20


#: (field, value) of a descriptor no kvbeam chain holds: SEND, RDMA READ, INLINE (the provider
#: would copy from the address itself), FENCE, a data WR without its SGE, an empty SGE.
BAD = [("opcode", 2), ("opcode", 4), ("send_flags", 8), ("send_flags", 1), ("num_sge", 0),
       ("length", 0)]


def test_a_bad_descriptor_is_never_posted_on_a_live_qp(
        rdma_device: RdmaDevice, source: tuple[mmap.mmap, int], peer: PeerProcess) -> None:
    from kvbeam.transport.core import prepare

    m = Mover(rdma_device, source[1], peer, "compiled")
    try:
        helper, why = chain.compiled_helper()
        assert helper is not None, why
        link: Any = m.link
        qp = link._qps[0].qp  # the lane's pyverbs QP (the link exposes it to tests)
        helper.qp_ready(qp)  # the real QP is recognised: its layout, qp_num and PD
        p = prepare(1, plan(source[1], peer.addr, [(0, 0, 4096), (8192, 8192, 4096)]), False,
                    OPTIONS.slice_bytes, link._t.local_keys(), link._usable_peer())
        batch = chain.build(p, 1, 64, link._marker)
        for field, value in BAD:
            descs = batch.descs.copy()
            descs[field][0] = value
            with pytest.raises(ValueError, match=r"WR descriptor 0: .*nothing was posted"):
                helper.post(qp, descs, 0, len(descs))
        with pytest.raises(ValueError, match=r"WRs \[0, 9\) of 2 descriptors"):
            helper.post(qp, batch.descs, 0, 9)
        assert peer.read() == bytes([FILL]) * N  # nothing landed
        assert m.t.events(0.5) == []  # and nothing completed
        # The link is untouched: a real write through it still lands.
        landed = m.move(source[1], [[(100, 200, 5000)]])
        assert landed[200:5200] == bytes(source[0][100:5100])
    finally:
        m.close()
