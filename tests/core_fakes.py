"""Fakes for driving the gRPC-free cores (kvbeam.server.core) in unit tests."""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, cast

from kvbeam.errors import AlreadyLanded, NotReserved, SendFailed
from kvbeam.loop import DaemonLoop
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest_pool import DigestPool
from kvbeam.pools.engine_indices import Lists
from kvbeam.pools.engine_indices import slot_lists as layout_slot_lists
from kvbeam.pools.indices import request_indices
from kvbeam.pools.mailbox import HEADER, MAGIC, RecordArea, encode_record, request_hash
from kvbeam.server.core.decode import DecodeCore
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.ports import WriteGrant
from kvbeam.server.core.prefill import PrefillCore
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.state.handshake import VerifiedPeer
from kvbeam.server.state.lifecycle import Deadlines, TransferTable
from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.states import FailureReason, TransferStatus
from kvbeam.transport import Blocks, Event, EventKind, Link
from tests.fixtures import UNIFIED_TARGET, layout
from tests.waiting import wait_until

_link_ids = itertools.count(1000)


class FakeLink:
    """A link that records its writes; completions come only when a test sends them."""

    def __init__(self) -> None:
        self.id = next(_link_ids)
        self.writes: list[tuple[int, bool]] = []
        self.blocks: list[Blocks] = []  # each write's blocks, for tests that apply them
        #: (transfer id, bytes) of each digest record written (read from its source
        #: when it was posted, as the wire would).
        self.records: list[tuple[int, bytes]] = []
        self.released = False

    def write(self, transfer_id: int, blocks: Blocks, notify: bool = True) -> None:
        if notify and len(blocks):  # a digest record is a notified write's last block
            raw = ctypes.string_at(int(blocks.src[-1]), int(blocks.lengths[-1]))
            if HEADER.size <= len(raw) and HEADER.unpack_from(raw)[0] == MAGIC:
                self.records.append((transfer_id, raw))
        self.writes.append((transfer_id, notify))
        self.blocks.append(blocks)

    def finish(self, transfer_id: int, ok: bool = True,
               status: str = "IBV_WC_WR_FLUSH_ERR") -> list[Event]:
        """The COMPLETED events of every write of ``transfer_id`` (with integrity on a
        final chunk is two: its data, then its digest record)."""
        return [self.completion(tid, ok, status) for tid, _ in self.writes
                if tid == transfer_id]

    def release(self) -> None:
        self.released = True

    def completion(self, transfer_id: int, ok: bool = True,
                   status: str = "IBV_WC_WR_FLUSH_ERR") -> Event:
        """The COMPLETED event of one of this link's writes (``status`` when it failed)."""
        return Event(EventKind.COMPLETED, self.id, transfer_id, ok=ok,
                     status="OK" if ok else status)


class SilentChannel:
    """An open peer channel whose peer has left ``missed`` heartbeats unanswered."""

    closed = False

    def __init__(self, missed: int) -> None:
        self.missed = missed

    def missed_heartbeats(self) -> int:
        return self.missed


def fake_conn(address: str, side: AllocatedSide) -> PeerConn:
    """A connection to a decode daemon at ``address`` whose pools are ``side`` (and a
    digest mailbox of its own)."""
    peer = SimpleNamespace(instance_id=f"decode@{address}", control_address=address,
                           layout=side.layout, endpoint=SimpleNamespace(regions=[]))
    box = RecordArea.for_buffers(16, len(side.layout.flat_buffers))
    conn = PeerConn(cast(VerifiedPeer, peer), cast(Link, FakeLink()), side.buffer_addrs(),
                    mailbox=box.advert())
    conn.fake_mailbox = box  # type: ignore[attr-defined]  # alive as long as the conn
    return conn


class FakeDecode:
    """Decode daemons as prefill's core sees them: connect, BeginWrite, Digests, Abort.

    ``hold``: addresses whose handshake blocks until the event is set (a stopped peer).
    ``begins``: (request id, link id) of every BeginWrite. ``landed``: request ids whose
    BeginWrite on a new link answers AlreadyLanded (decode had them before a resend).
    ``aborts``: request ids told by Abort; ``untold``: those an Abort could not reach
    (as the real peer calls: no open connection, hence no open peer channel, to the
    address; a connection's channel is open until it is closed).
    ``forgot``: link ids decode no longer knows (it re-attached or restarted): BeginWrite
    on them is refused as the gRPC adapter refuses NotHandshaken. ``unreserved``: request
    ids decode holds no reservation for (refused as NOT_FOUND). ``digests``: (request
    id, transfer id, digests) of every digest record prefill wrote (read back from its
    record write's source, which the fake link keeps).
    """

    def __init__(self, side: AllocatedSide) -> None:
        self.side = side
        self.aborts: list[str] = []
        self.untold: list[str] = []
        self.connects: list[str] = []
        self.conns: list[PeerConn] = []
        self.hold: dict[str, threading.Event] = {}
        self.begins: list[tuple[str, int]] = []
        self.landed: set[str] = set()
        self.forgot: set[int] = set()
        self.unreserved: set[str] = set()
        #: Requests decode has not reserved YET (BeginWrite refused UnknownRequest), and
        #: the BeginWrites refused so.
        self.not_yet: set[str] = set()
        self.refused_not_yet: list[str] = []
        self.links: list[FakeLink] = []
        #: Request ids the digest records are resolved against (their hash), besides
        #: those BeginWrite saw.
        self.names: set[str] = set()
        self._grants: dict[str, tuple[int | None, int]] = {}
        self._tids = itertools.count(1)
        self._lock = threading.Lock()

    def connect(self, address: str) -> PeerConn:
        self.connects.append(address)
        gate = self.hold.get(address)
        if gate is not None:
            gate.wait(10)
        conn = fake_conn(address, self.side)
        self.links.append(cast(FakeLink, conn.link))
        self.conns.append(conn)
        return conn

    @property
    def digests(self) -> list[tuple[str, int, bytes]]:
        """(request id, transfer id, digests) of every digest record written, in order."""
        core = getattr(self, "core", None)
        known = {*self.names, *(r for r, _ in self.begins), *(core.core._out if core else ())}
        names = {request_hash(r): r for r in known}
        out = []
        for link in list(self.links):
            for tid, raw in list(link.records):
                head = HEADER.unpack_from(raw)
                n, rid = head[3], names.get(head[6], "?")
                out.append((rid, tid, raw[HEADER.size:HEADER.size + 16 * n]))
        return out

    def begin_write(self, conn: PeerConn, request_id: str, seq_len: int,
                    digests_follow: bool) -> WriteGrant:
        if conn.link.id in self.forgot:
            raise SendFailed(FailureReason.PEER_FAILED,
                             f"decode at {conn.control_address} restarted or dropped the "
                             "connection: NotHandshaken", peer_lost=True)
        if request_id in self.not_yet:
            self.refused_not_yet.append(request_id)
            raise NotReserved(FailureReason.INVALID_REQUEST, "decode refused BeginWrite: "
                              f"UnknownRequest: no reservation for request {request_id!r}")
        if request_id in self.unreserved:
            raise SendFailed(FailureReason.INVALID_REQUEST,
                             f"decode refused BeginWrite: no reservation for {request_id}")
        with self._lock:
            relink = any(r == request_id and link != conn.link.id for r, link in self.begins)
            self.begins.append((request_id, conn.link.id))
            # As decode does: one transfer id per request, a new one on a new link.
            link, tid = self._grants.get(request_id, (None, 0))
            if link != conn.link.id:
                tid = next(self._tids)
                self._grants[request_id] = (conn.link.id, tid)
        if relink and request_id in self.landed:
            raise AlreadyLanded(f"request {request_id} landed before the resend")
        return WriteGrant(tid, request_indices(UNIFIED_TARGET, 1, seq_len))

    def reaches(self, conn: PeerConn | None, address: str) -> bool:
        if conn is not None and not conn.closed:
            return True
        return any(not c.closed for c in self.conns if c.control_address == address)

    def abort(self, conn: PeerConn | None, address: str, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        told = self.reaches(conn, address)
        with self._lock:
            (self.aborts if told else self.untold).append(request_id)
        return told

    def abort_all(self, calls: Sequence[tuple[PeerConn | None, str, str]], detail: str,
                  timeout: float) -> int:
        return sum(self.abort(conn, address, rid, detail, timeout) for conn, address, rid in calls)


def flip_digest(digests: bytes, buffer: int = 0) -> bytes:
    """``digests`` with buffer ``buffer``'s digest wrong (its lowest bit flipped)."""
    at = buffer * 16
    return digests[:at] + bytes([digests[at] ^ 1]) + digests[at + 1:]


def land_record(core: DecodeDriver | DecodeCore, request_id: str, digests: bytes,
                transfer_id: int | None = None, slot: int | None = None,
                marks: int = 0) -> None:
    """What prefill's record write lands before its marker: the request's digest record
    in its slot of decode's mailbox (``transfer_id``/``slot``: the record's, by default
    the reservation's; ``marks``: the sub-batches it says were notified before it)."""
    inner = core.core if isinstance(core, DecodeDriver) else core
    res = inner._reservation(request_id)
    assert core.mailbox is not None
    tid = res.transfer_id if transfer_id is None else transfer_id
    core.mailbox.put(res.mailbox_slot, encode_record(
        tid, res.mailbox_slot if slot is None else slot, request_id, digests, marks=marks))


def prefill_core(drain_s: float = 5.0, workers: int = 4, resend_retries: int = 0,
                 on_resend: Any = lambda: None,
                 deadlines: Deadlines | None = None,
                 send_wait_s: float = 0.0,
                 integrity: bool = True, io: Executor | None = None,
                 digest_threads: int = 2,
                 on_change: Callable[[TransferStatus], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 ) -> tuple[PrefillDriver, FakeDecode]:
    """A prefill core over the unit-test pools, with a fake decode side.

    With ``integrity`` a first attempt's final chunk is two writes (its data, then its
    digest record, notified: the digests run on the pool's threads, ``inline_below=0``,
    while the data flies); a resend's, whose digests are kept, is one (the record is
    its last block). Tests of other paths may switch integrity off: one write a chunk.
    ``io``: the executor (by default a thread pool of ``workers``, with a daemon loop
    that every call into the core is handed to, as in the daemon; a queue executor
    drives the core one event at a time on the test's thread, with no loop);
    ``digest_threads`` 0: digests inline (the record is then the data write's last
    block); ``on_change``: the table's observer (the engine channel's place);
    ``clock``: the core's (it gives the table each change's time)."""
    lay = layout()
    fake = FakeDecode(AllocatedSide(lay))
    table = TransferTable(deadlines or Deadlines(), on_change=on_change)
    core = PrefillDriver(table=table, peers=Peers(), decode=fake, clock=clock,
                       io=io or ThreadPoolExecutor(workers, thread_name_prefix="test-io"),
                       integrity=integrity, drain_s=drain_s,
                       resend_retries=resend_retries, on_resend=on_resend,
                       send_wait_s=send_wait_s,
                       digest_pool=DigestPool(digest_threads, inline_below=0))
    core.use_pools(UNIFIED_TARGET, lay, AllocatedSide(lay))
    fake.core = core  # type: ignore[attr-defined]  # names the records' request ids
    if io is None:  # threads: the core is the loop's alone, as in the daemon
        core.loop = started_loop()
    return core, fake


def slot_lists(core: PrefillCore | PrefillDriver, slot: int, seq_len: int) -> Lists:
    """The lists a gRPC Send's ``source_slot`` names in the core's pools (the API makes
    them so: server/api/prefill.py)."""
    return layout_slot_lists(core.spec, core.layout, slot, seq_len)


def started_loop() -> DaemonLoop:
    """A started daemon loop for a driver whose executor runs on threads (its thread is
    a daemon thread: a test that does not stop it leaves it idle)."""
    loop = DaemonLoop("kvbeam-test-loop")
    loop.start()
    return loop


def wait_for(predicate: Callable[..., object], timeout: float = 5.0) -> bool:
    """:func:`tests.waiting.wait_until` at the fakes' pace: in-process cores answer in
    microseconds, so poll every 5 ms."""
    return wait_until(predicate, timeout, interval=0.005)
