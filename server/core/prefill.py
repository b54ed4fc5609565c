"""Prefill's core: every request's books in one record, events in, actions out.

Send queues a chunk of a request; its step handshakes with the decode daemon if needed
(Bootstrapping; one handshake per address, later requests wait for it), takes
decode's offer of the reservation or, without one, asks decode where to write with
BeginWrite (WaitingForInput -> Transferring; :mod:`kvbeam.server.core.offers`), plans
against decode's indices and posts the writes; the final chunk carries the states and
the completion notification, and with integrity on its last write is the request's
digest record, into decode's mailbox, which the notification follows
(:mod:`kvbeam.server.core.prefill_record`; the digests are computed while the data
writes are in flight). A request is Success once every write completed. A request
never ends (Success or Failed) while a write that reads its source may still be in
flight: decode is told of a failure only once the request's writes drained, or once
its link is released (the sweep abandons writes that do not drain in time).

:class:`PrefillCore` does no I/O: every call is an event (an API call, decode's offer,
a handshake's or a BeginWrite's answer, a post's outcome, a transport event, the
sweep's time) and returns the actions its driver does
(:mod:`kvbeam.server.core.prefill_actions`: connect, ask for a grant, post writes,
tell decode, drop a link, run a step, count). It holds no executor, no peer client,
no digest pool and no clock (``now`` is an argument), and takes no lock: the daemon's
loop is its one caller (another thread's event is handed to the loop). The driver,
:class:`~kvbeam.server.core.prefill_driver.PrefillDriver`, is what the daemon calls.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
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
from kvbeam.logs import fields, request_log
from kvbeam.pools.engine_indices import ListLike, check_kv_skip, same_lists, validate
from kvbeam.pools.mailbox import RecordArea
from kvbeam.pools.plan import TransferPlan, build_plan
from kvbeam.pools.sub_batches import (
    MAX_MARKS,
    bounds,
    buffer_bytes,
    complete_parts,
    cuts,
    mark_id,
    part_blocks,
)
from kvbeam.pools.types import INDEX_KINDS, IndexKind
from kvbeam.server.core.actions import Count, DropLink, RecordRef
from kvbeam.server.core.base import CoreBase
from kvbeam.server.core.chunks import Chunk, Rect, unwritten
from kvbeam.server.core.offers import Offer, OfferBook
from kvbeam.server.core.outgoing import EarlyDigests, Outgoing, Ranges, Step
from kvbeam.server.core.ports import IndexLists, WriteGrant
from kvbeam.server.core.prefill_actions import (
    Actions,
    AskGrant,
    Booked,
    Connect,
    DigestInputs,
    PostWrites,
    RunStep,
    TellDecode,
)
from kvbeam.server.core.prefill_events import PrefillEvents, after_resends
from kvbeam.server.core.prefill_pieces import Pieces
from kvbeam.server.core.prefill_record import RecordStager
from kvbeam.server.core.resend import ResendPolicy
from kvbeam.server.state.lifecycle import TransferTable
from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.states import FailureReason, TransferFacts, TransferState, TransferStatus
from kvbeam.transport.blocks import Blocks

log = logging.getLogger(__name__)
#: A request in one of these states takes no Offer (:meth:`PrefillCore.offer`).
_ENDED = frozenset({TransferState.SUCCESS, TransferState.FAILED})
#: Seconds a Send that found no offer waits for decode's Offer before it asks with
#: BeginWrite (decode may have reserved before the two daemons were connected, and then
#: made no offer). Checked by the sweep (SWEEP_S, 0.2 s), so it is at least that.
OFFER_GRACE_S = 0.05

#: Aborts from decode of a request prefill has no Send of yet (decode declined it before
#: prefill's engine sent it) kept so that Send fails at once: at most this many, each
#: for ``send_wait_s`` (what the Send would otherwise wait).
MAX_EARLY_ABORTS = 1024
#: A request of at most this many KV pages whose step cannot block (decode's offer in
#: hand, its connection up) may run its step on the thread that made it ready: the
#: engine channel's (its Send) or the peer channel's (decode's Offer), not on the
#: executor: one thread hand-off less per request. Larger requests plan for longer than
#: a frame-reading thread should be held.
INLINE_STEP_MAX_PAGES = 64
#: A request sent in pieces (layer by layer, chunk by chunk) asks decode's grant with
#: BeginWrite for its first piece, once decode reserved it (the piece waits for
#: decode's Offer as a whole Send does); a later piece on the same link writes under
#: that grant while it is younger than this, and asks again (renewing it) once it is
#: older.
#: The asks are decode's sign of progress (each restarts its Transferring deadline):
#: at most one a second keeps that deadline alive for a request streamed over a long
#: forward, while the pieces of a forward shorter than this (a GPU's) cost one round
#: trip, not one per layer.
GRANT_RENEW_S = 1.0


def _bound(request_id: str, conn: PeerConn) -> None:
    """The per-request line of a Send that named no decode, bound to the decode that
    offered it (``--log-requests``)."""
    request_log.info("request %s: decode %s at %s reserved it: sending there", request_id,
                     conn.instance_id, conn.control_address,
                     extra=fields(request_id, conn.control_address))


class PrefillCore(PrefillEvents, CoreBase):
    """All of prefill's request state, events in and actions out (see the module).

    Args:
        table: the lifecycle table (the single state vocabulary).
        peers: the peer registry (connections to decode daemons).
        drain_s: how long a failed request's writes may stay in flight before its
            link is released.
        transfer_budget: seconds Transferring allows for a number of bytes (the
            deadline grows with the request, see ``DaemonSettings.transfer_budget_s``).
        resend_retries: resends of a request after a transient transport error
            (:mod:`kvbeam.server.core.resend`; 0: fail at once).
        max_offers: the most reservations decode offered that are kept unused
            (:mod:`kvbeam.server.core.offers`).
        send_wait_s: how long a Send that found no reservation on decode waits for it
            (WaitingForInput, its source pages held) before it fails with a timeout;
            0: it fails at once, as before the engine channel.
        staging_slots: the digest records' staging slots of an area of its own, until
            the daemon gives its registered one (:meth:`use_staging`; tests: never).

    Its pools come with :meth:`take_pools` (the daemon's own at start, or an engine's
    at attach); until then every path that would touch memory refuses.
    """

    role = "prefill"

    def __init__(self, *, table: TransferTable, peers: Peers, integrity: bool,
                 drain_s: float, transfer_budget: Callable[[int], float] = lambda _n: 0.0,
                 resend_retries: int = 0, max_offers: int = 1024, send_wait_s: float = 0.0,
                 staging_slots: int = 256) -> None:
        self.table = table
        self.peers = peers
        self.integrity = integrity
        self.drain_s = drain_s
        self.transfer_budget = transfer_budget
        #: When a request whose link failed is resent (server/core/resend.py).
        self.resend = ResendPolicy(resend_retries)
        self.offers = OfferBook(max_offers)  # decode's reservations ahead of Send
        self.send_wait_s = send_wait_s
        #: The digest records' staging slots.
        self.records = RecordStager(staging_slots)
        #: The events of Abort handlers (off the loop) waiting for a request's writes to
        #: drain, by request id: set once they drained (setting one never blocks).
        self._drain_waiters: dict[str, list[threading.Event]] = {}
        self._out: dict[str, Outgoing] = {}
        self._writes: dict[tuple[int, int], str] = {}
        self._connecting: dict[str, list[Outgoing]] = {}
        #: Decode's aborts that came before the request's Send: id -> (expiry, detail).
        self._early_aborts: dict[str, tuple[float, str, FailureReason]] = {}
        #: Requests that ended before their final chunk came and whose record the sweep
        #: forgot: a further chunk of one is answered with its status (while the table
        #: still knows it), as when the record is kept. Pruned by the sweep.
        self._ended_unfinished: set[str] = set()

    def _record(self, ref: RecordRef) -> Outgoing | None:
        """The record ``ref`` names, while prefill keeps it (None: forgotten, and maybe
        replaced by a newer request of the same id, which ``ref`` does not name)."""
        rec = self._out.get(ref.request_id)
        return rec if rec is not None and rec.ref == ref else None

    def drained(self, ref: RecordRef) -> bool:
        """No write of the request can still read its source (True once forgotten)."""
        rec = self._record(ref)
        return rec is None or rec.drained

    def watch_drain(self, ref: RecordRef) -> threading.Event | None:
        """An event set once the request's writes drained, for a waiter off the loop
        (the driver's Abort handler); None when they drained already."""
        if self.drained(ref):
            return None
        event = threading.Event()
        self._drain_waiters.setdefault(ref.request_id, []).append(event)
        return event

    def unwatch_drain(self, ref: RecordRef, event: threading.Event) -> None:
        """The waiter of ``event`` stopped waiting (its bound passed)."""
        waiters = self._drain_waiters.get(ref.request_id)
        if waiters is not None and event in waiters:
            waiters.remove(event)
            if not waiters:
                del self._drain_waiters[ref.request_id]

    # ---- API ---------------------------------------------------------------------------
    def send(self, request_id: str, seq_len: int, decode_address: str, ranges: Ranges,
             final: bool, *, indices: Mapping[IndexKind, ListLike] | None = None,
             draft: Mapping[IndexKind, ListLike] | None = None,
             kv_offset: int | None = None, layers: int | None = None,
             now: float) -> Actions:
        """Queue (a chunk of) a request for decode: the actions start its step (or none:
        a step runs, or it parks); its status is :meth:`status`.

        ``indices`` (and ``draft``, the draft's own lists) are the source lists of the
        whole request (docs/indices.md: the engine's, or a gRPC Send's source slot's,
        which the API turns into that slot's lists), validated here before anything is
        queued; the first chunk gives them, a further chunk omits them or repeats them
        unchanged. With ``kv_offset`` (the engine channel's
        EXTENDS) they are instead this chunk's piece of the lists, its KV pages from
        that position of the request's KV_PAGES list on, every other list with the
        final chunk (:mod:`kvbeam.server.core.prefill_pieces`); every chunk of such a
        request gives one, and the pages given so far are the pages it makes ready:
        in every layer, or with ``layers`` (LAYERS) in the model's layers ``[0,
        layers)`` only (:mod:`kvbeam.server.core.chunks`).

        One chunk protocol: a chunk makes the request's KV pages ``[0, n)`` ready (the
        final one: all of them, and the other lists). A gRPC Send's ``ranges`` (token
        ranges computed so far) make ready the pages they complete: a page the chunk
        fills only in part goes with a later chunk, once it is whole.
        """
        if kv_offset is None:
            for start, end in ranges:
                if not 0 <= start < end <= seq_len:
                    raise BadRequest(f"chunk [{start}, {end}) is not inside [0, {seq_len})")
            if not final and not ranges:
                raise BadRequest("a non-final chunk must name its token ranges (chunks)")
        if not decode_address:
            self._check_addressless(request_id, final, kv_offset)
        lists = (validate("prefill", self.spec, self.layout, indices or {}, draft or {}, seq_len)
                 if (indices or draft) and kv_offset is None else None)
        offered_by = self.offers.conn_of(request_id) if not decode_address else None
        if offered_by is not None and offered_by.closed:
            self.offers.drop(request_id)  # its connection went: that decode asks again
            offered_by = None
        if offered_by is not None:
            # Decode's Offer came first: it names the decode (decode-initiated pairing).
            decode_address = offered_by.control_address
            _bound(request_id, offered_by)
        rec = self._out.get(request_id)
        ended = self._ended_before_final(rec, request_id)
        if ended is not None:
            # The request failed (decode's verdict, a lost peer, a deadline) before
            # the engine's last chunk came: not a reuse of its id. The chunk is
            # answered with the request's end, which its caller reads anyway.
            log.info("request %s: a further chunk came after it ended (%s): answered "
                     "with its status", request_id, ended.state.value,
                     extra=fields(request_id, decode_address))
            return []
        early = self._early_aborts.pop(request_id, None) if rec is None else None
        if early is not None and early[0] >= now:
            # Decode declined (or aborted) it before this Send: fail it now, rather
            # than hold the engine's source for the --send-wait-s lease.
            self.table.create(request_id, decode_address, now=now)
            self.table.fail(request_id, early[2], early[1], now=now)
            log.warning("request %s failed: decode ended it before its Send: %s",
                        request_id, early[1], extra=fields(request_id, decode_address))
            return []
        if rec is None:
            pieces = None
            if kv_offset is not None:
                pieces = Pieces(request_id, self.spec, self.layout, seq_len)
                whole = pieces.add(kv_offset, final, indices or {}, draft or {}, layers)
                lists = whole or ({**{k: np.zeros(0, dtype=np.int64) for k in INDEX_KINDS},
                                   IndexKind.KV_PAGES: pieces.kv_pages}, {})
            if lists is None:
                raise BadRequest(f"request {request_id}: its first chunk names no source "
                                 "lists (the engine's index lists; over gRPC, or a "
                                 "source_slot)")
            src, src_draft = lists
            self.table.create(request_id, decode_address, now=now)
            rec = Outgoing.start(request_id, seq_len, decode_address, src,
                                 src_draft=src_draft, pieces=pieces)
            self._out[request_id] = rec
            if offered_by is not None:
                rec.conn = offered_by
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
                whole = rec.pieces.add(kv_offset, final, indices or {}, draft or {}, layers)
                if whole is not None:
                    rec.src_indices, rec.src_draft = whole
                indices = draft = None  # taken: not compared with the first's below
            same = lists is None or (same_lists(lists[0], rec.src_indices)
                                     and same_lists(lists[1], rec.src_draft))
            if (rec.seq_len, rec.decode_address) != (seq_len, decode_address) or not same:
                raise BadRequest(f"request {request_id}: a further chunk must keep "
                                 "the index lists (or source slot), seq_len and decode "
                                 "address of the first")
        start_step = rec.queue(self._chunk(rec, ranges, final))
        if final:
            rec.final_came(now)
        park = start_step and self._parks_at_once(rec)
        if park:
            rec.park(now)  # decode's Offer starts its step
            self._lease_parked(rec, now)
        elif start_step:
            rec.move(Step.RUNNING)
        if park:
            return self._after_park(rec)
        return [RunStep(rec.ref)] if start_step else []

    def offer(self, request_id: str, instance_id: str, seq_len: int, grant: WriteGrant,
              lease_s: float, now: float) -> tuple[bool, Actions]:
        """Decode offers a reservation ahead of Send: whether it is kept, and the actions
        (its count; the step of a Send that came first and waits for it).

        Not kept when the book is full or the request already writes (its Send came
        first and asked with BeginWrite), nor for a request that already ended here:
        one that failed (its Send's wait for decode ran out before decode reserved,
        say) is told to decode at once with an Abort, so decode's reservation fails now
        instead of at its deadline; its writes, if any, have drained (else the drain
        tells decode). Raises NotHandshakenError when ``instance_id`` is not a
        connected decode peer.
        """
        conn = self.peers.get(instance_id)
        if conn is None or conn.closed:
            raise NotHandshakenError(f"no connection to decode instance {instance_id!r}")
        if self.table.state_of(request_id) in _ENDED:
            return False, self._offer_after_end(request_id, conn)
        rec = self._out.get(request_id)
        # Late: the request already writes under a grant (BeginWrite's), or posted a
        # chunk. A Send whose first step is still asking BeginWrite is not late: decode
        # may refuse that one (no reservation yet: it parks), and this offer unparks it.
        late = rec is not None and (
            rec.transfer_id is not None or rec.attempt.bytes_total > 0
            or len(rec.attempt.posted) > 1 or bool(rec.resends))
        kept = not late and self.offers.put(
            Offer(request_id, conn, seq_len, grant, now + lease_s), now)
        bound = self._bind_to_offer(request_id, conn, kept)
        actions: Actions = [Count("offers", "received" if kept else "refused")]
        if kept or bound:
            actions += self._unpark(request_id)  # a Send that came first waits for this
        return kept, actions

    def _check_addressless(self, request_id: str, final: bool, kv_offset: int | None) -> None:
        """A Send that names no decode (decode-initiated pairing: the decode whose Offer
        names the request gets it) is one final chunk, and waits for that Offer under
        ``send_wait_s``.

        Raises:
            FrameError: a chunked Send, or ``send_wait_s`` is 0 (field decode_address).
        """
        if not final or kv_offset is not None:
            raise FrameError("decode_address", "empty (the decode whose reservation names "
                             "the request gets it) needs the whole request in one final "
                             "SEND; name the decode to send in chunks", request_id)
        if not self.send_wait_s:
            raise FrameError("decode_address", "empty needs --send-wait-s above 0: such a "
                             "SEND waits for the Offer of the decode that reserves it",
                             request_id)

    def _bind_to_offer(self, request_id: str, conn: PeerConn, kept: bool) -> bool:
        """A parked Send that named no decode goes to the decode that offered it (its
        connection and address, from now on as if the engine had named it); True when
        it was bound now. An offer not kept (the book was full) binds it too: its step
        asks that decode with BeginWrite."""
        rec = self._out.get(request_id)
        if rec is None or rec.decode_address or self._ended(rec):
            return False
        rec.decode_address = conn.control_address
        rec.conn = conn
        if not kept:
            rec.asked = True
        self.table.set_peer(request_id, conn.control_address)
        _bound(request_id, conn)
        return True

    def _bound_by_offer(self, rec: Outgoing) -> bool:
        """A step of a Send that names no decode: bound to the decode whose offer is in
        the book (an Offer the step's start raced), or, with none usable, not (an offer
        over a connection that closed is dropped: the step parks, not loops)."""
        conn = self.offers.conn_of(rec.request_id)
        if conn is not None and not conn.closed:
            return self._bind_to_offer(rec.request_id, conn, kept=True)
        self.offers.drop(rec.request_id)
        return False

    def _offer_after_end(self, request_id: str, conn: PeerConn) -> Actions:
        """Decode offered a reservation for a request that ended here: refused (counted),
        and, when it failed and none of its writes is in flight, decode is told (an
        Abort, best effort) so its reservation does not wait for its deadline. A
        Success is only refused: its bytes went, under an earlier grant."""
        snap = self.table.get(request_id)
        # A parked Send that ended goes idle (as any Offer finds it): nothing starts.
        actions: Actions = [*self._unpark(request_id), Count("offers", "refused")]
        rec = self._out.get(request_id)
        drained = rec is None or rec.drained
        if snap is None or snap.state is not TransferState.FAILED or not drained:
            log.info("request %s: decode %s offered a reservation after the request "
                     "ended here (%s): refused", request_id, conn.control_address,
                     snap.state.value if snap else "forgotten",
                     extra=fields(request_id, conn.control_address))
            return actions
        reason = snap.reason.value if snap.reason is not None else "failed"
        log.info("request %s: decode %s offered a reservation after the request failed "
                 "here: refused, and decode told", request_id, conn.control_address,
                 extra=fields(request_id, conn.control_address))
        return [*actions, TellDecode(conn, conn.control_address, request_id,
                                     f"prefill failed before decode reserved: {reason}: "
                                     f"{snap.detail}")]

    @staticmethod
    def _held_grant(rec: Outgoing, conn: PeerConn, now: float) -> WriteGrant | None:
        """The grant an earlier piece of this attempt asked for, if the next piece may
        write under it: the same link (a new link, or a resend's new attempt, asks
        again) and younger than ``GRANT_RENEW_S``. Decode keeps what it granted until
        the request ends, and an end stops the request here before its next step
        (decode's Abort, answered once its writes drained), so no piece writes into
        pages decode let go."""
        attempt = rec.attempt
        if attempt.grant is None or attempt.grant_link != conn.link.id \
                or now - attempt.granted_at >= GRANT_RENEW_S:
            return None
        return attempt.grant

    def _offered_grant(self, rec: Outgoing, conn: PeerConn, final: bool,
                       now: float) -> tuple[WriteGrant | None, Actions]:
        """Decode's offer for this step, if one is usable (else BeginWrite asks), and
        the count of its use or miss.

        Used for the first step of a request that is not a resend (a resend needs a
        new transfer id on its new link: BeginWrite) when that step writes the whole
        request: its one chunk, or the pieces that waited for the Offer once the last
        of them came. A first piece that is not the last asks with BeginWrite even with
        the offer in hand (its offer is dropped): decode sees no piece landing unless
        it is marked, so only the ask moves decode's request to Transferring while the
        prompt is still computed. Later pieces write under that grant
        (:meth:`_held_grant`).
        """
        had = self.offers.has(rec.request_id)
        offer = self.offers.take(rec.request_id, conn, rec.seq_len, now)
        if had and offer is None:
            rec.asked = True  # decode offered, but not this (expired, other link): ask now
        if not self._first_step(rec):
            return None, []
        if offer is not None and not final:
            rec.asked = True  # decode reserved: the first piece asks, as said above
            return None, []
        if offer is None and self._waits_for_offer(rec, conn):
            return None, []  # it waits for the Offer (counted "used" when that comes)
        count = Count("offers", "used" if offer is not None else "missed")
        return (offer.grant if offer is not None else None), [count]

    @staticmethod
    def _first_step(rec: Outgoing) -> bool:
        """Whether the step under way is the request's first (its one chunk taken),
        not a resend's."""
        return len(rec.attempt.posted) == 1 and not rec.resends

    def _parks_at_once(self, rec: Outgoing) -> bool:
        """Whether a fresh Send (the whole request or its first piece) would only park
        (no offer yet, its decode connected: its step would wait for the Offer): it
        parks here, at once, and decode's Offer starts its step (no executor job that
        only parks). The step's own test is :meth:`_waits_for_offer`."""
        if rec.attempt.posted or rec.step is not Step.IDLE:
            return False
        if self.offers.has(rec.request_id):
            return False  # the Offer came first: the step writes at once
        if not rec.decode_address:
            return True  # no decode named: the one whose Offer names the request
        conn = self.peers.by_address(rec.decode_address)
        if conn is None or conn.closed or conn.retired_channel() is not None:
            return False  # the step connects (or drops a retired connection) first
        rec.conn = conn
        return self._may_wait_for_offer(rec, conn)

    def abort(self, request_id: str, *, from_peer: bool, detail: str,
              now: float, reason: FailureReason | None = None
              ) -> tuple[RecordRef, str] | None:
        """Fail the request (an Abort's first half): its record's ref and the failure's detail,
        None when prefill keeps no record of it. The driver then waits a little for its
        writes to drain and calls :meth:`abort_answered`.

        ``from_peer``: decode reports its verdict (reason peer_failed, or ``reason``:
        incompatible when the pair's handshake was refused; decode needs no Abort back).
        The driver took it only from the request's own decode.
        """
        self.offers.drop(request_id)
        rec = self._out.get(request_id)
        if rec is not None and from_peer:
            rec.told_decode = True  # decode asked: it knows
        if rec is None and from_peer and self.send_wait_s and self.table.get(request_id) is None:
            self._remember_early_abort(request_id, detail or "aborted by decode", now,
                                       reason or FailureReason.PEER_FAILED)
        if rec is None:  # ended and pruned, or never seen (the driver's status raises)
            snap = self.table.get(request_id)
            if from_peer and snap is not None and snap.state is TransferState.SUCCESS:
                # Decode's verdict came after the sweep pruned our Success record.
                self._late_verdict(request_id, detail, snap.peer)
            return None
        reason = reason or (FailureReason.PEER_FAILED if from_peer else FailureReason.ABORTED)
        detail = after_resends(detail or ("aborted by decode" if from_peer else "aborted"),
                               rec.resends, rec.first_failure)
        if self.table.fail(request_id, reason, detail, now=now):
            log.warning("request %s failed: %s: %s", request_id, reason.value, detail,
                        extra=fields(request_id, rec.decode_address))
        elif from_peer:
            self._late_verdict(request_id, detail, rec.decode_address)
        return rec.ref, detail

    def abort_answered(self, ref: RecordRef, *, from_peer: bool, drained: bool,
                       detail: str) -> Actions:
        """The Abort's answer is going (``drained``: none of the request's writes is in
        flight, which the answer says): decode is told now, or once they drained."""
        rec = self._record(ref)
        if rec is None:
            return []  # forgotten meanwhile: it drained and decode was told
        if from_peer and not drained:
            rec.told_decode = False  # our answer says "in flight": tell it once drained
            log.info("request %s: %d write(s) still in flight when decode's Abort was "
                     "answered; decode is told once they drained", rec.request_id,
                     rec.attempt.outstanding, extra=fields(rec.request_id, rec.decode_address))
        return self._tell_decode_once(rec, f"aborted on prefill: {detail}")

    def decode_of(self, request_id: str) -> tuple[PeerConn | None, str] | None:
        """The connection and decode address of a request prefill keeps (None: none)."""
        rec = self._out.get(request_id)
        return None if rec is None else (rec.conn, rec.decode_address)

    def _ended_before_final(self, rec: Outgoing | None,
                            request_id: str) -> TransferStatus | None:
        """The status of a request that ended before its final chunk was submitted
        (None: it did not, or it is not known)."""
        if rec is None and request_id not in self._ended_unfinished:
            return None
        if rec is not None and rec.final_submitted:
            return None
        snap = self.table.get(request_id)
        if snap is None:
            self._ended_unfinished.discard(request_id)  # forgotten: a new request
            return None
        return snap if snap.state.terminal else None

    def _remember_early_abort(self, request_id: str, detail: str, now: float,
                              reason: FailureReason) -> None:
        """Decode ended a request whose Send has not come (its engine declined it before
        prefill's engine sent it): its Send, if it comes within ``send_wait_s``, fails at
        once. Bounded: the oldest is forgotten first (that Send then waits its lease)."""
        book = self._early_aborts
        for rid in [r for r, (expiry, _, _) in book.items() if expiry < now]:
            del book[rid]
        while len(book) >= MAX_EARLY_ABORTS:
            del book[next(iter(book))]
        book[request_id] = (now + self.send_wait_s, detail, reason)

    def in_flight(self, request_id: str) -> int:
        """Writes of the request that may still read its source (0 once drained)."""
        rec = self._out.get(request_id)
        return 0 if rec is None or rec.drained else rec.attempt.outstanding

    def _facts(self, request_id: str) -> TransferFacts | None:
        rec = self._out.get(request_id)
        return None if rec is None else rec.facts(self._verification(request_id))

    def _verification(self, request_id: str | None) -> str:
        if not self.integrity:
            return "no digests sent: integrity is off on prefill (KVBEAM_INTEGRITY=false)"
        held = self._held
        buffers = f" of {len(held[1].flat_buffers)} buffers" if held is not None else ""
        return f"XXH3-128 digests{buffers} go with its last write; decode checks them"

    def known(self, request_id: str) -> bool:
        """True while the core keeps a record of the request (tests, diagnostics)."""
        return self._out.get(request_id) is not None

    def use_staging(self, area: RecordArea) -> None:
        """The daemon's staging slots for digest records (registered LOCAL) from now on."""
        self.records.use(area)

    # ---- the send path: the step's events ------------------------------------------------
    def steps_inline(self, ref: RecordRef, now: float) -> bool:
        """Whether the request's step cannot block, so the thread that made it ready may
        run it: its decode connected with a live peer channel, and either a later piece
        that writes under its earlier piece's grant (:meth:`_held_grant`), or the first
        step of the first attempt that writes the whole request (its newest chunk is the
        final one: a single chunk, or pieces that waited for the Offer), at most
        ``INLINE_STEP_MAX_PAGES`` KV pages, with decode's offer in hand (no BeginWrite;
        a first piece that is not the last asks, :meth:`_offered_grant`).
        Asked on the loop, where nothing changes it before the step runs; an action of
        the step that blocks after all (a post that fails) goes to the driver's executor."""
        rec = self._record(ref)
        if rec is None or not rec.chunks or rec.rehandshake or rec.resend_owed:
            return False
        conn = self._step_conn(rec)
        if conn is None or conn.closed or conn.retired_channel() is not None:
            return False
        if self._held_grant(rec, conn, now) is not None:
            return True
        small_whole = (rec.chunks[-1].final and not rec.attempt.posted and not rec.resends
                       and len(rec.src_indices[IndexKind.KV_PAGES]) <= INLINE_STEP_MAX_PAGES)
        return small_whole and self.offers.has(rec.request_id)

    def step(self, ref: RecordRef, now: float) -> Actions:
        """Run the request's next chunk (it is RUNNING; one step per request at a time
        keeps chunk order): drop a connection whose peer channel was retired, connect,
        ask for decode's grant, or plan and post."""
        rec = self._record(ref)
        if rec is None:
            return []  # forgotten meanwhile (it ended): no step
        retired = self._retired(rec)
        if retired is not None:
            old, channel = retired
            how = "closed" if channel.orderly else "lost"
            log.info("request %s: the peer channel to %s was %s (%s): dropping that "
                     "connection, the next handshake opens a new one", rec.request_id,
                     channel.peer, how, channel.close_reason,
                     extra=fields(rec.request_id, rec.decode_address))
            # Closed with a BYE (decode released or replaced that connection: its link
            # failed, its engine detached), only the link is gone: decode keeps the
            # reservations and each request on it is resent on the next link while its
            # retries and deadline allow. Closed without one, the peer is lost: its
            # requests fail. The step runs again once the link is released.
            drop = self._drop(old, f"peer channel to {channel.peer} {how}: "
                                   f"{channel.close_reason}", gone=not channel.orderly)
            return [drop, RunStep(rec.ref)]
        if self._ended(rec) or not rec.chunks or rec.resend_owed:
            rec.move(Step.IDLE)
            return self._maybe_resend(rec, now)
        if not rec.decode_address and not self._bound_by_offer(rec):
            return self._park(rec, now)  # no decode yet: its Offer names one
        conn = self._step_conn(rec)
        if conn is None:
            rec.move(Step.CONNECTING)
            waiting = self._connecting.get(rec.decode_address)
            if waiting is not None:
                waiting.append(rec)  # a handshake with that address is under way
                return []
            self._connecting[rec.decode_address] = [rec]
            return [Connect(rec.decode_address)]
        rec.conn = conn
        chunk = rec.take_chunk()
        held = self._held_grant(rec, conn, now)
        if held is not None:
            return self._write(rec, conn, chunk, held, now)
        grant, actions = self._offered_grant(rec, conn, chunk.final, now)
        if grant is None and self._waits_for_offer(rec, conn):
            # Decode's engine reserves on its own daemon, which offers the reservation
            # over the peer link: wait for that instead of asking (no BeginWrite).
            return actions + self._park(rec, now)
        if grant is None:
            return [*actions, AskGrant(rec.ref, rec.seq_len, conn, chunk)]
        return actions + self._write(rec, conn, chunk, grant, now)

    def connected(self, address: str, conn: PeerConn | None, error: Exception | None, *,
                  began: float, now: float) -> Actions:
        """The handshake with ``address`` is done (``conn``) or failed (``error``), begun
        at ``began``: every request waiting for it goes on, or fails."""
        if conn is not None:
            self.resend.measured(handshake=now - began)
            self.peers.add(conn)
        waiters = self._connecting.pop(address, [])
        for rec in waiters:
            rec.conn = conn
            rec.move(Step.RUNNING if error is None else Step.IDLE)
            # Decode had no connection to offer on when it reserved: ask at once.
            rec.asked = True
        actions: Actions = []
        for rec in waiters:
            if error is not None:
                actions += self._step_failed(rec, error, now)
            else:
                actions.append(RunStep(rec.ref))
        return actions

    def granted(self, ref: RecordRef, conn: PeerConn, chunk: Chunk, grant: WriteGrant | None,
                error: Exception | None, *, elapsed: float, now: float) -> Actions:
        """Decode answered the step's BeginWrite (after ``elapsed`` seconds): its
        ``grant``, or ``error`` (no reservation yet: the request parks when it may wait
        for one; landed already: a resend's Success)."""
        rec = self._record(ref)
        if rec is None:
            return []
        if grant is not None:
            self.resend.measured(begin_write=elapsed)
            attempt = rec.attempt
            attempt.grant, attempt.grant_link, attempt.granted_at = grant, conn.link.id, now
            return self._write(rec, conn, chunk, grant, now)
        assert error is not None
        if isinstance(error, NotReserved) and self.send_wait_s and not rec.resends \
                and not rec.rehandshake and len(rec.attempt.posted) <= 1:
            rec.asked = True  # from now on only decode's Offer unparks it
            return self._park(rec, now)
        if isinstance(error, AlreadyLanded) and rec.resends:
            self._landed_already(rec, now)
            return self._end_step(rec, now)
        # Not reserved otherwise: decode forgot it (restarted, expired), none is coming.
        return self._not_written(rec, conn, error, now)

    def _write(self, rec: Outgoing, conn: PeerConn, chunk: Chunk, grant: WriteGrant,
               now: float) -> Actions:
        """Plan the chunk against decode's grant and cut it into writes to post; with
        integrity, the final chunk's digest record follows its data. What fails here
        (decode's grant does not fit, a plan error) fails the step."""
        try:
            post = self._plan(rec, conn, chunk, grant, now)
        except Exception as exc:
            return self._not_written(rec, conn, exc, now)
        return [post] if post is not None else self._end_step(rec, now)

    def _plan(self, rec: Outgoing, conn: PeerConn, chunk: Chunk, grant: WriteGrant,
              now: float) -> PostWrites | None:
        """The chunk's writes (None: nothing to post: the request ended meanwhile, or
        the chunk's pages are all held by decode, ``kv_skip``)."""
        rid = rec.request_id
        final = chunk.final
        self._check_grant_skip(rec, grant)
        rects = self._chunk_rects(rec, grant.indices, chunk)
        if rects is None:
            return None
        # Integrity: the final chunk's data goes out unnotified, and the request's digest
        # record follows it as one more write of the transfer, notified.
        record = final and self.integrity
        if record:
            self.records.check_mailbox(conn, grant)
        # Its engine hears of the move to Transferring once the writes are posted
        # (PostWrites.moved): the push is not on the bytes' way. The plan goes first: a
        # plan that fails (decode's grant does not fit) fails the step with no move.
        moved = None
        state = self.table.state_of(rid)
        if state is None or state.terminal:
            return None  # aborted or timed out meanwhile: nothing posted, decode is told
        rec.transfer_id = grant.transfer_id
        plans = [self._rect_plan(rec, conn, grant, rect, states=final and at == len(rects) - 1)
                 for at, rect in enumerate(rects)]
        rec.attempt.written = chunk
        blocks = plans[0].blocks if len(plans) == 1 else Blocks.concat(
            [plan.blocks for plan in plans])
        if not len(blocks) and not final and not self._marks_due(rec, chunk):
            return None  # the layers it makes ready hold no KV buffer (sliding-window only)
        if state is TransferState.BOOTSTRAPPING:  # one push to the engine, not two
            moved = self.table.advance(rid, TransferState.TRANSFERRING,
                                       through=(TransferState.WAITING_FOR_INPUT,),
                                       announce=False, now=now)
        elif state is TransferState.WAITING_FOR_INPUT:  # it waited for decode
            moved = self.table.advance(rid, TransferState.TRANSFERRING, announce=False,
                                       now=now)
        else:
            self.table.touch(rid, now=now)
        self.table.extend(rid, self.transfer_budget(blocks.total_bytes), now=now)
        # The writes: each marked sub-batch's blocks under its mark's id, then the rest.
        cut = self._cut(rec, conn, grant, chunk, blocks)
        if cut:
            writes, early = self._marked_writes(rec, grant, chunk, plans, cut)
        else:
            writes, early = [(grant.transfer_id, blocks, final)], ()
        digest = None
        if record or early:  # what the driver digests: a copy (it never reads the record)
            digest = DigestInputs(rec.moved_source, rec.src_draft, rec.digests,
                                  dict(rec.early_digests))
        return PostWrites(rec.ref, rec.decode_address, conn, grant, tuple(writes), final,
                          record, len(cut), blocks.total_bytes, len(blocks), moved, early,
                          digest)

    def _rect_plan(self, rec: Outgoing, conn: PeerConn, grant: WriteGrant, rect: Rect, *,
                   states: bool) -> TransferPlan:
        """The plan of one rectangle of the chunk (pages by layers,
        :func:`~kvbeam.server.core.chunks.unwritten`); ``states``: the state components
        too (with the final chunk's last rectangle)."""
        lo, hi, first, last = rect
        src_sel, dst_sel = self._select_pages(rec, grant.indices, lo, hi)
        every = (first, last) == (0, self.layout.num_layers)
        return build_plan(self.layout, self.pools.buffer_addrs(), src_sel, conn.peer.layout,
                          conn.addrs, dst_sel, include_states=states, src_draft=rec.src_draft,
                          dst_draft=grant.draft, layers=None if every else (first, last))

    def book(self, post: PostWrites, *, separate: bool) -> Booked | None:
        """The driver is about to post ``post``'s writes (``separate``: the digest record
        is one more write after them): count them in flight before the first post (a
        completion may arrive before the post returns), and give the request its
        record's staging slot when it posts the record (taken with the writes that hold
        it, so no completion in between gives it back). None: the request ended
        meanwhile, nothing is to be posted (the driver ends the step).

        Raises:
            SendFailed: no staging slot is free (nothing was counted; the driver fails
                the step with it).
        """
        rec, conn = self._record(post.ref), post.conn
        if rec is None or self._ended(rec):
            return None
        if post.record:
            self.records.take(rec, len(self.layout.flat_buffers))
        attempt = rec.attempt
        for tid, part, _notify in post.writes:
            self._writes[(conn.link.id, tid)] = rec.request_id
            rec.write_keys.add((conn.link.id, tid))
            attempt.pending_bytes.append(part.total_bytes)
        attempt.link = conn.link.id
        # The record's write is counted now: no Success (nor drain) before it completed.
        attempt.outstanding += len(post.writes) + separate
        if separate:
            attempt.pending_bytes.append(0)  # the record: not the request's bytes
        attempt.bytes_total += post.total_bytes
        attempt.final_posted = attempt.final_posted or post.final
        return Booked(rec.staging if post.record else None)

    def unbook(self, post: PostWrites, *, left: int, separate: bool) -> None:
        """The last ``left`` writes of ``post`` (and the separate record's, if
        ``separate``) were not posted: they will never complete. What was posted
        completes as usual."""
        rec = self._record(post.ref)
        if rec is None:
            return
        attempt = rec.attempt
        attempt.outstanding -= left + separate
        for _ in range(left + separate):
            attempt.pending_bytes.pop()
        attempt.bytes_total -= sum(b.total_bytes
                                   for _, b, _n in post.writes[len(post.writes) - left:])
        if post.final:
            attempt.final_posted = False  # no Success without the final chunk's writes
        self.records.give(rec)
        self._wake_drained(rec)

    def posted(self, ref: RecordRef, now: float) -> Actions:
        """The step's writes are posted: the step is over."""
        rec = self._record(ref)
        return [] if rec is None else self._end_step(rec, now)

    def step_failed(self, ref: RecordRef, conn: PeerConn, exc: BaseException,
                    now: float) -> Actions:
        """The step's chunk was not written (``exc``, the driver's post failed): as
        :meth:`_not_written`."""
        rec = self._record(ref)
        return [] if rec is None else self._not_written(rec, conn, exc, now)

    def keep_digests(self, ref: RecordRef, digests: bytes) -> None:
        """The request's digests, computed by the driver: kept (a resend's are the same)."""
        rec = self._record(ref)
        if rec is not None:
            rec.keep_digests(digests)

    def keep_digest_jobs(self, ref: RecordRef, jobs: EarlyDigests) -> None:
        """Digest jobs of sub-batches a step made whole, started by the driver: kept."""
        rec = self._record(ref)
        if rec is not None:
            rec.keep_digest_jobs(jobs)

    def _not_written(self, rec: Outgoing, conn: PeerConn, exc: BaseException,
                     now: float) -> Actions:
        """The step's chunk was not written (``exc``): resend it on a new link (a post
        failed), handshake again (decode forgot us) or fail the request; the step ends."""
        actions: Actions = []
        if isinstance(exc, NotPosted):
            cause = exc.cause
            if isinstance(cause, TransportError) and not isinstance(cause, RegionError):
                # A link that cannot take writes is lost: it goes, and its requests are
                # resent on a new one (this one too while its retries allow).
                detail = f"link unusable: {cause}"
                drop = self._drop(conn, detail, gone=False)
                spared = rec.conn is conn and self._note_link_failure(
                    rec, conn.link.id, None, detail)
                actions.append(drop)
                if not spared:
                    actions += self._fail(rec, FailureReason.PEER_FAILED, detail, now)
                return actions + self._end_step(rec, now)
            exc = cause
        if isinstance(exc, SendFailed) and exc.peer_lost:
            actions += self._peer_forgot_us(rec, conn, str(exc), now)
        else:
            actions += self._step_failed(rec, exc, now)
        return actions + self._end_step(rec, now)

    def _end_step(self, rec: Outgoing, now: float, *, parks: bool = False) -> Actions:
        """The step is over: the next chunk's step, a pending resend, or (``parks``: the
        step put its chunk back to wait for decode's reservation) the park; an Offer that
        came while the step ran is in the book, and the step runs again for it."""
        again = rec.step_ended(ended=self._ended(rec), parks=parks,
                               offer_waiting=parks and self.offers.has(rec.request_id),
                               now=now)
        parked = rec.step is Step.PARKED
        if parked:
            self._lease_parked(rec, now)
        if again:
            return [RunStep(rec.ref)]
        if parked:
            return self._after_park(rec)
        return self._maybe_resend(rec, now)

    def _step_conn(self, rec: Outgoing) -> PeerConn | None:
        """The connection the request's next step would use: its own while open, else
        the one to its decode address (None: a handshake first)."""
        conn = rec.conn
        return conn if conn is not None and not conn.closed else \
            self.peers.by_address(rec.decode_address)

    def _retired(self, rec: Outgoing) -> tuple[PeerConn, Any] | None:
        """The connection the request's step would use, with its peer channel, when
        that channel was retired (closed under the connection)."""
        conn = self._step_conn(rec)
        channel = conn.retired_channel() if conn is not None else None
        if conn is None or channel is None or conn.closed:
            return None
        return conn, channel

    def _drop(self, conn: PeerConn, detail: str, *, gone: bool) -> DropLink:
        """Drop a connection: out of the registry now (no step picks it any more), its
        link released by the driver, which then calls :meth:`link_dropped`."""
        self.peers.remove(conn)
        return DropLink(conn, detail, gone=gone)

    def _peer_forgot_us(self, rec: Outgoing, conn: PeerConn, detail: str,
                        now: float) -> Actions:
        """Decode no longer knows our connection (``detail``; it re-attached its engine or
        restarted, and prefill had not noticed yet): drop the connection, failing the
        requests on it. ``rec`` goes on over a new handshake instead, since decode
        refused its first BeginWrite before any byte of it was written; once per request.
        """
        again = (not rec.rehandshake and not rec.resends and rec.attempt.bytes_total == 0
                 and rec.attempt.outstanding == 0 and len(rec.attempt.posted) == 1
                 and not self._ended(rec))
        if again:
            rec.rehandshake = detail
            rec.put_back()  # the next step runs it again
            rec.conn = None  # so the dropped link spares it, and the step handshakes anew
        else:
            rec.told_decode = True  # the peer lost us: there is no one to tell
        drop = self._drop(conn, detail, gone=True)
        if again:
            log.warning("request %s: %s; handshaking again (nothing of it was written)",
                        rec.request_id, detail, extra=fields(rec.request_id, rec.decode_address))
            return [drop]
        return [drop, *self._fail(rec, FailureReason.PEER_FAILED, detail, now)]

    def _cut(self, rec: Outgoing, conn: PeerConn, grant: WriteGrant, chunk: Chunk,
             blocks: Blocks) -> tuple[int, ...]:
        """Where the attempt's writes are cut into marked sub-batches, decided at its
        first step and kept: () when integrity is off, decode advertised no sub-batch
        size, the grant's id has mark bits set (no room for marks) or the request moves
        less than two sub-batches (pools/sub_batches.py). Cut where decode cuts: at its
        buffers' bytes, from decode's layout and the grant's lists, so each mark's
        buffers are exactly those decode digests."""
        attempt = rec.attempt
        if attempt.cut is not None:
            return attempt.cut
        size = conn.sub_batch_bytes
        if (not self.integrity or not size or grant.transfer_id & MAX_MARKS
                or (chunk.final and blocks.total_bytes < 2 * size)):
            # (A request written whole in one chunk under two sub-batches, the usual
            # small one, computes no per-buffer sums on its path.)
            attempt.cut = ()
        else:
            attempt.cut = cuts(buffer_bytes(conn.peer.layout, grant.indices, grant.draft),
                               size)
        return attempt.cut

    def _whole_parts(self, rec: Outgoing, chunk: Chunk, cut: tuple[int, ...]) -> list[int]:
        """The marked sub-batches whose every byte is written once ``chunk`` is."""
        lay = self.layout
        pages = len(rec.src_indices[IndexKind.KV_PAGES])
        done = chunk.whole_layers(pages, lay.num_layers)
        layers: tuple[int, ...] | None = None
        if not chunk.final and 0 < done < lay.num_layers:
            try:
                layers = lay.kv_layers
            except ValueError:
                layers = None  # buffers that name no layer: whole with every layer only
        return complete_parts(cut, layers, len(lay.kv.buffers), done, lay.num_layers,
                              final=chunk.final)

    def _marks_due(self, rec: Outgoing, chunk: Chunk) -> bool:
        """Whether ``chunk`` makes a marked sub-batch whole whose mark is not posted yet
        (a step with no blocks still posts it)."""
        cut = rec.attempt.cut
        return bool(cut) and any(k not in rec.attempt.marked
                                 for k in self._whole_parts(rec, chunk, cut or ()))

    def _marked_writes(self, rec: Outgoing, grant: WriteGrant, chunk: Chunk,
                       plans: list[TransferPlan], cut: tuple[int, ...]
                       ) -> tuple[list[tuple[int, Blocks, bool]], tuple[tuple[int, int], ...]]:
        """The step's writes of a marked request: each sub-batch's blocks under its
        mark's id, notified in the step that makes the sub-batch whole (every earlier
        write of that id on the link comes before its notification: the transports'
        proof of arrival), then the last part's under the grant's id; and the flat
        buffers of the sub-batches made whole before the final chunk (prefill digests
        them at once)."""
        attempt = rec.attempt
        n = len(self.layout.flat_buffers)
        whole = [k for k in self._whole_parts(rec, chunk, cut) if k not in attempt.marked]
        parts = part_blocks(plans, self.layout.component_offsets, cut)
        tid = grant.transfer_id
        writes: list[tuple[int, Blocks, bool]] = []
        for k in range(1, len(cut) + 1):
            part, notify = parts[k - 1], k in whole
            if len(part) and k in attempt.marked:
                # Its notification was posted: bytes after it would land unverified.
                raise SendFailed(FailureReason.INVALID_REQUEST,
                                 f"sub-batch {k} was marked whole, yet this chunk writes "
                                 f"{part.total_bytes} more bytes of it")
            if len(part) or notify:
                writes.append((mark_id(tid, k), part, notify))
        if len(parts[-1]) or chunk.final:
            writes.append((tid, parts[-1], chunk.final))
        attempt.marked.update(whole)
        early = () if chunk.final else tuple(bounds(cut, k, n) for k in whole)
        return writes, early

    def _waits_for_offer(self, rec: Outgoing, conn: PeerConn) -> bool:
        """Whether the first step of a Send with no offer waits for decode's Offer (in
        the step: its chunk taken), the whole request or its first piece alike: a
        request sent in pieces before decode reserved (a router that asks decode only
        once prefill answered) asks nothing until decode's reservation is there."""
        return self._first_step(rec) and self._may_wait_for_offer(rec, conn)

    def _may_wait_for_offer(self, rec: Outgoing, conn: PeerConn) -> bool:
        """Whether the request may wait for decode's Offer rather than ask BeginWrite:
        ``--send-wait-s`` on, never asked, no resend or new handshake, and its decode
        answering heartbeats."""
        return (bool(self.send_wait_s) and not rec.asked and not rec.resends
                and not rec.rehandshake and not conn.missed_heartbeats)

    def periodic(self, now: float) -> Actions:
        """The sweep's work, and the BeginWrite fallback of Sends that waited for an
        Offer OFFER_GRACE_S in vain (decode reserved before the daemons connected). A
        request sent in pieces falls back only once its final piece came: until then
        its prompt is still computed, and decode's Offer is awaited with no cost."""
        actions = self.sweep(now)  # abandon hung writes, forget what ended
        due = [r for r in self._out.values()
               if r.step is Step.PARKED and not r.asked and r.decode_address
               and r.final_submitted and now - r.parked_at >= OFFER_GRACE_S]
        for rec in due:
            rec.asked = True
        for rec in due:
            actions += self._unpark(rec.request_id)
        return actions

    def _park(self, rec: Outgoing, now: float) -> Actions:
        """The Send came first: its step puts the chunk back and ends, and the request
        waits in WaitingForInput for decode's reservation (its Offer unparks it,
        :meth:`offer`) or until ``send_wait_s`` passes (a timeout)."""
        if not self._ended(rec):
            rec.put_back()  # taken again once decode reserved
        return self._end_step(rec, now, parks=True)

    def _lease_parked(self, rec: Outgoing, now: float) -> None:
        """A request parked: WaitingForInput, for at most ``send_wait_s`` ."""
        rid = rec.request_id
        snap = self.table.get(rid)
        if snap is not None and snap.state is TransferState.BOOTSTRAPPING:
            self.table.advance(rid, TransferState.WAITING_FOR_INPUT, now=now)
        what = ("decode's reservation: the Send came first and decode's engine did not "
                "reserve the request within --send-wait-s" if rec.decode_address else
                "decode's reservation: the Send named no decode and no decode daemon "
                "offered a reservation of the request within --send-wait-s (nothing moved)")
        self.table.lease(rid, self.send_wait_s, what, now=now)

    def _after_park(self, rec: Outgoing) -> Actions:
        """Once parked: an Offer that came meanwhile unparks it now."""
        rid = rec.request_id
        log.debug("request %s: waiting up to %.1f s for decode's reservation (%s)",
                  rid, self.send_wait_s, "decode has none yet" if rec.asked else "its Offer",
                  extra=fields(rid, rec.decode_address))
        if self.offers.has(rid):  # the Offer raced the park (or the refused BeginWrite)
            return self._unpark(rid)
        return []

    def _unpark(self, request_id: str) -> Actions:
        """Decode's reservation arrived for a parked request: write it now."""
        rec = self._out.get(request_id)
        if rec is None or rec.step is not Step.PARKED:
            return []  # not waiting (a step that parks looks for the offer as it ends)
        if self._ended(rec):
            rec.move(Step.IDLE)
            return []
        rec.unpark()
        return [RunStep(rec.ref)]

    def _check_grant_skip(self, rec: Outgoing, grant: WriteGrant) -> None:
        """Decode's ``kv_skip`` (untrusted: from the peer) fits this request's source:
        a layout of KV pages alone, a page left to move, and the same in every grant
        of the request (a resend's, a later chunk's)."""
        try:
            # Prefill's source lists always name the whole request (a slot's as an
            # engine's): kv_skip picks their tail, so only the layout can refuse it.
            check_kv_skip("prefill", self.spec, self.layout, grant.kv_skip, rec.seq_len,
                          lists=True)
        except BadKvSkip as exc:
            raise SendFailed(FailureReason.INVALID_REQUEST, f"decode's grant: {exc}") from None
        if rec.kv_skip is None:
            rec.kv_skip = grant.kv_skip
        elif rec.kv_skip != grant.kv_skip:
            raise SendFailed(FailureReason.INVALID_REQUEST,
                             f"decode's grant: kv_skip {grant.kv_skip} differs from the "
                             f"{rec.kv_skip} of its earlier grant for this request")

    def _chunk(self, rec: Outgoing, ranges: Ranges, final: bool) -> Chunk:
        """What a chunk makes ready (positions of the request's KV_PAGES list): all of
        it for the final chunk; what the pieces so far make ready (by layer, with
        LAYERS); else the whole pages below the furthest token its ranges reach (a page
        filled in part goes once a later chunk completes it)."""
        total = len(rec.src_indices[IndexKind.KV_PAGES])
        if final:
            return Chunk.whole(total, True)
        if rec.pieces is not None:
            return rec.pieces.ready
        return Chunk.whole(min(max(end for _start, end in ranges) // self.spec.page_size,
                               total), False)

    def _chunk_rects(self, rec: Outgoing, dst: IndexLists, chunk: Chunk) -> list[Rect] | None:
        """What this chunk writes, as rectangles of the request's KV_PAGES positions by
        layers: what it makes ready beyond what the attempt wrote and what decode holds
        (its KV_PAGES list starts at position ``kv_skip`` of the request's); None when a
        chunk that is not final has nothing to write. The final chunk writes at least
        its states: an empty rectangle of every layer when no page is left."""
        skip = rec.kv_skip or 0
        total = len(rec.src_indices[IndexKind.KV_PAGES])
        reserved = len(dst[IndexKind.KV_PAGES])
        if reserved != total - skip:
            held = f" from position {skip} (kv_skip)" if skip else ""
            left = f" (so {total - skip} to move)" if skip else ""
            raise SendFailed(FailureReason.INVALID_REQUEST,
                             f"decode reserved {reserved} KV pages{held}, prefill has "
                             f"{total}{left}")
        num_layers = self.layout.num_layers
        rects = unwritten(rec.attempt.written, chunk, skip=skip, num_layers=num_layers)
        if not rects and not chunk.final:
            return None
        return rects or [(total, total, 0, num_layers)]

    def _select_pages(self, rec: Outgoing, dst: IndexLists, lo: int,
                      hi: int) -> tuple[IndexLists, IndexLists]:
        """The source and destination lists of the KV pages ``[lo, hi)`` (positions of
        the request's list); the other lists go whole (the plan includes them with the
        final chunk only)."""
        kv = rec.src_indices[IndexKind.KV_PAGES]
        if lo == 0 and hi == len(kv):
            return rec.src_indices, dst  # the usual single-chunk request: no copies
        skip = rec.kv_skip or 0
        src, dst_sel = dict(rec.src_indices), dict(dst)
        src[IndexKind.KV_PAGES] = kv[lo:hi]
        dst_sel[IndexKind.KV_PAGES] = dst[IndexKind.KV_PAGES][lo - skip:hi - skip]
        return src, dst_sel
