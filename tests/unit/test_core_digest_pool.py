"""The cores compute integrity's digests on the digest pool, with the same guarantee.

Prefill starts its source's digests on the pool before it posts the final writes and
writes their record once they are posted (the notified write); decode digests the
landed bytes on the pool and is Success only when every buffer matched: one corrupted
landed byte is Failed(integrity), naming the buffer.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest import DigestParts, request_digests
from kvbeam.pools.digest_pool import DigestJob, DigestPool
from kvbeam.pools.indices import request_indices
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.state.lifecycle import Deadlines, TransferTable
from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.states import FailureReason, TransferState
from kvbeam.transport import Blocks, Event, EventKind, Link
from tests.core_fakes import (
    FakeDecode,
    FakeLink,
    fake_conn,
    land_record,
    slot_lists,
    started_loop,
    wait_for,
)
from tests.fixtures import UNIFIED_TARGET, layout
from tests.unit.test_core_decode import PREFILL, FakePrefill, QueueExecutor

ADDR = "127.0.0.1:9"
SEQ = 700


class RecordingPool(DigestPool):
    """A digest pool that notes when a job starts, into a log shared with the link."""

    def __init__(self, threads: int, log: list[str]) -> None:
        super().__init__(threads, inline_below=0)
        self.log = log

    def start(self, parts: DigestParts) -> DigestJob:
        self.log.append("digests started")
        return super().start(parts)


class RecordingLink(FakeLink):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def write(self, transfer_id: int, blocks: Blocks, notify: bool = True) -> None:
        self.log.append(f"write notify={notify}")
        super().write(transfer_id, blocks, notify)


class RecordingDecode(FakeDecode):
    """Decode whose connection's link writes into the shared log."""

    def __init__(self, side: AllocatedSide, log: list[str]) -> None:
        super().__init__(side)
        self.conn = fake_conn(ADDR, side)
        self.conn.link = cast(Link, RecordingLink(log))
        self.links.append(cast(FakeLink, self.conn.link))
        self.names.add("r")

    def connect(self, address: str) -> PeerConn:
        return self.conn


def test_prefill_starts_its_digests_on_the_pool_before_posting_and_sends_the_same() -> None:
    log: list[str] = []
    lay = layout()
    src = AllocatedSide(lay)
    src.fill_pattern(3)
    fake = RecordingDecode(AllocatedSide(lay), log)
    with RecordingPool(2, log) as pool:
        core = PrefillDriver(table=TransferTable(Deadlines()), peers=Peers(), decode=fake,
                           io=ThreadPoolExecutor(2), integrity=True, drain_s=5.0,
                           digest_pool=pool, clock=time.monotonic)
        core.use_pools(UNIFIED_TARGET, lay, src)
        core.loop = started_loop()  # threads: every call into the core on the loop
        core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
        assert wait_for(lambda: len(fake.digests) == 1)
    # On the pool's threads (inline_below=0): the data goes out while they digest, the
    # record follows as the notified write.
    assert log == ["digests started", "write notify=False", "write notify=True"]
    rid, tid, digests = fake.digests[0]
    assert (rid, tid) == ("r", cast(FakeLink, fake.conn.link).writes[0][0])
    assert digests == request_digests(src, request_indices(UNIFIED_TARGET, 1, SEQ))


def _decode(pool: DigestPool) -> tuple[DecodeDriver, QueueExecutor, FakePrefill, Any]:
    lay = layout()
    io, prefill = QueueExecutor(), FakePrefill()
    pools = AllocatedSide(lay)
    pools.fill_pattern(9)
    core = DecodeDriver(table=TransferTable(Deadlines()), peers=Peers(), prefill=prefill, io=io,
                      integrity=True, handoff_lease_s=30.0, digest_pool=pool,
                      clock=time.monotonic)
    core.use_pools(UNIFIED_TARGET, lay, pools)
    conn = fake_conn(PREFILL, AllocatedSide(lay))
    core.peers.add(conn)
    return core, io, prefill, conn


def test_decode_verifies_on_the_pool_and_is_success_when_every_buffer_matches() -> None:
    with DigestPool(3, inline_below=0) as pool:  # the threads' path, not the inline one
        core, io, _prefill, conn = _decode(pool)
        res = core.reserve("r", SEQ, PREFILL)
        core.begin_write("r", conn.instance_id, SEQ, True)
        land_record(core, "r", request_digests(core.pools, res.indices))
        core.on_event(Event(EventKind.NOTIFIED, conn.link.id, res.transfer_id))
        io.run_all()
    st = core.status("r")
    assert st.state is TransferState.SUCCESS, st
    assert st.detail.startswith(f"XXH3-128 verified: {len(core.layout.flat_buffers)} buffers")


def test_one_corrupted_landed_byte_fails_integrity_naming_its_buffer() -> None:
    """Never Success on unverified bytes: the byte flipped after prefill digested (what a
    bad wire or a stray write would do) is found by the pool's digests."""
    with DigestPool(2, inline_below=0) as pool:
        core, io, prefill, conn = _decode(pool)
        res = core.reserve("r", SEQ, PREFILL)
        sent = request_digests(core.pools, res.indices)  # what prefill digested
        ring = next(b for b in core.layout.flat_buffers if b.name.endswith("swa_ring"))
        row = int(res.indices[IndexKind.SWA_RING_ROWS][7])
        core.pools.buffer_array(ring)[row * ring.item_len + 3] ^= 0x01  # one landed byte
        core.begin_write("r", conn.instance_id, SEQ, True)
        land_record(core, "r", sent)
        core.on_event(Event(EventKind.NOTIFIED, conn.link.id, res.transfer_id))
        io.run_all()
    st = core.status("r")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.INTEGRITY
    assert st.detail == f"XXH3-128 mismatch in 1 buffer(s): {ring.name}"
    assert prefill.aborts == ["r"] and core.slot_of("r") == -1
