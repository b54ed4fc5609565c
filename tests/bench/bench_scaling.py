"""How kvbeam's RDMA cost grows: block size, blocks per request, concurrency, QPs per peer.

Used by :mod:`tests.bench.bench_suite` (``make bench``) inside the soft-RoCE guest.
Every point drives one sender transport for a fixed time and reports bytes/s and
the Python CPU time per block: planning (where the point plans), ``write()``
(bounds checks, keys, WR arrays) and the progress thread's posting bookkeeping.
Wall time inside ``ibv_post_send`` is reported apart (with rxe, the kernel sends
from inside that call, so it is the device's time, not Python's).

QPs per peer: kvbeam has one RC QP per link today, so the points with 2 and 4
QPs use that many links from one sender transport, each to its own receiver
process (one receiver per QP; each gets an equal slice of the same source buffer).
"""

from __future__ import annotations

import itertools
import mmap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvbeam.pools.plan import coalesce
from kvbeam.transport.base import Access, EventKind
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.verbs import VerbsTransport
from kvbeam.transport.verbs.link import VerbsLink
from tests.transport_peer import PeerConfig, PeerProcess, buffer_address

#: A request source: returns the blocks of the next request (planning included).
Planner = Callable[[], Blocks]


def const(blocks: Blocks) -> Planner:
    """A planner that hands out the same blocks every time (no planning cost)."""
    return lambda: blocks


def cycling(plans: list[Blocks]) -> Planner:
    """A planner that hands out ``plans`` in turn."""
    it = itertools.cycle(plans)
    return lambda: next(it)


@dataclass
class Point:
    """One measured point of a scaling curve."""

    x: float
    label: str
    gbps: float
    blocks_per_s: float
    requests_per_s: float
    py_us_per_block: float
    plan_us_per_block: float
    post_us_per_block: float

    def as_dict(self) -> dict[str, Any]:
        """For the JSON file."""
        return asdict(self)


def drive(transport: VerbsTransport, work: list[tuple[VerbsLink, Planner]], inflight: int,
          seconds: float) -> tuple[int, int, int, float, float]:
    """Keep ``inflight`` requests outstanding (round robin over ``work``) for ``seconds``.

    Returns requests done, blocks written, bytes written, elapsed seconds and the
    CPU seconds spent planning (in this thread).
    """
    transport.events(0)
    rr = itertools.cycle(work)
    sent = done = nblocks = nbytes = 0
    plan_s = 0.0
    tid = 0
    sizes: dict[tuple[int, int], tuple[int, int]] = {}
    start = time.perf_counter()
    while True:
        while sent - done < inflight and time.perf_counter() - start < seconds:
            link, plan = next(rr)
            t0 = time.thread_time()
            blocks = plan()
            plan_s += time.thread_time() - t0
            tid = (tid + 1) & 0xFFFF_FFFF
            sizes[(link.id, tid)] = (len(blocks), blocks.total_bytes)
            link.write(tid, blocks, notify=True)
            sent += 1
        if done == sent:
            break
        for event in transport.events(60.0):
            if event.kind is not EventKind.COMPLETED or event.transfer_id is None:
                continue
            if not event.ok:
                raise RuntimeError(f"transfer failed: {event}")
            b, n = sizes.pop((event.link, event.transfer_id))
            nblocks += b
            nbytes += n
            done += 1
    return done, nblocks, nbytes, time.perf_counter() - start, plan_s


class Rig:
    """One sender transport with a source buffer, and receiver processes on demand."""

    def __init__(self, device: str, gid_index: int, nbytes: int,
                 options: TransportOptions) -> None:
        self.device, self.gid_index, self.nbytes, self.options = device, gid_index, nbytes, options
        self.src = mmap.mmap(-1, nbytes)
        self.src.write(np.random.default_rng(11).integers(0, 256, nbytes, np.uint8).tobytes())
        self.src_addr = buffer_address(self.src)
        self.transport = VerbsTransport(device, gid_index, options)
        from kvbeam.transport.endpoint import Region

        self.transport.register([Region(self.src_addr, nbytes)], Access.LOCAL)
        self.peers: list[tuple[PeerProcess, VerbsLink]] = []

    def peers_needed(self, count: int) -> list[tuple[PeerProcess, VerbsLink]]:
        """At least ``count`` connected receivers (each with a buffer of the full size)."""
        while len(self.peers) < count:
            peer = PeerProcess(PeerConfig("rdma", self.nbytes, Access.REMOTE_WRITE,
                                          device=self.device, gid_index=self.gid_index,
                                          options=self.options))
            link = self.transport.create_link()
            peer.connect(link.endpoint)
            link.connect(peer.endpoint)
            self.peers.append((peer, link))
        return self.peers[:count]

    def close(self) -> None:
        """Stop everything."""
        self.transport.close()
        for peer, _ in self.peers:
            peer.close()

    def measure(self, x: float, label: str, work: list[tuple[VerbsLink, Planner]],
                inflight: int, seconds: float) -> Point:
        """Drive ``work`` and turn the link counters into a :class:`Point`."""
        links = {link.id: link for link, _ in work}
        before = {i: (ln.stats.prepare_s + ln.stats.book_s, ln.stats.post_s)
                  for i, ln in links.items()}
        done, nblocks, _nbytes, elapsed, plan_s = drive(self.transport, work, inflight, seconds)
        py_s = sum(ln.stats.prepare_s + ln.stats.book_s - before[i][0] for i, ln in links.items())
        post_s = sum(ln.stats.post_s - before[i][1] for i, ln in links.items())
        per = max(nblocks, 1)
        return Point(x, label, _nbytes * 8 / elapsed / 1e9, nblocks / elapsed, done / elapsed,
                     (py_s + plan_s) / per * 1e6, plan_s / per * 1e6, post_s / per * 1e6)


def contiguous(rig: Rig, peer: PeerProcess, size: int, count: int, base: int = 0) -> Blocks:
    """``count`` blocks of ``size`` bytes at the same offsets on both sides, from ``base``."""
    off = np.uint64(base) + np.arange(count, dtype=np.uint64) * np.uint64(size)
    return Blocks(np.uint64(rig.src_addr) + off, np.uint64(peer.addr) + off,
                  np.full(count, size, np.uint64))


def block_sizes(rig: Rig, sizes: list[int], seconds: float) -> list[Point]:
    """Whole-buffer transfers of ``size`` blocks, two in flight."""
    (peer, link), = rig.peers_needed(1)
    out = []
    for size in sizes:
        blocks = contiguous(rig, peer, size, rig.nbytes // size)
        out.append(rig.measure(size, f"{size >> 10} KiB", [(link, const(blocks))], 2,
                               seconds))
    return out


def blocks_per_request(rig: Rig, counts: list[int], page: int, seconds: float
                       ) -> dict[str, list[Point]]:
    """Requests of ``count`` pages, planned per request from index lists (as the daemons do).

    coalesced: contiguous page indices on both sides (one block per request before
    slicing); uncoalesced: the destination pages reversed, so no two are adjacent
    on both sides and every page is its own block.
    """
    (peer, link), = rig.peers_needed(1)
    out: dict[str, list[Point]] = {"coalesced": [], "uncoalesced": []}
    for count in counts:
        src_idx = np.arange(count, dtype=np.int64)
        for mode in out:
            dst_idx = src_idx if mode == "coalesced" else src_idx[::-1].copy()

            def plan(s: np.ndarray[Any, Any] = src_idx, d: np.ndarray[Any, Any] = dst_idx
                     ) -> Blocks:
                return coalesce(rig.src_addr, peer.addr, page, s, d)

            p = rig.measure(count, mode, [(link, plan)], 2, seconds)
            # per page, not per block: coalesced requests have fewer blocks than pages
            scale = len(plan()) / count
            p.py_us_per_block *= scale
            p.plan_us_per_block *= scale
            p.post_us_per_block *= scale
            p.blocks_per_s /= scale
            out[mode].append(p)
    return out


def concurrency(rig: Rig, levels: list[int], size: int, per_request: int, seconds: float
                ) -> list[Point]:
    """Requests of ``per_request`` blocks of ``size`` bytes, ``level`` of them in flight."""
    (peer, link), = rig.peers_needed(1)
    span = size * per_request
    slots = max(1, rig.nbytes // span)
    out = []
    for level in levels:
        plans = [contiguous(rig, peer, size, per_request, (i % slots) * span)
                 for i in range(level)]
        out.append(rig.measure(level, f"{level} in flight", [(link, cycling(plans))],
                               level, seconds))
    return out


def qps_per_peer(rig: Rig, counts: list[int], size: int, seconds: float) -> list[Point]:
    """``q`` links (one RC QP each), each writing its slice of the buffer, 2 in flight each."""
    out = []
    for q in counts:
        pairs = rig.peers_needed(q)
        span = rig.nbytes // q
        work: list[tuple[VerbsLink, Planner]] = []
        for i, (peer, link) in enumerate(pairs):
            blocks = contiguous(rig, peer, size, span // size, i * span)
            work.append((link, const(blocks)))
        out.append(rig.measure(q, f"{q} QP", work, 2 * q, seconds))
    return out
