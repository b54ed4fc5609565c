"""Several RC QPs per link: lanes, striping a request over them, merging its completions.

A :class:`~kvbeam.transport.verbs.link.VerbsLink` owns ``qps_per_peer`` lanes, each
one RC QP with its own send queue, CQ and accounting. :func:`stripe` cuts a
request's (sliced) WRs into contiguous shares of about equal bytes, one per lane it
uses: requests of at least ``stripe_min_bytes`` per extra lane are spread over up
to every lane, smaller ones stay on one lane (lanes taken round-robin). Blocks are
sliced finer first when a request has fewer slices than lanes, so one large
contiguous run still feeds every lane. A request completes (one ``COMPLETED``
event) once every part of it (each lane's share, and its marker) completed.

**Proof of arrival across QPs.** RC orders writes within one QP only. The marker
(the zero-length RDMA WRITE WITH IMM that decode turns into ``NOTIFIED``) goes on
the *home* lane, the lane of the request's last share. It is posted in the home
share's own chain (as with one QP) when every write this link took for that
transfer id (earlier chunks included) sits on the home lane. Otherwise it is a
separate job posted only once (1) every other lane has *completed* (signalled
completion: the responder acknowledged every byte, so it is placed in decode's
memory) every job up to the last one of that transfer id on it, and (2) the home
lane has *posted* every job up to the transfer's last one there, so RC orders the
marker after those bytes. Decode therefore never sees a notification while a write
of that transfer on another QP is still in flight.

**Failure.** A lane whose QP fails (error completion, our deadline) fails the
requests with a part on it, and the requests whose marker waits for it, with its
status. Such a request's ``COMPLETED`` (failed) is emitted only once none of its
WRs is in flight on another lane (its source buffers may be reused after that);
its parts not yet posted are dropped. Requests on the other lanes finish
normally; the link takes no new writes and is torn down when they are done.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np

from kvbeam.transport.core import Prepared
from kvbeam.transport.verbs.chain import DESC_DTYPE, WrBatch, build

_EMPTY = WrBatch(np.zeros(0, DESC_DTYPE), [], [])


class Request:
    """One write: its parts not yet done, its outcome and (when separate) its marker."""

    __slots__ = ("failure", "home", "marker", "parts", "transfer_id", "watermarks")

    def __init__(self, transfer_id: int) -> None:
        self.transfer_id = transfer_id
        self.parts = 0  # jobs (shares, separate marker) not yet completed or dropped
        self.failure: tuple[str, str] | None = None
        self.marker: Job | None = None  # a separate marker job, until queued
        self.home: Lane | None = None
        #: Lane index -> the seq of the last job of this transfer id on that lane.
        self.watermarks: dict[int, int] = {}


class Job:
    """A batch of WRs for one lane and how far posting it got."""

    __slots__ = ("batch", "pos", "request", "seq")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.batch: WrBatch = _EMPTY
        self.pos = 0
        self.seq = 0  # set when the loop queues it; markers keep 0


class Lane:
    """One QP of a link with its send-queue accounting (the loop thread only).

    ``inflight`` holds one ``(wr_id, WRs retired, Job if it is the job's last WR)``
    per posted signalled WR. Jobs get increasing ``seq`` numbers per lane; as RC
    completes in order, ``done_seq`` (the last job completed) and ``posted_seq``
    (the last job fully posted) only grow.
    """

    __slots__ = ("dead", "done_seq", "index", "inflight", "outstanding", "pending", "posted_seq",
                 "progress", "qp", "seq")

    def __init__(self, index: int, qp: Any) -> None:
        self.index = index
        self.qp = qp
        self.pending: deque[Job] = deque()
        self.inflight: deque[tuple[int, int, object]] = deque()
        self.outstanding = 0
        self.progress = 0.0
        self.seq = 0  # the last seq handed out (writers, under the link's submit lock)
        self.posted_seq = 0
        self.done_seq = 0
        self.dead = False  # its QP failed: neither polled nor posted to again

    @property
    def live(self) -> bool:
        """Its QP exists and has not failed."""
        return self.qp is not None and not self.dead

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing in flight."""
        return not self.pending and not self.outstanding


def lanes_for(total: int, lanes: int, stripe_min: int) -> int:
    """How many lanes a request of ``total`` bytes is striped over (at least one)."""
    return max(1, min(lanes, total // stripe_min))


def stripe_slice(total: int, k: int, slice_bytes: int) -> int:
    """The slice size that lets ``k`` lanes each get about ``total / k`` bytes."""
    return slice_bytes if k <= 1 else max(1, min(slice_bytes, -(-total // k)))


def stripe(p: Prepared, k: int) -> list[Prepared]:
    """Cut ``p`` into at most ``k`` contiguous shares of about equal bytes, none empty.

    Only the last share keeps ``p.notify``; the caller decides where the marker goes.
    """
    n = len(p)
    if k <= 1 or n <= 1:
        return [p]
    cum = np.cumsum(p.lengths, dtype=np.uint64)
    total = int(cum[-1])
    targets = np.arange(1, k, dtype=np.float64) * (total / k)
    cuts = np.unique(np.searchsorted(cum, targets, side="left") + 1)
    cuts = cuts[(cuts > 0) & (cuts < n)].tolist()
    bounds = [0, *cuts, n]
    return [part(p, a, b, p.notify and b == n) for a, b in itertools.pairwise(bounds)]


def part(p: Prepared, a: int, b: int, notify: bool) -> Prepared:
    """WRs ``a`` to ``b - 1`` of ``p``, with ``notify``."""
    return dataclasses.replace(p, notify=notify, src=p.src[a:b], dst=p.dst[a:b],
                               lengths=p.lengths[a:b], lkeys=p.lkeys[a:b], rkeys=p.rkeys[a:b])


def marker_ready(request: Request, lanes: list[Lane]) -> bool:
    """Whether a separate marker may be posted (see the module docstring)."""
    home = request.home
    assert home is not None
    for index, seq in request.watermarks.items():
        lane = lanes[index]
        if lane is home:
            if lane.posted_seq < seq:
                return False
        elif lane.done_seq < seq:
            return False
    return True


class Requests:
    """The requests of one link on its lanes: queueing, markers, outcomes (its loop thread).

    ``done`` is called once per request, when its last part completed or was dropped
    (``request.failure`` says how it went).
    """

    def __init__(self, lanes: list[Lane], done: Callable[[Request], None]) -> None:
        self.lanes = lanes
        self.waiting: list[Request] = []  # requests whose separate marker is not queued yet
        #: Transfer id -> lane -> the seq of its last job there, for the final chunk's marker.
        #: Only writes not yet completed matter (see :meth:`_settle`), so an entry goes once
        #: they all completed or failed: a request abandoned before its final chunk (aborted,
        #: past its deadline) or whose chunk failed leaves nothing behind.
        self._last: dict[int, dict[int, int]] = {}
        self._done = done

    def queue(self, request: Request, jobs: list[tuple[Lane, Job]]) -> None:
        """Number each job on its lane and queue it; queue or hold the marker."""
        last = self._last.setdefault(request.transfer_id, {}) if len(self.lanes) > 1 else {}
        for lane, job in jobs:
            lane.seq += 1
            job.seq = last[lane.index] = lane.seq
            lane.pending.append(job)
        request.parts = len(jobs)
        marker, home = request.marker, request.home
        if marker is not None and home is not None:
            request.parts += 1
            request.watermarks = self._last.pop(request.transfer_id, {})
            if set(request.watermarks) <= {home.index}:  # RC orders it after all of them
                home.pending.append(marker)
                request.marker = None
            else:
                self.waiting.append(request)
        if not request.parts:  # no blocks and no notify: nothing to wait for
            self._settle(request)
            self._done(request)

    def release_markers(self) -> None:
        """Queue every waiting marker whose writes on other QPs all completed."""
        waiting: list[Request] = []
        for request in self.waiting:
            if request.marker is not None and request.home is not None and marker_ready(
                    request, self.lanes):
                request.home.pending.appendleft(request.marker)  # after what it covers
                request.marker = None
            else:
                waiting.append(request)
        self.waiting = waiting

    def part_done(self, request: Request) -> None:
        """One part of a request completed or was dropped."""
        request.parts -= 1
        if not request.parts:
            self._settle(request)
            self._done(request)

    def _settle(self, request: Request) -> None:
        """Drop the transfer's entry once no write it names can still be in flight.

        A completed write is placed in the peer's memory, so a later chunk's marker need
        not wait for it; a failed request's link takes no further chunk.
        """
        last = self._last.get(request.transfer_id)
        if last is None:
            return
        if request.failure is not None or all(self.lanes[index].done_seq >= seq
                                              for index, seq in last.items()):
            del self._last[request.transfer_id]

    def job_done(self, lane: Lane, job: Job) -> None:
        """A job's last WR completed (in posting order on its lane)."""
        if job.seq:
            lane.done_seq = job.seq
        self.part_done(job.request)
        if self.waiting:
            self.release_markers()

    def job_posted(self, lane: Lane, job: Job) -> None:
        """A job's last WR was posted (or the job was dropped unposted)."""
        if job.seq:
            lane.posted_seq = max(lane.posted_seq, job.seq)
            if self.waiting:
                self.release_markers()

    def fail_lane(self, lane: Lane, status: str, detail: str) -> bool:
        """The lane's QP failed: fail the requests that used it; whether any did."""
        lane.dead = True
        jobs = [cast(Job, tag) for _, _, tag in lane.inflight if tag is not None]
        jobs += lane.pending
        lane.inflight.clear()
        lane.pending.clear()
        lane.outstanding = 0
        hit = [job.request for job in jobs]
        hit += [r for r in self.waiting if r.home is lane
                or r.watermarks.get(lane.index, 0) > lane.done_seq]
        for request in hit:
            if request.failure is None:
                request.failure = (status, detail)
            if request.marker is not None:  # never posted now
                request.marker = None
                self.waiting.remove(request)
                self.part_done(request)
        for job in jobs:
            self.part_done(job.request)
        return bool(hit)

    def take_all(self) -> list[Request]:
        """Every request with a part still on a lane (or a marker waiting); all cleared."""
        requests = {id(r): r for r in self.waiting}
        for lane in self.lanes:
            jobs = [cast(Job, t) for _, _, t in lane.inflight if t is not None]
            requests.update((id(j.request), j.request) for j in (*jobs, *lane.pending))
            lane.inflight.clear()
            lane.pending.clear()
            lane.outstanding = 0
        self.waiting = []
        return list(requests.values())


def plan(p: Prepared, lanes: list[Lane], k: int, first: int, serials: Iterator[int],
         signal_every: int, marker: tuple[int, int]) -> tuple[Request, list[tuple[Lane, Job]]]:
    """A checked write as a request and its jobs: ``k`` shares on lanes from ``first`` on.

    With one lane the marker ends the share's own chain; with more it is a job of its
    own (:attr:`Request.marker`) on the home lane, placed by :meth:`Requests.queue`.
    """
    n = len(lanes)
    request = Request(p.transfer_id)
    jobs: list[tuple[Lane, Job]] = []
    shares = [s for s in stripe(p, k) if len(s)] if n > 1 else [p]
    for i, share in enumerate(shares):
        job = Job(request)
        job.batch = build(share if n == 1 else part(share, 0, len(share), False),
                          _serial(serials), signal_every, marker, job)
        if job.batch.n:
            jobs.append((lanes[(first + i) % n], job))
    if n > 1 and p.notify:
        request.home = jobs[-1][0] if jobs else lanes[first]
        request.marker = job = Job(request)
        job.batch = build(part(p, 0, 0, True), _serial(serials), signal_every, marker, job)
    return request, jobs


def _serial(serials: Iterator[int]) -> int:
    return next(serials) & 0x7FFF_FFFF  # keeps RECV_TAG clear in wr_ids
