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
from typing import Any

import numpy as np

from kvbeam.transport.core import Prepared
from kvbeam.transport.verbs.chain import SGE_DTYPE, WR_DTYPE, WrBatch

_EMPTY = WrBatch(np.zeros(0, WR_DTYPE), np.zeros(0, SGE_DTYPE), [], [])


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
        self.seq = 0  # set when the progress thread queues it; markers keep 0


class Lane:
    """One QP of a link with its send-queue accounting (progress thread only).

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
