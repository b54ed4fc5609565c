"""One RDMA link: posting transfers as WR chains over its QPs, reaping completions, failing.

Writers (any thread) only check and queue work; everything that touches a QP
runs on the transport's loop thread, under the transport lock, through
:meth:`VerbsLink.service`. A link reaches its transport only through
:class:`VerbsHost` (lock order: :mod:`kvbeam.transport.verbs.transport`).

A link owns ``qps_per_peer`` RC QPs ("lanes"). How a request is striped over them,
how its completions merge into one ``COMPLETED`` event, how decode's proof of
arrival covers every QP and what a QP error fails is in
:mod:`kvbeam.transport.verbs.lanes`; with one QP all of it reduces to one chain per
request with the marker last, as before lanes existed.

``write`` builds each share's whole WR chain up front (see
:func:`kvbeam.transport.verbs.chain.build`); the loop posts slices of
it as the lane's send queue has room, so posting costs O(1) Python work per chain.

Send-queue accounting (per lane): a signalled WR's completion retires it and every
unsignalled WR posted before it (RC completes in order), so a lane's ``inflight``
holds one ``(wr_id, WRs retired, Job or None)`` per posted signalled WR and its
``outstanding`` never exceeds the SQ depth. One WR in ``signal_every`` is
signalled, and always the last WR of a job: its completion completes that part of
the request.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

from kvbeam.errors import TransportError
from kvbeam.transport import status as st
from kvbeam.transport.base import Event, EventKind, Link
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.core import prepare, remote_table
from kvbeam.transport.endpoint import Endpoint
from kvbeam.transport.regions import RegionTable
from kvbeam.transport.verbs.chain import Poster, imm_to_id
from kvbeam.transport.verbs.device import mtu_bytes, mtu_enum
from kvbeam.transport.verbs.lanes import (
    Job,
    Lane,
    Request,
    Requests,
    lanes_for,
    plan,
    stripe_slice,
)
from kvbeam.transport.verbs.linkhost import LinkStats, VerbsHost
from kvbeam.transport.verbs.qp import RECV_TAG, QueuePair

log = logging.getLogger(__name__)

# libibverbs ABI values (enum ibv_wc_opcode / ibv_qp_state), spelled out so the hot
# path does no attribute lookups on pyverbs.enums.
_WC_RECV_RDMA_WITH_IMM = 129
_QPS_ERR = 6
_POLL_BATCH = 64


class VerbsLink(Link):
    """RC QPs to one peer. See the module docstring for the posting scheme."""

    def __init__(self, host: VerbsHost, link_id: int, qps: Sequence[QueuePair]) -> None:
        self.id = link_id
        self._t = host
        self._opts = host.options
        self._lanes = [Lane(i, qp) for i, qp in enumerate(qps)]
        self._peer: RegionTable | None = None
        self._marker = (0, 0)  # remote (addr, rkey) of the zero-length WRITE WITH IMM
        self._state = "new"  # -> connected -> failing (a lane failed) -> failed | released
        self._failure: tuple[str, str] | None = None
        self._submit_lock = threading.Lock()
        # From writers, guarded by _submit_lock: (request, its (lane, job) shares) per write.
        self._submitted: deque[tuple[Request, list[tuple[Lane, Job]]]] = deque()
        self._requests = Requests(self._lanes, self._outcome)  # the loop thread only
        self._serials = itertools.count()
        self._rr = itertools.count()  # round-robin start lane of requests on fewer lanes
        self.stats = LinkStats()

    # -- Link API ----------------------------------------------------------------------
    @property
    def endpoint(self) -> Endpoint:
        """GID, QPNs, PSN, MTU of our QPs and our remote-writable regions with this link's
        rkeys. Every QP of a link starts at the same PSN."""
        qps = self._qps
        if not qps:
            raise TransportError(f"link {self.id} is {self._state}; create a new link")
        dev = self._t.device
        return Endpoint(kind="rdma", regions=self._t.link_regions(self.id), gid=dev.gid,
                        qpns=tuple(qp.qpn for qp in qps), psn=qps[0].psn,
                        mtu=mtu_bytes(dev.mtu), address=dev.name)

    def connect(self, peer: Endpoint) -> None:
        """Bring QP ``i`` to RTS towards the peer's QP ``i``; the counts must match."""
        if peer.kind != "rdma" or not peer.qpns or not peer.gid:
            raise TransportError(f"RDMA link cannot connect to endpoint kind={peer.kind!r} "
                                 f"gid={peer.gid!r} qpns={peer.qpns}")
        if len(peer.qpns) != len(self._lanes):
            raise TransportError(
                f"RDMA link {self.id}: the peer has {len(peer.qpns)} QPs per link and this "
                f"side {len(self._lanes)}: both sides need the same qps_per_peer "
                "(--qps-per-peer / KVBEAM_QPS_PER_PEER)")
        table = remote_table(peer.regions)
        mtu = min(self._t.device.mtu, mtu_enum(peer.mtu)) if peer.mtu else self._t.device.mtu
        with self._t.lock:
            if self._state != "new" or len(self._qps) != len(self._lanes):
                raise TransportError(f"link {self.id} is {self._state}; create a new link")
            for lane, qpn in zip(self._lanes, peer.qpns, strict=True):
                lane.qp.to_rts(peer.gid, qpn, peer.psn, mtu)
            self._t.bind(self.id, self._qps)  # our keys work from here on
            self._peer = table
            if peer.regions:
                self._marker = (peer.regions[0].addr, peer.regions[0].rkey)
            self._state = "connected"
        self._t.wake()  # serviced from now on: its CQs armed, its channels watched
        log.info("link %d connected to %s QPs %s (MTU %d)", self.id, peer.gid,
                 ",".join(map(str, peer.qpns)), mtu_bytes(mtu))

    def write(self, transfer_id: int, blocks: Blocks, notify: bool = True) -> None:
        """Check, slice, stripe and queue; the transport's loop posts it."""
        peer = self._usable_peer()
        start = time.thread_time()  # CPU time: waits for the GIL are not our cost
        opts, n = self._opts, len(self._lanes)
        k = lanes_for(blocks.total_bytes, n, opts.stripe_min_bytes) if n > 1 else 1
        slice_bytes = stripe_slice(blocks.total_bytes, k, opts.slice_bytes)
        p = prepare(transfer_id, blocks, notify, slice_bytes, self._t.local_keys(), peer)
        first = next(self._rr) % n if k < n else 0
        request, jobs = plan(p, self._lanes, k, first, self._serials, opts.signal_every,
                             self._marker)
        self.stats.prepare_s += time.thread_time() - start
        with self._submit_lock:  # the state may have changed while we prepared
            self._usable_peer()
            self._t.submitted(self.id, transfer_id, blocks.total_bytes, len(blocks))
            self._submitted.append((request, jobs))
        self._t.wake()

    def release(self) -> None:
        """Destroy the QPs; queued and in-flight transfers fail with CANCELLED."""
        with self._t.lock:
            # Keys first: a bound type-2 memory window holds its QP (rxe waits for it
            # to go before it destroys the QP).
            self._t.revoke(self.id)
            self._stop("released", st.CANCELLED, "link released")
            self._t.forget(self.id)

    # -- the loop thread ----------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        """WRs posted on this link's QPs and not yet completed."""
        return sum(lane.outstanding for lane in self._lanes)

    @property
    def busy(self) -> bool:
        """Writes queued, pending on a lane or in flight (read by the transport's loop)."""
        return bool(self._submitted) or any(not lane.idle for lane in self._live())

    @property
    def active(self) -> bool:
        """Whether the transport's loop should service this link."""
        return self._state in ("connected", "failing")

    @property
    def event_fds(self) -> list[int] | None:
        """The live QPs' completion-channel fds, or None where one has none (then the
        caller polls with back-off)."""
        fds = [lane.qp.event_fd for lane in self._live()]
        return None if None in fds else cast(list[int], fds)

    def deadline(self) -> float | None:
        """When our own timeout fires on a QP if nothing completes there, or None if
        nothing is outstanding."""
        times = [lane.progress for lane in self._live() if lane.outstanding]
        return min(times) + self._opts.op_timeout_s if times else None

    def arm(self) -> None:
        """Request a completion event on every live QP before the loop sleeps."""
        for lane in self._live():
            lane.qp.arm()

    def take_event(self, fd: int) -> None:
        """Consume the completion event of the QP whose channel fd woke the loop."""
        for lane in self._live():
            if lane.qp.event_fd == fd:
                lane.qp.take_event()

    def service(self, poster: Poster, now: float) -> bool:
        """Reap completions, post what the send queues have room for, enforce deadlines.

        Returns whether anything happened (the caller sleeps only when nothing did).
        """
        if not self.active:
            return False
        busy = False
        for lane in self._live():
            while lane.live:  # a failure may end the lane, or the whole link, meanwhile
                wcs = lane.qp.poll(_POLL_BATCH)
                for wc in wcs:
                    self._complete(lane, wc, now)
                    if not lane.live:
                        break
                busy = busy or bool(wcs)
                if len(wcs) < _POLL_BATCH:
                    break
        if self._submitted:
            self._intake()
        for lane in self._live():
            while lane.pending and lane.live and lane.outstanding < lane.qp.sq_depth:
                self._post(lane, poster, now)
                busy = True
            if lane.outstanding and now - lane.progress > self._opts.op_timeout_s:
                self._timeout(lane)
                busy = True
        if self._state == "failing":
            self._maybe_finish()
        return busy

    def abort(self, detail: str) -> None:
        """Fail the link after an unexpected error in its service."""
        for lane in self._live():
            self._lane_failed(lane, st.INTERNAL_ERROR, detail)

    # -- internals -------------------------------------------------------------------------
    @property
    def _qps(self) -> list[QueuePair]:
        """The link's QPs while they exist (also reached by fault injection and tests)."""
        return [lane.qp for lane in self._lanes if lane.qp is not None]

    def _live(self) -> list[Lane]:
        return [lane for lane in self._lanes if lane.live]

    def _usable_peer(self) -> RegionTable:
        if self._failure is not None and self._state in ("failing", "failed"):
            status, detail = self._failure
            raise TransportError(f"link {self.id} failed ({status}: {detail}); create a new "
                                 "link and handshake again", status)
        if self._state != "connected" or self._peer is None:
            raise TransportError(f"link {self.id} is {self._state}, not connected")
        return self._peer

    def _intake(self) -> None:
        """Queue what writers submitted."""
        with self._submit_lock:
            taken = list(self._submitted)
            self._submitted.clear()
        for request, jobs in taken:
            self._requests.queue(request, jobs)

    def _post(self, lane: Lane, poster: Poster, now: float) -> None:
        """Post the next slice of the lane's first pending job (a failed request's unposted
        job is dropped instead)."""
        start = time.thread_time()
        job = lane.pending[0]
        if job.pos == 0 and job.request.failure is not None:
            lane.pending.popleft()
            self._requests.job_posted(lane, job)
            self._requests.part_done(job.request)
            return
        batch = job.batch
        a = job.pos
        b = min(batch.n, a + lane.qp.sq_depth - lane.outstanding, a + self._opts.max_chain)
        cpu, before = time.thread_time(), time.perf_counter()
        try:
            poster.post(lane.qp.qp, batch, a, b)
        except Exception as exc:
            self._lane_failed(lane, st.POST_SEND_FAILED,
                              f"ibv_post_send of {b - a} WRs failed: {exc}")
            return
        posted = time.perf_counter()
        if not lane.outstanding:
            lane.progress = now
        lo, hi = (bisect.bisect_left(batch.signal_pos, x) for x in (a, b))
        lane.inflight.extend(batch.signals[lo:hi])
        lane.outstanding += b - a
        job.pos = b
        stats = self.stats
        stats.wrs, stats.posts = stats.wrs + b - a, stats.posts + 1
        stats.post_s += posted - before
        stats.book_s += cpu - start
        self._t.posted(b - a)
        if b == batch.n:
            lane.pending.popleft()
            self._requests.job_posted(lane, job)

    def _complete(self, lane: Lane, wc: Any, now: float) -> None:
        wr_id = int(wc.wr_id)
        if wc.status != 0:
            side = "receive" if wr_id & RECV_TAG else "send"
            self._lane_failed(lane, st.wc_status_name(int(wc.status)),
                              f"{side} completion error (vendor_err {wc.vendor_err}, "
                              f"QP {lane.qp.qpn})")
            return
        if wr_id & RECV_TAG:
            lane.qp.repost_recv(wr_id)
            if wc.opcode == _WC_RECV_RDMA_WITH_IMM:
                self._t.emit(Event(EventKind.NOTIFIED, self.id, imm_to_id(int(wc.imm_data))))
            return
        lane.progress = now
        inflight = lane.inflight
        while inflight:  # completions come in posting order: retire up to this WR
            done, count, tag = inflight.popleft()
            lane.outstanding -= count
            if tag is not None:
                self._requests.job_done(lane, cast(Job, tag))
            if done == wr_id:
                return
        log.error("link %d: completion for unknown wr_id %#x", self.id, wr_id)

    def _outcome(self, request: Request) -> None:
        """Every part of a request is done: its COMPLETED event."""
        failure = request.failure
        self._t.emit(Event(EventKind.COMPLETED, self.id, request.transfer_id, failure is None,
                           *(failure or (st.OK, ""))))

    def _timeout(self, lane: Lane) -> None:
        qp = lane.qp
        try:
            state = qp.state()
        except Exception:
            state = -1
        name = st.qp_state_name(state) if state >= 0 else "unknown"
        status = name if state == _QPS_ERR else st.TIMEOUT
        self._lane_failed(lane, status, f"no completion within {self._opts.op_timeout_s:g} s "
                                        f"with {lane.outstanding} WRs outstanding (QP {qp.qpn} "
                                        f"state {name})")

    def _lane_failed(self, lane: Lane, status: str, detail: str) -> None:
        """A QP failed: fail the requests that used it; the link takes no new writes."""
        log.warning("RDMA link %d QP %d failed: %s: %s", self.id, lane.qp.qpn, status, detail)
        with self._submit_lock:
            first = self._state == "connected"
            if first:
                self._state = "failing"
                self._failure = (status, detail)
        if first:
            self._t.link_failed(status)
        self._intake()  # everything submitted before the failure is on its lane now
        hit = self._requests.fail_lane(lane, status, detail)
        if first and not hit:
            self._t.emit(Event(EventKind.LINK_FAILED, self.id, None, False, status, detail))
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        """Tear a failing link down once its other QPs have nothing left of ours."""
        if self._state != "failing" or self._failure is None or self._requests.waiting or any(
                not lane.idle for lane in self._live()):
            return
        self._t.revoke(self.id)  # a dead link's keys go now, before its QPs (see release)
        self._stop("failed", *self._failure)

    def _stop(self, state: str, status: str, detail: str) -> None:
        """Enter a final state: fail every transfer still ours, destroy the QPs."""
        with self._submit_lock:
            if self._state in ("failed", "released"):
                return
            self._state = state
            taken = list(self._submitted)
            self._submitted.clear()
        requests = {id(r): r for r, _ in taken}
        requests.update((id(r), r) for r in self._requests.take_all())
        for request in requests.values():
            failure = request.failure or (status, detail)
            self._t.emit(Event(EventKind.COMPLETED, self.id, request.transfer_id, False,
                               *failure))
        for lane in self._lanes:
            if lane.qp is not None:
                lane.qp.close()
                lane.qp = None
        # The caller revoked the link's keys (memory windows) just before.
