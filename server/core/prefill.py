"""Prefill's core: every request's books in one record, driven by events, no gRPC.

Send queues a chunk of a request; a step on the executor handshakes with the decode
daemon if needed (Bootstrapping; one handshake per address, later requests wait for
it without holding a worker), takes decode's offer of the reservation or, without
one, asks decode where to write with BeginWrite (WaitingForInput -> Transferring;
:mod:`kvbeam.server.core.offers`), plans against decode's indices and posts the
writes; the final chunk carries the states and the completion notification, and
with integrity on its last write is the request's digest record, into decode's
mailbox, which the notification follows (:mod:`kvbeam.server.core.prefill_record`;
the digests are computed while the data writes are in flight). A request is Success
once every write completed. A request never ends (Success or
Failed) while a write that reads its source may still be in flight: decode is told
of a failure only once the request's writes drained, or once its link is released
(:meth:`PrefillCore.periodic` abandons writes that do not drain in time).

Every method takes the core lock only for bookkeeping; handshakes, CRCs, peer RPCs
and posting writes happen outside it, on the executor (see :mod:`kvbeam.server.core`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

import numpy as np

from kvbeam.errors import (
    AlreadyLanded,
    BadKvSkip,
    BadRequest,
    DuplicateRequest,
    FrameError,
    NotHandshakenError,
    NotPosted,
    NotReserved,
    RegionError,
    SendFailed,
    TransportError,
)
from kvbeam.logs import fields
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest_pool import DigestJob, DigestPool
from kvbeam.pools.engine_indices import ListLike, check_kv_skip, same_lists, validate
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.mailbox import RecordArea
from kvbeam.pools.plan import TransferPlan, build_plan, side_windows
from kvbeam.pools.spec import PoolSpec
from kvbeam.pools.sub_batches import MAX_MARKS, bounds, buffer_bytes, cuts, mark_id
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.actions import DropLink
from kvbeam.server.core.base import CoreBase
from kvbeam.server.core.offers import Offer, OfferBook
from kvbeam.server.core.outgoing import Outgoing, Ranges, Step
from kvbeam.server.core.ports import DecodePeers, IndexLists, WriteGrant, abort_at_shutdown
from kvbeam.server.core.prefill_actions import Actions, RunStep, TellDecode
from kvbeam.server.core.prefill_events import PrefillEvents, after_resends
from kvbeam.server.core.prefill_pieces import Pieces
from kvbeam.server.core.prefill_record import RecordStager
from kvbeam.server.core.resend import ResendPolicy
from kvbeam.server.faults import FaultHooks
from kvbeam.server.lifecycle import TransferTable
from kvbeam.server.peers import PeerConn, Peers
from kvbeam.states import FailureReason, TransferState, TransferStatus
from kvbeam.transport import Event
from kvbeam.transport.blocks import Blocks

log = logging.getLogger(__name__)
#: Seconds a Send that found no offer waits for decode's Offer before it asks with
#: BeginWrite (decode may have reserved before the two daemons were connected, and then
#: made no offer). Checked by the sweep (SWEEP_S, 0.2 s), so it is at least that.
OFFER_GRACE_S = 0.05

#: Abort handlers that may wait on a request's drain at once; the others answer at once
#: (the answer then says writes are in flight). A daemon has 16 handler threads, and its
#: heartbeats and every other RPC need them: a burst of aborts must not take them all.
ABORT_WAITERS = 4
#: Longest an Abort handler waits on its request's drain, s (less if its caller's
#: deadline is nearer): writes in flight usually complete within milliseconds.
ABORT_WAIT_S = 2.0
#: Aborts from decode of a request prefill has no Send of yet (decode declined it before
#: prefill's engine sent it) kept so that Send fails at once: at most this many, each
#: for ``send_wait_s`` (what the Send would otherwise wait).
MAX_EARLY_ABORTS = 1024
#: A request of at most this many KV pages whose step cannot block (decode's offer in
#: hand, its connection up, nothing armed that sleeps) runs its step on the thread that
#: made it ready: the engine channel's (its Send) or the peer channel's (decode's Offer),
#: not on the executor: one thread hand-off less per request. Larger requests plan and
#: digest for longer than a frame-reading thread should be held.
INLINE_STEP_MAX_PAGES = 64



class PrefillCore(PrefillEvents, CoreBase):
    """All of prefill's request state; the servicer and the runtime's loops call in.

    Args:
        table: the lifecycle table (the single state vocabulary).
        peers: the peer registry (connections to decode daemons).
        decode: the calls to decode daemons (gRPC in the daemon, fakes in tests).
        io: the bounded executor every blocking step runs on (owned by the driver).
        drain_s: how long a failed request's writes may stay in flight before its
            link is released.
        transfer_budget: seconds Transferring allows for a number of bytes (the
            deadline grows with the request, see ``DaemonSettings.transfer_budget_s``).
        resend_retries: resends of a request after a transient transport error
            (:mod:`kvbeam.server.core.resend`; 0: fail at once).
        on_resend: called once per resend (metrics).
        max_offers: the most reservations decode offered that are kept unused
            (:mod:`kvbeam.server.core.offers`).
        send_wait_s: how long a Send that found no reservation on decode waits for it
            (WaitingForInput, its source pages held) before it fails with a timeout;
            0: it fails at once, as before the engine channel.
        on_offer: called with what happened to an offer (metrics).
        digest_pool: the threads integrity's digests are computed on (owned by the
            driver); None: on the executor thread.
        staging: the digest records' staging slots, registered LOCAL by the daemon
            (None: the core makes its own of ``staging_slots``, unregistered: tests).
    """

    role = "prefill"

    def __init__(self, *, table: TransferTable, peers: Peers, decode: DecodePeers, io: Executor,
                 spec: PoolSpec | None, layout: SideLayout | None, pools: AllocatedSide | None,
                 integrity: bool, faults: FaultHooks | None, drain_s: float,
                 transfer_budget: Callable[[int], float] = lambda _n: 0.0,
                 resend_retries: int = 0, on_resend: Callable[[], None] = lambda: None,
                 max_offers: int = 1024,
                 on_offer: Callable[[str], None] = lambda _event: None,
                 send_wait_s: float = 0.0, digest_pool: DigestPool | None = None,
                 staging: RecordArea | None = None, staging_slots: int = 256) -> None:
        self.table = table
        self.peers = peers
        self.decode = decode
        self.io = io
        self._hold(spec, layout, pools)  # none yet on an engine daemon (use_pools)
        self.integrity = integrity
        self.faults = faults
        self.drain_s = drain_s
        self.transfer_budget = transfer_budget
        #: When a request whose link failed is resent (server/core/resend.py).
        self.resend = ResendPolicy(resend_retries)
        self.on_resend = on_resend
        self.offers = OfferBook(max_offers)  # decode's reservations ahead of Send
        self.on_offer = on_offer
        self.send_wait_s = send_wait_s
        self.digest_pool = digest_pool or DigestPool(0)  # 0: on the executor thread
        #: The digest records' staging slots (used under ``_lock``).
        self.records = RecordStager(staging_slots, staging)
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        # Counts the Abort handlers waiting on a drain (taken without blocking).
        self._abort_waiters = threading.BoundedSemaphore(ABORT_WAITERS)
        self._out: dict[str, Outgoing] = {}
        self._writes: dict[tuple[int, int], str] = {}
        self._connecting: dict[str, list[Outgoing]] = {}
        #: Decode's aborts that came before the request's Send: id -> (expiry, detail).
        self._early_aborts: dict[str, tuple[float, str]] = {}
        #: Requests that ended before their final chunk came and whose record the sweep
        #: forgot: a further chunk of one is answered with its status (while the table
        #: still knows it), as when the record is kept. Pruned by the sweep.
        self._ended_unfinished: set[str] = set()

    # ---- API ---------------------------------------------------------------------------
    def send(self, request_id: str, src_slot: int, seq_len: int, decode_address: str,
             ranges: Ranges, final: bool, *, indices: Mapping[IndexKind, ListLike] | None = None,
             draft: Mapping[IndexKind, ListLike] | None = None,
             kv_offset: int | None = None) -> TransferStatus:
        """Queue (a chunk of) a request for decode; returns at once (poll :meth:`status`).

        ``indices`` (and ``draft``, the draft's own lists) are the engine's source
        lists of the whole request (docs/indices.md), validated here before anything
        is queued; without them the lists are ``src_slot``'s. A further chunk omits
        them or repeats them unchanged. With ``kv_offset`` (the engine channel's
        EXTENDS) they are instead this chunk's piece of the lists, its KV pages from
        that position of the request's KV_PAGES list on, every other list with the
        final chunk (:mod:`kvbeam.server.core.prefill_pieces`); every chunk of such a
        request gives one.
        """
        for start, end in ranges:
            if not 0 <= start < end <= seq_len:
                raise BadRequest(f"chunk [{start}, {end}) is not inside [0, {seq_len})")
        if not final and not ranges:
            raise BadRequest("a non-final chunk must name its token ranges (chunks)")
        lists = (validate("prefill", self.spec, self.layout, indices or {}, draft or {}, seq_len)
                 if (indices or draft) and kv_offset is None else None)
        with self._lock:
            rec = self._out.get(request_id)
            ended = self._ended_before_final(rec, request_id)
            if ended is not None:
                # The request failed (decode's verdict, a lost peer, a deadline) before
                # the engine's last chunk came: not a reuse of its id. The chunk is
                # answered with the request's end, which its caller reads anyway.
                log.info("request %s: a further chunk came after it ended (%s): answered "
                         "with its status", request_id, ended.state.value,
                         extra=fields(request_id, decode_address))
                return ended
            early = self._early_aborts.pop(request_id, None) if rec is None else None
            if early is not None and early[0] >= time.monotonic():
                # Decode declined (or aborted) it before this Send: fail it now, rather
                # than hold the engine's source for the --send-wait-s lease.
                self.table.create(request_id, decode_address)
                self.table.fail(request_id, FailureReason.PEER_FAILED, early[1])
                log.warning("request %s failed: decode ended it before its Send: %s",
                            request_id, early[1], extra=fields(request_id, decode_address))
                return self.status(request_id)
            if rec is None:
                pieces = None
                if kv_offset is not None:
                    pieces = Pieces(request_id, self.spec, self.layout, seq_len)
                    whole = pieces.add(kv_offset, ranges, final, indices or {}, draft or {})
                    lists = whole or ({**{k: np.zeros(0, dtype=np.int64) for k in IndexKind},
                                       IndexKind.KV_PAGES: pieces.kv_pages}, {})
                src, src_draft = lists or (request_indices(self.spec, src_slot, seq_len), {})
                self.table.create(request_id, decode_address)
                rec = Outgoing(request_id, src_slot if lists is None else -1, seq_len,
                               decode_address, src,
                               np.zeros(len(src[IndexKind.KV_PAGES]), dtype=np.bool_),
                               src_draft=src_draft, pieces=pieces)
                self._out[request_id] = rec
            else:
                snap = self.table.get(request_id)
                if rec.final_submitted or snap is None or snap.state.terminal:
                    raise DuplicateRequest(f"request id {request_id!r}: its final chunk was "
                                           "already sent or it ended; request ids are unique")
                if (kv_offset is None) != (rec.pieces is None):
                    raise FrameError("kv_offset", (
                        f"request {request_id}: its lists came whole with its first SEND, "
                        "a later one gives no piece" if rec.pieces is None else
                        f"request {request_id}: its lists come in pieces, so every SEND of "
                        "it gives one (with kv_offset)"), request_id)
                if rec.pieces is not None and kv_offset is not None:
                    if (rec.seq_len, rec.decode_address) != (seq_len, decode_address):
                        raise BadRequest(f"request {request_id}: a further chunk must keep "
                                         "the seq_len and decode address of the first")
                    whole = rec.pieces.add(kv_offset, ranges, final, indices or {}, draft or {})
                    if whole is not None:
                        rec.src_indices, rec.src_draft = whole
                    indices = draft = None  # taken: not compared with the first's below
                engine = rec.src_slot < 0  # the first chunk gave lists: its slot is ignored
                same = lists is None or (engine and same_lists(lists[0], rec.src_indices)
                                         and same_lists(lists[1], rec.src_draft))
                if (rec.seq_len, rec.decode_address) != (seq_len, decode_address) or not same \
                        or (not engine and rec.src_slot != src_slot):
                    raise BadRequest(f"request {request_id}: a further chunk must keep "
                                         "the source slot (or index lists), seq_len and decode "
                                         "address of the first")
            start_step = rec.queue((ranges, final))
            park = start_step and self._parks_at_once(rec)
            if park:
                rec.park(time.monotonic())  # decode's Offer starts its step
                self._lease_parked(rec)
            elif start_step:
                rec.move(Step.RUNNING)
        if park:
            self._after_park(rec)
        elif start_step:
            self._start_step(rec)
        return self.status(request_id)

    def offer(self, request_id: str, instance_id: str, seq_len: int, grant: WriteGrant,
              lease_s: float) -> bool:
        """Decode offers a reservation ahead of Send; True when it is kept.

        Not kept (False) when the book is full or the request already writes (its
        Send came first and asked with BeginWrite). Raises NotHandshakenError when
        ``instance_id`` is not a connected decode peer.
        """
        conn = self.peers.get(instance_id)
        if conn is None or conn.closed:
            raise NotHandshakenError(f"no connection to decode instance {instance_id!r}")
        with self._lock:
            rec = self._out.get(request_id)
            # Late: the request already writes under a grant (BeginWrite's), or posted a
            # chunk. A Send whose first step is still asking BeginWrite is not late: decode
            # may refuse that one (no reservation yet: it parks), and this offer unparks it.
            late = rec is not None and (rec.transfer_id is not None or rec.bytes_total > 0
                                        or len(rec.posted) > 1 or bool(rec.resends))
        kept = not late and self.offers.put(
            Offer(request_id, conn, seq_len, grant, time.monotonic() + lease_s))
        self.on_offer("received" if kept else "refused")
        if kept:
            self._unpark(request_id)  # a Send that came first waits for this
        return kept

    def _offered_grant(self, rec: Outgoing, conn: PeerConn, final: bool, *,
                       count_miss: bool = True) -> WriteGrant | None:
        """Decode's offer for this step, if one is usable (else BeginWrite asks).

        Used for a request whose first chunk is its final one and that is not a
        resend (a resend needs a new transfer id on its new link: BeginWrite). A
        chunked request asks with BeginWrite per chunk; its offer is dropped.
        ``count_miss`` False: a miss is not counted here (a step that runs inline hands
        the BeginWrite to the executor, whose step counts it).
        """
        had = self.offers.has(rec.request_id)
        offer = self.offers.take(rec.request_id, conn, rec.seq_len)
        if had and offer is None:
            rec.asked = True  # decode offered, but not this (expired, other link): ask now
        single = final and len(rec.posted) == 1 and not rec.resends
        if not single:
            return None
        if offer is None and self._waits_for_offer(rec, conn, final):
            return None  # it waits for the Offer (counted "used" when that comes)
        if offer is not None or count_miss:
            self.on_offer("used" if offer is not None else "missed")
        return offer.grant if offer is not None else None

    def _parks_at_once(self, rec: Outgoing) -> bool:
        """Whether a fresh single-chunk Send would only park (no offer yet, its decode
        connected: its step would wait for the Offer): it parks here, at once, and
        decode's Offer starts its one step (no executor job that only parks).
        Under ``_lock``; the step's own test is :meth:`_waits_for_offer`."""
        if rec.posted or len(rec.chunks) != 1 or not rec.chunks[0][1] or \
                rec.step is not Step.IDLE:
            return False
        if self.offers.has(rec.request_id):
            return False  # the Offer came first: the step writes at once
        conn = self.peers.by_address(rec.decode_address)
        if conn is None or conn.closed or conn.retired_channel() is not None:
            return False  # the step connects (or drops a retired connection) first
        rec.conn = conn
        return self._may_wait_for_offer(rec, conn)

    def abort(self, request_id: str, *, from_peer: bool, detail: str,
              wait_s: float | None = None, instance_id: str = "",
              caller_refusal: Callable[[str], str | None] | None = None) -> TransferStatus:
        """Fail the request; wait a little for its writes to drain; tell decode.

        The wait is bounded by ``ABORT_WAIT_S`` and ``wait_s`` (what the caller's
        deadline leaves; None: no deadline) and taken by at most ``ABORT_WAITERS`` calls at
        once; :meth:`in_flight` then says whether the writes drained. Those that did
        not drain are told to decode by Abort once they do (or the link is released:
        :meth:`periodic` abandons them after ``drain_s``), even when decode asked.

        ``from_peer`` (decode reports its verdict: reason peer_failed, decode needs no
        Abort back) is taken only from the request's own decode, the rule decode applies
        to prefill's Aborts: with ``caller_refusal`` given (the daemon's handler; None: a
        test of the core, nothing checked), ``instance_id`` must be the decode instance
        the request is connected to (if any) and the caller's credentials must cover the
        request's decode address. Anyone else's claim is a scheduler's abort.
        """
        if from_peer and caller_refusal is not None:
            from_peer = self._from_its_decode(request_id, instance_id, caller_refusal)
        self.offers.drop(request_id)
        with self._lock:
            rec = self._out.get(request_id)
            if rec is not None and from_peer:
                rec.told_decode = True  # decode asked: it knows
        if rec is None and from_peer and self.send_wait_s and self.table.get(request_id) is None:
            self._remember_early_abort(request_id, detail or "aborted by decode")
        if rec is None:  # ended and pruned, or never seen (UnknownRequest)
            snap = self.status(request_id)
            if from_peer and snap.state is TransferState.SUCCESS:
                # Decode's verdict came after the sweep pruned our Success record.
                self._late_verdict(request_id, detail, snap.peer)
            return snap
        reason = FailureReason.PEER_FAILED if from_peer else FailureReason.ABORTED
        detail = after_resends(detail or ("aborted by decode" if from_peer else "aborted"),
                               rec.resends, rec.first_failure)
        if self.table.fail(request_id, reason, detail):
            log.warning("request %s failed: %s: %s", request_id, reason.value, detail,
                        extra=fields(request_id, rec.decode_address))
        elif from_peer:
            self._late_verdict(request_id, detail, rec.decode_address)
        # The answer says whether any of the request's writes is still in flight
        # (in_flight). Waiting on the condition releases the lock.
        with self._drained:
            drained = rec.drained
        bound = min(self.drain_s, ABORT_WAIT_S, ABORT_WAIT_S if wait_s is None else wait_s)
        if not drained and bound > 0 and self._abort_waiters.acquire(blocking=False):
            try:
                with self._drained:
                    drained = self._drained.wait_for(lambda: rec.drained, timeout=bound)
            finally:
                self._abort_waiters.release()
        if from_peer and not drained:
            with self._lock:
                rec.told_decode = False  # our answer says "in flight": tell it once drained
            log.info("request %s: %d write(s) still in flight when decode's Abort was "
                     "answered; decode is told once they drained", request_id,
                     rec.outstanding, extra=fields(request_id, rec.decode_address))
        self._execute(self._tell_decode_once(rec, f"aborted on prefill: {detail}"))
        return self.status(request_id)

    def _from_its_decode(self, request_id: str, instance_id: str,
                         caller_refusal: Callable[[str], str | None]) -> bool:
        """Whether an Abort that says it is decode's comes from the request's decode."""
        with self._lock:
            rec = self._out.get(request_id)
            conn = rec.conn if rec is not None else None
            address = rec.decode_address if rec is not None else ""
        if rec is None:
            return True  # nothing here to protect (ended, unknown, or not yet sent)
        # Outside the lock: the check may resolve the decode's host name.
        refusal = caller_refusal(address)
        wrong = conn is not None and conn.instance_id != instance_id
        if refusal is None and not wrong:
            return True
        log.warning("request %s: an Abort claiming to come from its decode at %s %s: taken "
                    "as a scheduler's abort", request_id, address,
                    refusal if refusal is not None else
                    f"names instance {instance_id!r}, not {conn.instance_id if conn else '?'}",
                    extra=fields(request_id, address))
        return False

    def _ended_before_final(self, rec: Outgoing | None,
                            request_id: str) -> TransferStatus | None:
        """The status of a request that ended before its final chunk was submitted
        (None: it did not, or it is not known); under ``_lock``."""
        if rec is None and request_id not in self._ended_unfinished:
            return None
        if rec is not None and rec.final_submitted:
            return None
        snap = self.table.get(request_id)
        if snap is None:
            self._ended_unfinished.discard(request_id)  # forgotten: a new request
            return None
        return snap if snap.state.terminal else None

    def _remember_early_abort(self, request_id: str, detail: str) -> None:
        """Decode ended a request whose Send has not come (its engine declined it before
        prefill's engine sent it): its Send, if it comes within ``send_wait_s``, fails at
        once. Bounded: the oldest is forgotten first (that Send then waits its lease)."""
        now = time.monotonic()
        with self._lock:
            book = self._early_aborts
            for rid in [r for r, (expiry, _) in book.items() if expiry < now]:
                del book[rid]
            while len(book) >= MAX_EARLY_ABORTS:
                del book[next(iter(book))]
            book[request_id] = (now + self.send_wait_s, detail)

    def use_pools(self, spec: PoolSpec, layout: SideLayout, pools: AllocatedSide) -> None:
        """An engine attached: work in its memory from now on (a request that raced the
        detach is failed first: its source pages are stale)."""
        if self.table.live():
            self.shutdown("engine memory replaced while the request was being accepted")
        self.take_pools(spec, layout, pools)

    def drop_pools(self, detail: str) -> None:
        """The engine's memory goes: refuse new requests, fail every live one (decode is
        told, bounded), release every link (their writes stop)."""
        self.refuse_pools(detail)
        self.shutdown(detail)

    def in_flight(self, request_id: str) -> int:
        """Writes of the request that may still read its source (0 once drained)."""
        with self._lock:
            rec = self._out.get(request_id)
            return 0 if rec is None or rec.drained else rec.outstanding

    def slot_of(self, request_id: str) -> int:
        """The source slot of a live request, -1 once forgotten."""
        rec = self._lookup(self._out, request_id)
        return rec.src_slot if rec else -1

    def bytes_of(self, request_id: str) -> tuple[int, int]:
        """(bytes written, bytes posted) of a live request."""
        rec = self._lookup(self._out, request_id)
        return (rec.bytes_done, rec.bytes_total) if rec else (0, 0)

    def known(self, request_id: str) -> bool:
        """True while the core keeps a record of the request (tests, diagnostics)."""
        return self._lookup(self._out, request_id) is not None

    # ---- events: the handlers decide (prefill_events.py), these do the I/O --------------
    def on_event(self, event: Event) -> None:
        """A transport event (a write's completion, a failed link), on the thread that
        saw it: bookkeeping here, whatever blocks on the executor."""
        self._execute(self.handle_event(event))

    def on_deadline(self, status: TransferStatus) -> None:
        """A deadline passed (the table failed it): decode is told once its writes drained."""
        self._execute(self.handle_deadline(status))

    def on_peer_lost(self, conn: PeerConn, detail: str, *, gone: bool = True) -> None:
        """Release the link (its writes complete as failed), then fail or resend its
        requests (:meth:`link_dropped`). Blocking (the link's release): on the executor
        or a daemon loop, never under a lock."""
        self.peers.remove(conn)
        conn.close()
        self._execute(self.link_dropped(conn, detail, gone=gone))

    def shutdown(self, detail: str = "prefill shutting down") -> None:
        """Fail every live request (reason shutdown), tell decode, release links.

        Decode is told of every request at once, within ``SHUTDOWN_ABORT_S`` in all.
        """
        abort_at_shutdown(self.fail_live(detail), detail, "decode", self.decode.abort_all)
        self.peers.close_all()

    def _execute(self, actions: Actions) -> None:
        """Do the event handlers' actions, in order: a count here, the rest (a peer call,
        a step, a link's release) on the executor."""
        for action in actions:
            if isinstance(action, TellDecode):
                self.io.submit(self.decode.abort, action.conn, action.address,
                               action.request_id, action.detail)
            elif isinstance(action, RunStep):
                self.io.submit(self._step, action.rec)
            elif isinstance(action, DropLink):
                self.io.submit(self.on_peer_lost, action.conn, action.detail,
                               gone=action.gone)
            else:
                self.on_resend()  # Count("resends"): the only count prefill's handlers make

    # ---- the send path (executor) --------------------------------------------------------
    def _start_step(self, rec: Outgoing) -> None:
        """Run the request's step (the caller moved it to RUNNING): here when it cannot
        block (:meth:`_steps_inline`), else on the executor."""
        if self._steps_inline(rec):
            self._step(rec, inline=True)
        else:
            self.io.submit(self._step, rec)

    def _steps_inline(self, rec: Outgoing) -> bool:
        """Whether the request's step cannot block, so the thread that made it ready may
        run it: one final chunk, the first attempt, at most ``INLINE_STEP_MAX_PAGES`` KV
        pages, its decode connected with a live peer channel, decode's offer in hand (no
        BeginWrite) and no fault armed that holds a post. Read without the lock: the
        step meets a race that made the answer stale by going on on the executor."""
        if self.faults is not None and self.faults.hold_posting:
            return False
        if (len(rec.chunks) != 1 or not rec.chunks[0][1] or rec.posted or rec.resends
                or rec.rehandshake or rec.resend_cause is not None
                or len(rec.src_indices[IndexKind.KV_PAGES]) > INLINE_STEP_MAX_PAGES):
            return False
        conn = self._step_conn(rec)
        return (conn is not None and not conn.closed and conn.retired_channel() is None
                and self.offers.has(rec.request_id))

    def _step(self, rec: Outgoing, inline: bool = False) -> None:
        """Run the request's next chunk; one step per request at a time keeps chunk order.

        ``inline``: on the thread that made the request ready (:meth:`_start_step`), which
        must not block: where the step would (a retired connection to drop, a handshake,
        BeginWrite, a post's failure, digests still being computed), it goes on on the
        executor.
        """
        if not inline:
            self._drop_retired(rec)
        elif self._retired(rec) is not None:  # dropping it blocks: on the executor
            self.io.submit(self._step, rec)
            return
        with self._lock:
            idle = self._ended(rec) or not rec.chunks or rec.resend_cause is not None
            if idle:
                rec.move(Step.IDLE)
        if idle:
            self._execute(self._maybe_resend(rec))
            return
        with self._lock:
            conn = self._step_conn(rec)
            if conn is None:
                if inline:
                    pass  # the handshake runs on the executor (below)
                elif (waiting := self._connecting.get(rec.decode_address)) is not None:
                    rec.move(Step.CONNECTING)
                    waiting.append(rec)  # a handshake with that address is under way
                    return
                else:
                    rec.move(Step.CONNECTING)
                    self._connecting[rec.decode_address] = [rec]
            else:
                rec.conn = conn
                ranges, final = rec.take_chunk()
        if conn is None:
            if inline:
                self.io.submit(self._step, rec)
            else:
                self._connect(rec.decode_address)
            return
        try:
            parks = self._write_chunk(rec, conn, ranges, final, inline=inline)
        except Exception as exc:
            if inline:  # what follows may block (a link's release, a new handshake)
                self.io.submit(self._failed_step, rec, conn, exc)
            else:
                self._failed_step(rec, conn, exc)
            return
        self._end_step(rec, parks=parks)

    def _failed_step(self, rec: Outgoing, conn: PeerConn, exc: BaseException) -> None:
        """The step's chunk was not written (``exc``): resend it on a new link (a post
        failed), handshake again (decode forgot us) or fail the request; then the step
        ends. Blocking (a link's release): on the executor, no lock held."""
        if isinstance(exc, NotPosted):
            if self._resend_after(rec, conn, exc.cause):
                self._end_step(rec)  # resent on a new link once this step ends
                return
            exc = exc.cause
        lost = isinstance(exc, SendFailed) and exc.peer_lost
        if not (lost and self._peer_forgot_us(rec, conn, str(exc))):
            self._execute(self._step_failed(rec, exc))
        self._end_step(rec)

    def _end_step(self, rec: Outgoing, *, parks: bool = False) -> None:
        """The step is over: the next chunk's step, a pending resend, or (``parks``: the
        step put its chunk back to wait for decode's reservation) the park; an Offer that
        came while the step ran is in the book, and the step runs again for it."""
        with self._lock:
            again = rec.step_ended(ended=self._ended(rec), parks=parks,
                                   offer_waiting=parks and self.offers.has(rec.request_id),
                                   now=time.monotonic())
            parked = rec.step is Step.PARKED
            if parked:
                self._lease_parked(rec)
        if again:
            self.io.submit(self._step, rec)
        elif parked:
            self._after_park(rec)
        else:
            self._execute(self._maybe_resend(rec))

    def _step_conn(self, rec: Outgoing) -> PeerConn | None:
        """The connection the request's next step would use: its own while open, else
        the one to its decode address (None: a handshake first)."""
        conn = rec.conn
        return conn if conn is not None and not conn.closed else \
            self.peers.by_address(rec.decode_address)

    def _retired(self, rec: Outgoing) -> tuple[PeerConn, Any] | None:
        """The connection the request's step would use, with its peer channel, when
        that channel was retired (closed under the connection)."""
        with self._lock:
            conn = self._step_conn(rec)
        channel = conn.retired_channel() if conn is not None else None
        if conn is None or channel is None or conn.closed:
            return None
        return conn, channel

    def _drop_retired(self, rec: Outgoing) -> None:
        """The connection this step would use has lost its peer channel: drop it, so the
        step handshakes a new link (and a new channel) instead of calling nothing.

        Closed with a BYE (decode released or replaced that connection: its link failed,
        its engine detached), only the link is gone: decode keeps the reservations and
        each request on the connection is resent on the next link while its retries and
        deadline allow (``gone=False``, as a failed link). Closed without one, the peer
        is lost (its channel handler says so too): its requests fail. Blocking (the
        link's release): on the executor, no lock held.
        """
        retired = self._retired(rec)
        if retired is None:
            return
        conn, channel = retired
        how = "closed" if channel.orderly else "lost"
        log.info("request %s: the peer channel to %s was %s (%s): dropping that connection, "
                 "the next handshake opens a new one", rec.request_id, channel.peer, how,
                 channel.close_reason, extra=fields(rec.request_id, rec.decode_address))
        self.on_peer_lost(conn, f"peer channel to {channel.peer} {how}: "
                                f"{channel.close_reason}", gone=not channel.orderly)

    def _peer_forgot_us(self, rec: Outgoing, conn: PeerConn, detail: str) -> bool:
        """Decode no longer knows our connection (``detail``; it re-attached its engine or
        restarted, and prefill had not noticed yet): drop the connection, failing the
        requests on it (:meth:`on_peer_lost`). True: ``rec`` goes on over a new handshake
        instead, since decode refused its first BeginWrite before any byte of it was
        written; once per request.
        """
        with self._lock:
            again = (not rec.rehandshake and not rec.resends and rec.bytes_total == 0
                     and rec.outstanding == 0 and len(rec.posted) == 1
                     and not self._ended(rec))
            if again:
                rec.rehandshake = detail
                rec.put_back()  # the next step runs it again
                rec.conn = None  # so on_peer_lost spares it, and the step handshakes anew
        if again:
            log.warning("request %s: %s; handshaking again (nothing of it was written)",
                        rec.request_id, detail, extra=fields(rec.request_id, rec.decode_address))
        self.on_peer_lost(conn, detail)
        return again

    def _connect(self, address: str) -> None:
        """Handshake with decode at ``address``; then every request waiting for it goes on."""
        conn: PeerConn | None = None
        error: Exception | None = None
        began = time.monotonic()
        try:
            conn = self.decode.connect(address)
        except Exception as exc:
            error = exc
        if conn is not None:
            with self._lock:
                self.resend.measured(handshake=time.monotonic() - began)
            self.peers.add(conn)
        with self._lock:
            waiters = self._connecting.pop(address, [])
            for rec in waiters:
                rec.conn = conn
                rec.move(Step.RUNNING if error is None else Step.IDLE)
                # Decode had no connection to offer on when it reserved: ask at once.
                rec.asked = True
        for rec in waiters:
            if error is not None:
                self._execute(self._step_failed(rec, error))
            else:
                self.io.submit(self._step, rec)

    def _write_chunk(self, rec: Outgoing, conn: PeerConn, ranges: Ranges, final: bool, *,
                     inline: bool = False) -> bool:
        """Write one chunk: take decode's grant (its offer, else BeginWrite), plan, post;
        with integrity, the final chunk's digest record follows. A post that fails
        raises :class:`NotPosted` (:meth:`_failed_step` resends or fails). True: the
        chunk was put back to wait for decode's reservation (the step's end parks it).
        ``inline``: the step may not block (:meth:`_step`)."""
        rid = rec.request_id
        grant = self._offered_grant(rec, conn, final, count_miss=not inline)
        if grant is None and self._waits_for_offer(rec, conn, final):
            # Decode's engine reserves on its own daemon, which offers the reservation
            # over the peer link: wait for that instead of asking (no BeginWrite).
            return self._park(rec)
        if grant is None and inline:
            # The offer went meanwhile (aborted, expired): BeginWrite asks, and waits for
            # its answer, on the executor (the step's end hands the chunk over).
            with self._lock:
                rec.put_back()
            return False
        if grant is None:
            began = time.monotonic()
            try:
                grant = self.decode.begin_write(conn, rid, rec.seq_len, final, self.integrity)
                with self._lock:
                    self.resend.measured(begin_write=time.monotonic() - began)
            except NotReserved:
                if not self.send_wait_s or rec.resends or rec.rehandshake or \
                        len(rec.posted) > 1:
                    raise  # decode forgot it (restarted, expired): no reservation is coming
                rec.asked = True  # from now on only decode's Offer unparks it
                return self._park(rec)
            except AlreadyLanded:
                if not rec.resends:
                    raise
                self._landed_already(rec)
                return False
        self._check_grant_skip(rec, grant)
        # Integrity: the final chunk's data goes out unnotified, and the request's digest
        # record follows it as one more write of the transfer, notified.
        record = final and self.integrity
        if record:
            self.records.check_mailbox(conn, grant)
        with self._lock:
            snap = self.table.get(rid)
            if snap is None or snap.state.terminal:
                return False  # aborted or timed out meanwhile: nothing posted, decode is told
            if snap.state is TransferState.BOOTSTRAPPING:  # one push to the engine, not two
                self.table.advance(rid, TransferState.TRANSFERRING,
                                   through=(TransferState.WAITING_FOR_INPUT,))
            elif snap.state is TransferState.WAITING_FOR_INPUT:  # it waited for decode
                self.table.advance(rid, TransferState.TRANSFERRING)
            else:
                self.table.touch(rid)
            rec.transfer_id = grant.transfer_id
            src_sel, dst_sel = self._select_pages(rec, grant.indices, ranges, final)
        plan = build_plan(self.layout, self.pools.buffer_addrs(), src_sel,
                          conn.peer.layout, conn.addrs, dst_sel, include_states=final,
                          src_draft=rec.src_draft, dst_draft=grant.draft)
        self.table.extend(rid, self.transfer_budget(plan.total_bytes))
        blocks = plan.blocks
        if self.faults is not None:  # test-only hooks (--enable-fault-injection)
            self.faults.slow_wire()
            blocks = self.faults.aim(rid, conn.link, conn.peer.endpoint, blocks)
        # Integrity: the digest pool digests the source while the writes go out (the
        # source does not change while the request lives); the record follows them. Digests
        # with nothing to overlap (a small request's job runs inline on this thread; a
        # resend's are kept) put the record at the end of the data's own write (one
        # transfer, one completion); else it is one more write once the job is done.
        job = self._digest_job(rec, conn) if record and rec.digests is None else None
        together = record and (job is None or job.inline)
        separate = record and not together
        # The writes: each marked sub-batch (its own notified write), then the rest.
        writes = self._sub_batches(rec, conn, grant, plan, blocks) if record else []
        marks = len(writes)
        # The sub-batches run from the first block on: the last part is what follows.
        writes.append((grant.transfer_id,
                       blocks.slice(sum(len(b) for _, b in writes), len(blocks))))
        with self._lock:
            if self._ended(rec):
                return False
            if record:
                self.records.take(rec, len(self.layout.flat_buffers))
            for tid, part in writes:
                self._writes[(conn.link.id, tid)] = rid
                rec.write_keys.add((conn.link.id, tid))
                rec.pending_bytes.append(part.total_bytes)
            rec.attempt_link = conn.link.id
            # The record's write is counted now: no Success (nor drain) before it completed.
            rec.outstanding += len(writes) + separate
            if separate:
                rec.pending_bytes.append(0)  # the record: not the request's bytes
            rec.bytes_total += plan.total_bytes
            # Before posting: the completion may arrive before write() returns.
            rec.final_posted = rec.final_posted or final
        if self.faults is not None:  # test-only hook (--enable-fault-injection)
            self.faults.break_link(rid, conn.link)
        posted = 0
        try:
            for tid, part in writes[:-1]:  # the marks: decode digests each as it lands
                conn.link.write(tid, part, notify=True)
                posted += 1
            tid, part = writes[-1]
            if together:  # the record is the data write's last block
                part = Blocks.concat([part, self._record_blocks(rec, conn, grant, job, marks)])
            conn.link.write(tid, part, notify=final and not separate)
        except Exception as exc:
            left = writes[posted:]
            with self._drained:  # only what was not posted: the rest completes as usual
                rec.outstanding -= len(left) + separate
                for _ in range(len(left) + separate):
                    rec.pending_bytes.pop()
                rec.bytes_total -= sum(b.total_bytes for _, b in left)
                rec.final_posted = rec.final_posted and not final
                self.records.give(rec)
                self._drained.notify_all()
            raise NotPosted(exc) from exc
        log.info("request %s: posted %s%d bytes in %d blocks to %s%s", rid,
                 "final chunk, " if final else "chunk, ", plan.total_bytes, plan.num_blocks,
                 conn.control_address,
                 f" ({marks} sub-batches marked before the last)" if marks else "",
                 extra=fields(rid, rec.decode_address))
        if not separate:
            return False
        if inline:  # the digests are still being computed: waited for on the executor
            self.io.submit(self._record_on_executor, rec, conn, grant, job, marks)
            return False
        self._post_record(rec, conn, grant, job, marks)
        return False

    def use_staging(self, area: RecordArea) -> None:
        """The daemon's staging slots for digest records (registered LOCAL) from now on."""
        with self._lock:
            self.records.use(area)

    def _record_blocks(self, rec: Outgoing, conn: PeerConn, grant: WriteGrant,
                       job: DigestJob | None, marks: int = 0) -> Blocks:
        """The request's digest record as the block that writes it into decode's mailbox
        (:meth:`RecordStager.blocks`). ``job``: the digests, started on the digest pool
        before the data was posted (the source does not change while the request lives);
        computed once per request, a resend writes the same digests with its new
        transfer id. Outside every lock, on the step's thread (it may wait for the pool)."""
        if rec.digests is None:
            rec.digests = (job or self._digest_job(rec, conn)).result()
        return self.records.blocks(rec, conn, grant, rec.digests, marks, self.faults)

    def _digest_job(self, rec: Outgoing, conn: PeerConn) -> DigestJob:
        """The request's digests of what it moves to ``conn``'s decode, started on the
        digest pool (the bytes of each item that decode's layout takes)."""
        return self.digest_pool.digests(self.pools, rec.moved_source, draft=rec.src_draft,
                                        windows=side_windows(self.layout, conn.peer.layout,
                                                             source=True))

    def _sub_batches(self, rec: Outgoing, conn: PeerConn, grant: WriteGrant,
                     plan: TransferPlan, blocks: Blocks) -> list[tuple[int, Blocks]]:
        """The marked sub-batches of a request written whole in this final chunk (its
        record follows), as (mark's transfer id, blocks); empty when decode advertised
        no sub-batch size or the request moves less than two (pools/sub_batches.py).
        Cut where decode cuts: at its buffers' bytes, from decode's layout and the
        grant's lists, so each mark's buffers are exactly those decode digests."""
        peer = conn.peer.layout
        n = len(peer.flat_buffers)
        # Under two sub-batches there is nothing to cut (the usual small request: no per-
        # buffer sums on its path; a record of no marks is always decode's answer too).
        if (not conn.sub_batch_bytes or plan.total_bytes < 2 * conn.sub_batch_bytes
                or len(rec.posted) != 1 or len(plan.heads) != n
                or len(blocks) != plan.num_blocks or grant.transfer_id & MAX_MARKS):
            return []  # (an id with mark bits set is no protocol 6 grant: no marks)
        at = cuts(buffer_bytes(peer, grant.indices, grant.draft), conn.sub_batch_bytes)
        starts = plan.starts.tolist()
        out = []
        for k in range(1, len(at) + 1):
            lo, hi = bounds(at, k, n)
            out.append((mark_id(grant.transfer_id, k), blocks.slice(starts[lo], starts[hi])))
        return out

    def _post_record(self, rec: Outgoing, conn: PeerConn, grant: WriteGrant,
                     job: DigestJob | None, marks: int) -> None:
        """Post the request's digest record once its digests are done (they were computed
        while the data writes went out); raises :class:`NotPosted` when the post fails.
        ``marks``: the sub-batches notified before it."""
        try:
            conn.link.write(grant.transfer_id,
                            self._record_blocks(rec, conn, grant, job, marks), notify=True)
        except Exception as exc:
            with self._drained:
                rec.outstanding -= 1
                rec.pending_bytes.pop()
                rec.final_posted = False  # no Success without the record's write
                self.records.give(rec)
                self._drained.notify_all()
            raise NotPosted(exc) from exc

    def _record_on_executor(self, rec: Outgoing, conn: PeerConn, grant: WriteGrant,
                            job: DigestJob | None, marks: int) -> None:
        """:meth:`_post_record` for a step that ran inline (it ended once the data was
        posted; the record's write is counted, so nothing ends the request meanwhile)."""
        try:
            self._post_record(rec, conn, grant, job, marks)
        except Exception as exc:
            self._failed_step(rec, conn, exc)

    def _resend_after(self, rec: Outgoing, conn: PeerConn, exc: BaseException) -> bool:
        """A write of the request could not be posted: a link that cannot take writes is
        lost (its requests are resent on a new one). True when this request's resend is
        pending (the step then ends without failing it)."""
        if isinstance(exc, TransportError) and not isinstance(exc, RegionError):
            self.on_peer_lost(conn, f"link unusable: {exc}", gone=False)
            with self._lock:
                return rec.resend_cause is not None
        return False

    def _waits_for_offer(self, rec: Outgoing, conn: PeerConn, final: bool) -> bool:
        """Whether a single-chunk Send with no offer waits for decode's Offer first (in
        its step: its one chunk taken)."""
        return final and len(rec.posted) == 1 and self._may_wait_for_offer(rec, conn)

    def _may_wait_for_offer(self, rec: Outgoing, conn: PeerConn) -> bool:
        """Whether the request may wait for decode's Offer rather than ask BeginWrite:
        ``--send-wait-s`` on, never asked, no resend or new handshake, and its decode
        answering heartbeats."""
        return (bool(self.send_wait_s) and not rec.asked and not rec.resends
                and not rec.rehandshake and not conn.missed_heartbeats)

    def periodic(self) -> None:
        """The sweep's work, and the BeginWrite fallback of Sends that waited for an
        Offer OFFER_GRACE_S in vain (decode reserved before the daemons connected)."""
        now = time.monotonic()
        self._execute(self.sweep(now))  # abandon hung writes, forget what ended
        with self._lock:
            due = [r for r in self._out.values()
                   if r.step is Step.PARKED and not r.asked
                   and now - r.parked_at >= OFFER_GRACE_S]
            for rec in due:
                rec.asked = True
        for rec in due:
            self._unpark(rec.request_id)

    def _park(self, rec: Outgoing) -> bool:
        """The Send came first: its step puts the chunk back, and once the step ends the
        request waits in WaitingForInput for decode's reservation (its Offer unparks it,
        :meth:`offer`) or until ``send_wait_s`` passes (a timeout). True (the step's
        outcome: it parks)."""
        with self._lock:
            if not self._ended(rec):
                rec.put_back()  # taken again once decode reserved
        return True

    def _lease_parked(self, rec: Outgoing) -> None:
        """A request parked: WaitingForInput, for at most ``send_wait_s`` (under ``_lock``)."""
        rid = rec.request_id
        snap = self.table.get(rid)
        if snap is not None and snap.state is TransferState.BOOTSTRAPPING:
            self.table.advance(rid, TransferState.WAITING_FOR_INPUT)
        self.table.lease(rid, self.send_wait_s,
                         "decode's reservation: the Send came first and decode's engine "
                         "did not reserve the request within --send-wait-s")

    def _after_park(self, rec: Outgoing) -> None:
        """Once parked (no lock held): an Offer that came meanwhile unparks it now."""
        rid = rec.request_id
        log.debug("request %s: waiting up to %.1f s for decode's reservation (%s)",
                  rid, self.send_wait_s, "decode has none yet" if rec.asked else "its Offer",
                  extra=fields(rid, rec.decode_address))
        if self.offers.has(rid):  # the Offer raced the park (or the refused BeginWrite)
            self._unpark(rid)

    def _unpark(self, request_id: str) -> None:
        """Decode's reservation arrived for a parked request: write it now."""
        with self._lock:
            rec = self._out.get(request_id)
            if rec is None or rec.step is not Step.PARKED:
                return  # not waiting (a step that parks looks for the offer as it ends)
            if self._ended(rec):
                rec.move(Step.IDLE)
                return
            rec.unpark()
        self._start_step(rec)

    def _check_grant_skip(self, rec: Outgoing, grant: WriteGrant) -> None:
        """Decode's ``kv_skip`` (untrusted: from the peer) fits this request's source:
        its engine's lists, a layout of KV pages alone, a page left to move, and the
        same in every grant of the request (a resend's, a later chunk's)."""
        try:
            check_kv_skip("prefill", self.spec, self.layout, grant.kv_skip, rec.seq_len,
                          lists=rec.src_slot < 0)
        except BadKvSkip as exc:
            raise SendFailed(FailureReason.INVALID_REQUEST, f"decode's grant: {exc}") from None
        with self._lock:
            if rec.kv_skip is None:
                rec.kv_skip = grant.kv_skip
            elif rec.kv_skip != grant.kv_skip:
                raise SendFailed(FailureReason.INVALID_REQUEST,
                                 f"decode's grant: kv_skip {grant.kv_skip} differs from the "
                                 f"{rec.kv_skip} of its earlier grant for this request")

    def _select_pages(self, rec: Outgoing, dst: IndexLists, ranges: Ranges,
                      final: bool) -> tuple[IndexLists, IndexLists]:
        """This chunk's KV pages (not sent before, and not among the ``kv_skip`` leading
        pages decode holds); the states go with the final chunk. Decode's KV_PAGES list
        starts at position ``kv_skip`` of the request's."""
        page = self.spec.page_size
        skip = rec.kv_skip or 0
        want = np.zeros_like(rec.sent_pages)
        if final:
            want[:] = True
        for start, end in ranges:
            want[start // page: -(-end // page)] = True
        want[:skip] = False
        want &= ~rec.sent_pages
        reserved = len(dst[IndexKind.KV_PAGES])
        if not skip and reserved == len(want) and bool(want.all()):
            rec.sent_pages |= want
            return rec.src_indices, dst  # the usual single-chunk request: no mask copies
        if reserved != len(want) - skip:
            held = f" from position {skip} (kv_skip)" if skip else ""
            left = f" (so {len(want) - skip} to move)" if skip else ""
            raise SendFailed(FailureReason.INVALID_REQUEST,
                             f"decode reserved {reserved} KV pages{held}, prefill has "
                             f"{len(want)}{left}")
        rec.sent_pages |= want
        src, dst_sel = dict(rec.src_indices), dict(dst)
        src[IndexKind.KV_PAGES] = rec.src_indices[IndexKind.KV_PAGES][want]
        dst_sel[IndexKind.KV_PAGES] = dst[IndexKind.KV_PAGES][want[skip:]]
        return src, dst_sel
