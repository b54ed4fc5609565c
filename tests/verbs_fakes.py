"""A fake verbs layer for unit tests of :class:`VerbsLink`: QPs that complete in order
(as RC does), a poster and a host, so posting and retiring run exactly as on a NIC; and
:func:`lane_held`, which stops one lane of a real or fake link from posting."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, cast

import numpy as np

from kvbeam.transport.base import Event
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.endpoint import Endpoint, RemoteRegion
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.regions import RegionTable
from kvbeam.transport.stats import TransferMeter
from kvbeam.transport.verbs.chain import WrBatch
from kvbeam.transport.verbs.link import VerbsLink

U64 = np.uint64


class FakeQP:
    """Completes signalled WRs in order; counts what is outstanding like a NIC's SQ."""

    def __init__(self, sq_depth: int, qpn: int = 99) -> None:
        self.sq_depth = sq_depth
        self.qpn, self.psn, self.event_fd = qpn, 1, None
        self.qp = self
        self.posted: deque[tuple[int, int]] = deque()  # (wr_id, signalled) per WR
        self.log: list[tuple[int, int]] = []  # (opcode, bytes) of every WR posted
        self.frozen = False  # True: the NIC completes nothing (a slow or stuck QP)
        self.outstanding = 0
        self.max_outstanding = 0
        self.fail_next: int | None = None
        self.closed = False

    def to_rts(self, *args: Any) -> None:
        pass

    def take(self, batch: WrBatch, a: int, b: int) -> None:
        rows = batch.descs[a:b]
        for wr_id, flags in zip(rows["wr_id"].tolist(), rows["send_flags"].tolist(), strict=True):
            self.posted.append((wr_id, flags & 2))
        self.log += zip(rows["opcode"].tolist(), rows["length"].tolist(), strict=True)
        self.outstanding += b - a
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        assert self.outstanding <= self.sq_depth, "send queue overflow"

    def poll(self, n: int) -> list[Any]:
        out: list[Any] = []
        while not self.frozen and self.posted and len(out) < n:
            wr_id, signalled = self.posted.popleft()
            self.outstanding -= 1
            if signalled:
                st_ = self.fail_next if self.fail_next is not None else 0
                out.append(SimpleNamespace(wr_id=wr_id, status=st_, opcode=1, vendor_err=0,
                                           imm_data=0))
        return out

    def close(self) -> None:
        self.closed = True


class FakePoster:
    def post(self, qp: FakeQP, batch: WrBatch, a: int, b: int) -> None:
        qp.take(batch, a, b)


class FakeHost:
    """A :class:`VerbsHost` that keeps events in a list and counts with a real meter."""

    def __init__(self, options: TransportOptions) -> None:
        self.options = options
        self.events: list[Event] = []
        self.lock = threading.RLock()
        self.device = cast(Any, SimpleNamespace(gid="fe80::1", mtu=5, name="fake0"))
        self.meter = TransferMeter()
        self.revoked: list[int] = []

    def local_keys(self) -> RegionTable:
        return RegionTable([(0x1000, 1 << 30, 5)], "local")

    def link_regions(self, link_id: int) -> tuple[RemoteRegion, ...]:
        return ()

    def submitted(self, link_id: int, transfer_id: int, nbytes: int, nblocks: int) -> None:
        self.meter.submitted(link_id, transfer_id, nbytes, nblocks)

    def posted(self, wrs: int) -> None:
        self.meter.posted(wrs)

    def link_failed(self, status: str) -> None:
        self.meter.link_failed(status)

    def emit(self, event: Event) -> None:
        self.meter.on_event(event)
        self.events.append(event)

    def stage(self, event: Event) -> None:
        self.emit(event)  # the test reads self.events: nothing to deliver

    def deliver(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def forget(self, link_id: int) -> None:
        pass

    def bind(self, link_id: int, qps: Any) -> None:
        pass

    def revoke(self, link_id: int) -> None:
        self.revoked.append(link_id)


def make_lanes(options: TransportOptions, n: int) -> tuple[VerbsLink, list[FakeQP], FakeHost]:
    """A connected link over ``n`` fake QPs (the peer has ``n`` too)."""
    t = FakeHost(options)
    qps = [FakeQP(options.sq_depth, 99 + i) for i in range(n)]
    link = VerbsLink(t, 1, [cast(Any, qp) for qp in qps])
    link.connect(Endpoint("rdma", (RemoteRegion(0x4000_0000, 1 << 30, 9),), gid="fe80::2",
                          qpns=tuple(range(5, 5 + n)), psn=3, mtu=4096))
    return link, qps, t


def make_link(options: TransportOptions) -> tuple[VerbsLink, FakeQP, FakeHost]:
    """A connected link over one fake QP."""
    link, (qp,), t = make_lanes(options, 1)
    return link, qp, t


def run(link: VerbsLink, *qps: FakeQP, steps: int = 10_000) -> None:
    """Service the link until nothing is left to post or complete."""
    poster = cast(Any, FakePoster())
    for _ in range(steps):
        if not link.service(poster, 0.0) and not any(q.posted and not q.frozen for q in qps):
            return
    raise AssertionError("did not settle")


def blocks(n: int, size: int) -> Blocks:
    """``n`` contiguous blocks of ``size`` bytes inside the fake regions."""
    i = np.arange(n, dtype=np.uint64) * U64(size)
    return Blocks(U64(0x1000) + i, U64(0x4000_0000) + i, np.full(n, size, np.uint64))


@contextmanager
def lane_held(link: VerbsLink, index: int) -> Iterator[None]:
    """While inside, lane ``index`` of ``link`` posts nothing: its send queue has no room.

    The loop posts on a lane only while ``outstanding < qp.sq_depth``; a
    depth of 0 keeps every job of that lane pending, as a full send queue would, with
    no hook in the link. Restored on exit; wake the link's transport after.
    """
    qp = link._lanes[index].qp
    depth = qp.sq_depth
    qp.sq_depth = 0
    try:
        yield
    finally:
        qp.sq_depth = depth
