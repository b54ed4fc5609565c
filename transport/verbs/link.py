"""One RDMA link: posting transfers as WR chains, reaping completions, failing cleanly.

Writers (any thread) only check and queue work; everything that touches the QP
runs on the transport's progress thread, under the transport lock, through
:meth:`VerbsLink.service`. A link reaches its transport only through
:class:`VerbsHost` (lock order: :mod:`kvbeam.transport.verbs.transport`).

``write`` builds the transfer's whole WR chain up front (see
:func:`kvbeam.transport.verbs.chain.build`); the progress thread posts slices of
it as the send queue has room, so posting costs O(1) Python work per chain.

Send-queue accounting: a signalled WR's completion retires it and every
unsignalled WR posted before it (RC completes in order), so ``_inflight`` holds
one ``(wr_id, WRs retired, transfer id or None)`` per posted signalled WR and
``_outstanding`` never exceeds the SQ depth. One WR in ``signal_every`` is
signalled, and always the last WR of a transfer: with ``notify`` that is the
RDMA WRITE WITH IMM marker carrying the transfer id, posted after the data on
the same QP so the peer sees it only once every byte landed.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from kvbeam.errors import TransportError
from kvbeam.transport import status as st
from kvbeam.transport.base import Event, EventKind, Link
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.core import prepare, remote_table
from kvbeam.transport.endpoint import Endpoint
from kvbeam.transport.host import LinkHost
from kvbeam.transport.regions import RegionTable
from kvbeam.transport.verbs.chain import Poster, WrBatch, build
from kvbeam.transport.verbs.device import VerbsDevice, mtu_bytes, mtu_enum
from kvbeam.transport.verbs.qp import RECV_TAG, QueuePair, imm_to_id

log = logging.getLogger(__name__)

# libibverbs ABI values (enum ibv_wc_opcode / ibv_qp_state), spelled out so the hot
# path does no attribute lookups on pyverbs.enums.
_WC_RECV_RDMA_WITH_IMM = 129
_QPS_ERR = 6
_POLL_BATCH = 64


class VerbsHost(LinkHost, Protocol):
    """What an RDMA link needs from its transport beyond :class:`LinkHost`."""

    @property
    def device(self) -> VerbsDevice:
        """The opened device: GID, MTU and name go into the link's endpoint."""

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The transport lock (re-entrant). The progress thread holds it while it
        services links; a link takes it to change its QP's state (connect, release)."""

    def posted(self, wrs: int) -> None:
        """Count work requests posted."""

    def wake(self) -> None:
        """Wake the progress thread: there is work to post (never blocks)."""

    def revoke(self, link_id: int) -> None:
        """Deregister link ``link_id``'s own memory keys (its QP is destroyed)."""


@dataclass
class LinkStats:
    """Counters of one link's posting work (for benchmarks and metrics)."""

    wrs: int = 0  # WRs posted, markers included
    posts: int = 0  # ibv_post_send calls
    post_s: float = 0.0  # wall time inside ibv_post_send (with rxe: the kernel sends from it)
    book_s: float = 0.0  # progress-thread CPU time around the posts
    prepare_s: float = 0.0  # CPU time in write(): slicing, bounds checks, keys, WR arrays


class _Job:
    """A transfer's WRs and how far posting them got."""

    __slots__ = ("batch", "pos", "transfer_id")

    def __init__(self, transfer_id: int, batch: WrBatch) -> None:
        self.transfer_id = transfer_id
        self.batch = batch
        self.pos = 0


class VerbsLink(Link):
    """An RC QP to one peer. See the module docstring for the posting scheme."""

    def __init__(self, host: VerbsHost, link_id: int, qp: QueuePair) -> None:
        self.id = link_id
        self._t = host
        self._opts = host.options
        self._qp: QueuePair | None = qp
        self._peer: RegionTable | None = None
        self._marker = (0, 0)  # remote (addr, rkey) of the zero-length WRITE WITH IMM
        self._state = "new"  # -> connected -> failed | released
        self._failure: tuple[str, str] | None = None
        self._submit_lock = threading.Lock()
        self._submitted: deque[_Job] = deque()  # from writers, guarded by _submit_lock
        self._pending: deque[_Job] = deque()  # progress thread only, from here on
        self._inflight: deque[tuple[int, int, int | None]] = deque()
        self._outstanding = 0
        self._serials = itertools.count()
        self._progress = time.monotonic()
        self._check_remote = True  # tests turn this off to make the peer's NIC refuse a block
        self.stats = LinkStats()

    # -- Link API ----------------------------------------------------------------------
    @property
    def endpoint(self) -> Endpoint:
        """GID, QPN, PSN, MTU of our QP and our remote-writable regions with this link's rkeys."""
        qp = self._live_qp()
        dev = self._t.device
        return Endpoint(kind="rdma", regions=self._t.link_regions(self.id), gid=dev.gid,
                        qpns=(qp.qpn,), psn=qp.psn, mtu=mtu_bytes(dev.mtu), address=dev.name)

    def connect(self, peer: Endpoint) -> None:
        """Bring our QP to RTS towards the peer's first QP."""
        if peer.kind != "rdma" or not peer.qpns or not peer.gid:
            raise TransportError(f"RDMA link cannot connect to endpoint kind={peer.kind!r} "
                                 f"gid={peer.gid!r} qpns={peer.qpns}")
        table = remote_table(peer.regions)
        mtu = min(self._t.device.mtu, mtu_enum(peer.mtu)) if peer.mtu else self._t.device.mtu
        with self._t.lock:
            if self._state != "new":
                raise TransportError(f"link {self.id} is {self._state}; create a new link")
            self._live_qp().to_rts(peer.gid, peer.qpns[0], peer.psn, mtu)
            self._peer = table
            if peer.regions:
                self._marker = (peer.regions[0].addr, peer.regions[0].rkey)
            self._state = "connected"
        log.info("link %d connected to %s QP %d (MTU %d)", self.id, peer.gid, peer.qpns[0],
                 mtu_bytes(mtu))

    def write(self, transfer_id: int, blocks: Blocks, notify: bool = True) -> None:
        """Check, slice and queue; the progress thread posts it."""
        peer = self._usable_peer()
        start = time.thread_time()  # CPU time: waits for the GIL are not our cost
        p = prepare(transfer_id, blocks, notify, self._opts.slice_bytes, self._t.local_keys(),
                    peer, self._check_remote)
        serial = next(self._serials) & 0x7FFF_FFFF  # keeps RECV_TAG clear in wr_ids
        job = _Job(transfer_id, build(p, serial, self._opts.signal_every, self._marker))
        self.stats.prepare_s += time.thread_time() - start
        with self._submit_lock:  # the state may have changed while we prepared
            self._usable_peer()
            self._t.submitted(self.id, transfer_id, blocks.total_bytes, len(blocks))
            self._submitted.append(job)
        self._t.wake()

    def release(self) -> None:
        """Destroy the QP; queued and in-flight transfers fail with CANCELLED."""
        with self._t.lock:
            self._stop("released", st.CANCELLED, "link released")
            self._t.forget(self.id)
        self._t.revoke(self.id)  # deregistration: outside the transport lock

    # -- progress thread -----------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        """WRs posted on this link and not yet completed."""
        return self._outstanding

    @property
    def active(self) -> bool:
        """Whether the progress thread should service this link."""
        return self._state == "connected"

    @property
    def event_fd(self) -> int | None:
        """The completion channel's fd, or None (then the caller polls with back-off)."""
        return self._qp.event_fd if self._qp is not None else None

    def deadline(self) -> float | None:
        """When our own timeout fires if nothing completes, or None if nothing is outstanding."""
        return self._progress + self._opts.op_timeout_s if self._outstanding else None

    def arm(self) -> None:
        """Request a completion event before the progress thread sleeps."""
        if self._qp is not None:
            self._qp.arm()

    def take_event(self) -> None:
        """Consume the completion event that woke the progress thread."""
        if self._qp is not None:
            self._qp.take_event()

    def service(self, poster: Poster, now: float) -> bool:
        """Reap completions, post what the SQ has room for, enforce the deadline.

        Returns whether anything happened (the caller sleeps only when nothing did).
        """
        qp = self._qp
        if qp is None or self._state != "connected":
            return False
        busy = False
        while True:
            wcs = qp.poll(_POLL_BATCH)
            for wc in wcs:
                self._complete(qp, wc, now)
                if self._state != "connected":
                    return True
            busy = busy or bool(wcs)
            if len(wcs) < _POLL_BATCH:
                break
        if self._submitted:
            with self._submit_lock:
                self._pending.extend(self._submitted)
                self._submitted.clear()
        while self._pending and self._outstanding < qp.sq_depth:
            if not self._post(qp, poster, now):
                break
            busy = True
        if self._outstanding and now - self._progress > self._opts.op_timeout_s:
            self._timeout(qp)
            busy = True
        return busy

    # -- internals -------------------------------------------------------------------------
    def _live_qp(self) -> QueuePair:
        if self._qp is None:
            raise TransportError(f"link {self.id} is {self._state}; create a new link")
        return self._qp

    def _usable_peer(self) -> RegionTable:
        if self._failure is not None and self._state == "failed":
            status, detail = self._failure
            raise TransportError(f"link {self.id} failed ({status}: {detail}); create a new "
                                 "link and handshake again", status)
        if self._state != "connected" or self._peer is None:
            raise TransportError(f"link {self.id} is {self._state}, not connected")
        return self._peer

    def _post(self, qp: QueuePair, poster: Poster, now: float) -> bool:
        """Post the next slice of the first pending transfer. False if the link failed."""
        start = time.thread_time()
        job = self._pending[0]
        batch = job.batch
        a = job.pos
        b = min(batch.n, a + qp.sq_depth - self._outstanding, a + self._opts.max_chain)
        if b > a:
            cpu, before = time.thread_time(), time.perf_counter()
            try:
                poster.post(qp.qp, batch, a, b)
            except Exception as exc:
                self._fail(st.POST_SEND_FAILED, f"ibv_post_send of {b - a} WRs failed: {exc}")
                return False
            posted = time.perf_counter()
            if not self._outstanding:
                self._progress = now
            lo, hi = (bisect.bisect_left(batch.signal_pos, x) for x in (a, b))
            self._inflight.extend(batch.signals[lo:hi])
            self._outstanding += b - a
            job.pos = b
            stats = self.stats
            stats.wrs, stats.posts = stats.wrs + b - a, stats.posts + 1
            stats.post_s += posted - before
            stats.book_s += cpu - start
            self._t.posted(b - a)
        if b == batch.n:
            self._pending.popleft()
            if batch.n == 0:  # no blocks and no notify: nothing to wait for
                self._t.emit(Event(EventKind.COMPLETED, self.id, job.transfer_id))
        return True

    def _complete(self, qp: QueuePair, wc: Any, now: float) -> None:
        wr_id = int(wc.wr_id)
        if wc.status != 0:
            side = "receive" if wr_id & RECV_TAG else "send"
            self._fail(st.wc_status_name(int(wc.status)),
                       f"{side} completion error (vendor_err {wc.vendor_err}, QP {qp.qpn})")
            return
        if wr_id & RECV_TAG:
            qp.repost_recv(wr_id)
            if wc.opcode == _WC_RECV_RDMA_WITH_IMM:
                self._t.emit(Event(EventKind.NOTIFIED, self.id, imm_to_id(int(wc.imm_data))))
            return
        self._progress = now
        inflight = self._inflight
        while inflight:  # completions come in posting order: retire up to this WR
            done, count, transfer_id = inflight.popleft()
            self._outstanding -= count
            if transfer_id is not None:
                self._t.emit(Event(EventKind.COMPLETED, self.id, transfer_id))
            if done == wr_id:
                return
        log.error("link %d: completion for unknown wr_id %#x", self.id, wr_id)

    def _timeout(self, qp: QueuePair) -> None:
        try:
            state = qp.state()
        except Exception:
            state = -1
        name = st.qp_state_name(state) if state >= 0 else "unknown"
        status = name if state == _QPS_ERR else st.TIMEOUT
        self._fail(status, f"no completion within {self._opts.op_timeout_s:g} s with "
                           f"{self._outstanding} WRs outstanding (QP {qp.qpn} state {name})")

    def abort(self, detail: str) -> None:
        """Fail the link after an unexpected error in the progress thread."""
        self._fail(st.INTERNAL_ERROR, detail)

    def _fail(self, status: str, detail: str) -> None:
        log.warning("RDMA link %d failed: %s: %s; tearing it down", self.id, status, detail)
        if self._state not in ("failed", "released"):
            self._t.link_failed(status)
        self._stop("failed", status, detail)
        # A dead link's keys go now (on the progress thread: once it lets go of the lock).
        self._t.revoke(self.id)

    def _stop(self, state: str, status: str, detail: str) -> None:
        """Enter a final state: fail every transfer still ours, destroy the QP."""
        with self._submit_lock:
            if self._state in ("failed", "released"):
                return
            self._state = state
            if state == "failed":
                self._failure = (status, detail)
            failed = [t for _, _, t in self._inflight if t is not None]
            failed += [j.transfer_id for j in (*self._pending, *self._submitted)]
            self._inflight.clear()
            self._pending.clear()
            self._submitted.clear()
            self._outstanding = 0
        for transfer_id in failed:
            self._t.emit(Event(EventKind.COMPLETED, self.id, transfer_id, False, status, detail))
        if state == "failed" and not failed:
            self._t.emit(Event(EventKind.LINK_FAILED, self.id, None, False, status, detail))
        if self._qp is not None:
            self._qp.close()
            self._qp = None
        # The caller revokes the keys next, after the QP: no write of ours still uses them.
