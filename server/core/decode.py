"""Decode's core: reservations, Offer, BeginWrite, arrival and its proof, as a state
machine: events in, actions out, no I/O.

Every method takes an event (an API call, a transport event, a peer's answer, a
digest job started, a verdict, a timer's time ``now``) and returns what the driver
must do (:mod:`kvbeam.server.core.decode_actions`): the core holds no executor, no
peer client, no clock and no digest pool. The driver
(:class:`~kvbeam.server.core.decode_driver.DecodeDriver`) is the only place that
does I/O, and feeds what comes back to the core as its next event. The core still
takes its one lock, since events arrive on several of the daemon's threads; it never
holds it while anything is done, because it does nothing.

Per request: :meth:`DecodeCore.reserve` holds a slot and computes the destination
indices (Bootstrapping, its deadline is the reservation lease); the driver then
offers them to a connected prefill (:meth:`DecodeCore.offer` returns the
:class:`SendOffer`), or prefill's BeginWrite moves it to Transferring and learns the
indices and the transfer id; the notification carrying that id arrives after every
byte (RC ordering; an offered request is Transferring from then), the request's
digest record among them (prefill writes it into the request's slot of the digest
mailbox before the marker), and :class:`CheckLanding` checks the record and the
bytes; the verdict (:meth:`DecodeCore.checked`) makes the request Success. The slot
stays held until the scheduler's Release (the engine took over) or the hand-off
lease expires.

No slot is freed while the prefill side might still write into it: a failure decode
originates after prefill began writing is propagated to prefill first
(:class:`DrainPrefill`), and the slot is freed once prefill confirms its writes
drained (:meth:`DecodeCore.drain_answered`, or its own Abort once they have), or once
the link they would come over is released (:meth:`DecodeCore.link_dropped`). An
abort prefill does not confirm keeps only that request's slot: decode asks again,
and after the request's transfer budget releases that one link (its other requests
stay for prefill's resend), never failing the peer's other requests.

The Offer (one-way). When Reserve names a prefill that
is a verified peer with a live connection, the Offer carries exactly what BeginWrite
would answer (the transfer id, the destination lists); the driver sends it on the
pair's peer channel (:meth:`DecodeCore.offer_sent`) and nothing comes back while
prefill keeps it and writes digests: that is the usual case, and the digest record
in the request's mailbox slot says so when the bytes land. Prefill answers only
what decode must act on (an OFFER_ANSWER: not kept, kept without digests, refused
with a status), an event here (:meth:`DecodeCore.answer_arrived`). No offer is made
while the peer misses heartbeats:
Reserve stays fast when prefill is slow or cut off. Prefill's Send then writes at
once, with no control round trip; without an offer (the first request before any
handshake, a Send before the Reserve, a resend on a new link) prefill asks with
BeginWrite as before (docs/protocol.md, "The offer path and its fallback").

The reservation counts as granted BEFORE the offer is sent (``peer_instance`` and
the link set): prefill may post its writes, and its notification arrive, before
any answer could be back here. From then on an abort asks prefill to drain first, as
after a BeginWrite. Only an explicit refusal (prefill will not use it) takes the
grant back; no answer means kept, so the grant stays.

The landing's decisions live here too (:meth:`DecodeCore._ready`: when to check;
:meth:`DecodeCore.checked`: what the verdict does); reading the record and digesting
the bytes is the driver's (:mod:`kvbeam.server.core.decode_landing`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping

from kvbeam.errors import (
    AlreadyLanded,
    BadKvSkip,
    BadRequest,
    DialRefused,
    NotHandshakenError,
    UnknownRequest,
)
from kvbeam.logs import fields, request_log
from kvbeam.pools.digest import DigestParts
from kvbeam.pools.digest_pool import DigestJob
from kvbeam.pools.engine_indices import ListLike, check_kv_skip, validate
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.mailbox import RecordArea, record_bytes
from kvbeam.pools.spec import PoolSpec
from kvbeam.pools.sub_batches import MARK_BITS, buffer_bytes, cuts, split_id
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.actions import Count, DropLink, RecordRef, link_failure
from kvbeam.server.core.base import CoreBase
from kvbeam.server.core.decode_actions import (
    Actions,
    CheckLanding,
    DialPrefill,
    DigestMark,
    DrainPrefill,
    Freed,
    SendOffer,
    TellPrefill,
)
from kvbeam.server.core.decode_landing import Verdict, checks_inline
from kvbeam.server.core.decode_pages import PageBook
from kvbeam.server.core.incoming import Incoming, Landing, UnconfirmedAbort
from kvbeam.server.core.pairing import Dialing
from kvbeam.server.core.ports import Offered, WriteGrant
from kvbeam.server.state.lifecycle import TransferTable
from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.server.state.slots import SlotPool
from kvbeam.states import (
    NOT_VERIFIED_OFF,
    FailureReason,
    TransferFacts,
    TransferState,
    TransferStatus,
)
from kvbeam.transport import Event, EventKind

log = logging.getLogger(__name__)

#: How prefill's answers to offers count (``kvbeam_offers_total{event}``); "made" counts
#: every offer sent, so made less refused and failed were kept (a kept offer's answer,
#: saying prefill writes no digests, is not counted).
_ANSWER_COUNTS = {Offered.REFUSED: "refused", Offered.UNKNOWN: "failed"}
#: The states a landing checked as it landed passes on its way to Success (on_event).
_TO_SUCCESS: dict[TransferState | None, tuple[TransferState, ...]] = {
    TransferState.BOOTSTRAPPING: (TransferState.WAITING_FOR_INPUT, TransferState.TRANSFERRING),
    TransferState.WAITING_FOR_INPUT: (TransferState.TRANSFERRING,),
}

#: Seconds between decode's repeats of an Abort prefill has not confirmed.
ASK_AGAIN_S = 1.0
#: Repeated Aborts in flight at once (each a peer call on the driver's executor).
MAX_ASKING = 2
#: What a landed request waits for when prefill's integrity flag is not known (a kept
#: offer gets no answer when digests follow; a prefill without integrity answers that it
#: kept it without them) and no record is in the slot (a timeout names it).
WAITING_FOR_DIGESTS = ("the writes landed without a digest record, and prefill's answer "
                       "to the Offer (its integrity flag) never came")


class DecodeCore(CoreBase):
    """All of decode's request state, and every decision on it; returns actions."""

    role = "decode"
    ask_again_s = ASK_AGAIN_S

    def __init__(self, *, table: TransferTable, peers: Peers, integrity: bool,
                 handoff_lease_s: float,
                 transfer_budget: Callable[[int], float] = lambda _n: 0.0,
                 wire_s: Callable[[int], float] = lambda _n: 0.0,
                 sub_batch_bytes: int = 0, check_inline_below: int = 0) -> None:
        """``peers``: the verified prefills (read here; the driver removes a lost one).
        Its pools come with :meth:`take_pools` (the daemon's own at start, or an
        engine's at attach), its digest mailbox with :meth:`use_mailbox` before them
        (the one the daemon registered REMOTE_WRITE and advertises; without it, as in
        tests of the core, the core makes its own, unregistered).
        ``sub_batch_bytes``: the sub-batch size decode advertises
        (``--verify-sub-batch-mib``, :mod:`kvbeam.pools.sub_batches`; 0: none), with
        integrity on. ``check_inline_below``: a landing with fewer bytes is checked on
        the thread that saw it land (the digest pool's ``inline_below``,
        :func:`~kvbeam.server.core.decode_landing.checks_inline`); such a landing checked
        at once goes from WaitingForInput to Success in one change (0: none is)."""
        self.table = table
        self.peers = peers
        self.integrity = integrity
        self.handoff_lease_s = handoff_lease_s
        #: Seconds Transferring allows for a number of bytes: a large request on a slow
        #: wire is not failed here while prefill is still writing it.
        self.transfer_budget = transfer_budget
        self.wire_s = wire_s  # an offered reservation's lease grows by its bytes' time
        self.sub_batch_bytes = sub_batch_bytes if integrity else 0
        self.check_inline_below = check_inline_below
        self.slots = SlotPool(0)  # none until its pools come (take_pools)
        self.mailbox: RecordArea | None = None
        self._res: dict[str, Incoming] = {}
        self._by_transfer: dict[int, str] = {}
        self._pages = PageBook()  # no destination item in two live reservations
        self._ids = itertools.count(1)
        #: Prefill daemons asked to connect (decode-initiated pairing).
        self._dialing = Dialing()

    # ---- API ---------------------------------------------------------------------------
    def reserve(self, request_id: str, seq_len: int, prefill_address: str, *,
                indices: Mapping[IndexKind, ListLike] | None = None,
                draft: Mapping[IndexKind, ListLike] | None = None,
                kv_skip: int = 0, now: float) -> Incoming:
        """Hold a slot for a request and compute (or check) its destination indices.

        ``indices`` (and ``draft``, the draft's own lists) are the engine's
        destination lists (docs/indices.md), validated before anything is held. The
        reservation still holds a request slot (the capacity: at most
        ``num_req_slots`` in flight), but the lists are the address: its slot is -1.
        Lists naming an item a live reservation holds are refused
        (:class:`~kvbeam.server.core.decode_pages.PageBook`), before anything is held.

        ``kv_skip``: the request's leading KV pages this engine already holds (its
        prefix cache); its KV_PAGES list then names exactly the pages from there on,
        and prefill writes and digests only those (docs/protocol.md, "Partial loads").
        """
        lists = None
        left = check_kv_skip("decode", self.spec, self.layout, kv_skip, seq_len,
                             lists=bool(indices or draft))
        if indices or draft:
            lists = validate("decode", self.spec, self.layout, indices or {}, draft or {},
                             seq_len, shorter_pages=bool(kv_skip) or not self.integrity,
                             shorter_why="decode's integrity check off, since prefill digests "
                                         "its whole lists (or kv_skip, naming the pages "
                                         "decode holds)")
            given = len(lists[0][IndexKind.KV_PAGES])
            if kv_skip and given != left:
                raise BadKvSkip(f"decode: kv_skip {kv_skip}: KV_PAGES has {given} indices; "
                                f"{seq_len} tokens less the {kv_skip} pages held need {left}")
        held = self.slots.acquire(request_id)
        if self.mailbox is not None and held < self.mailbox.slots:
            # No write of an earlier holder of the slot can come any more (a slot is freed
            # only once its prefill drained): a stale record can never pass from here.
            self.mailbox.clear(held)
        dst, dst_draft = lists or (request_indices(self.spec, held, seq_len), {})
        per_buffer = buffer_bytes(self.layout, dst, dst_draft)
        nbytes = sum(per_buffer)
        slot = held if lists is None else -1
        try:
            # The table entry and the record appear in one call on the loop: an Abort or
            # a deadline that finds the request finds its record too, so it frees the
            # slot (else the slot leaked, held by a failed request no one would free).
            # No I/O here; the Offer comes after.
            self._pages.claim(request_id, dst, dst_draft,
                              draft_pool=self.layout.draft is not None)
            try:
                self.table.create(request_id, prefill_address, now=now)
            except Exception:
                self._pages.release(request_id)
                raise
            tid = self._transfer_id()
            res = Incoming(request_id, slot, seq_len, prefill_address, tid, dst,
                           nbytes, draft=dst_draft, kv_skip=kv_skip, mailbox_slot=held,
                           sub_batches=cuts(per_buffer, self.sub_batch_bytes))
            self._res[request_id] = res
            self._by_transfer[tid] = request_id
        except Exception:
            self.slots.release(request_id)
            raise
        request_log.info("request %s: reserved slot %d for %d tokens from prefill %s%s",
                         request_id, slot, seq_len, prefill_address,
                         f" (its first {kv_skip} KV pages held here: not written)"
                         if kv_skip else "", extra=fields(request_id, prefill_address))
        return res

    def _transfer_id(self) -> int:
        """A new transfer id: a nonzero multiple of ``1 << MARK_BITS``,
        so its sub-batches' marks (the low bits, pools/sub_batches.py) name no other."""
        while True:
            tid = (next(self._ids) << MARK_BITS) & 0xFFFFFFFF
            if tid:
                return tid

    def decline(self, request_id: str, prefill_address: str, detail: str,
                now: float) -> Actions:
        """The engine will not load a request it reserved nothing for: tell its prefill
        now, by Abort, so prefill fails its send and frees the source (instead of
        waiting out its ``--send-wait-s`` lease). With no open peer channel to that
        prefill (it sent nothing here yet: its Send may name no decode), prefill is asked
        to connect and told once it did (:meth:`dialed`).

        A request this daemon holds a reservation of is aborted instead (ABORT):
        refused here.
        """
        if self._res.get(request_id) is not None:
            raise BadRequest(f"request {request_id} is reserved here: abort it (ABORT), "
                             "DECLINE is for a request decode will not load at all")
        conn = self.peers.by_address(prefill_address)
        why = f"declined by decode: {detail}"
        if conn is None or conn.closed or conn.retired_channel() is not None:
            self._dialing.hold_decline(prefill_address, request_id, why)
            return [*self._dial(prefill_address, now, request_id), Count("declines")]
        return [TellPrefill(conn, request_id, why), Count("declines")]

    def begin_write(self, request_id: str, instance_id: str, seq_len: int,
                    digests_follow: bool, *, now: float) -> Incoming:
        """Prefill is about to write (a chunk of) a request: check it may, say where.

        ``digests_follow``: prefill's integrity is on (its digest record comes in band,
        into the request's mailbox slot, before the marker). A request in pieces asks
        for its first piece (unless decode's offer served it) and then about once a
        second (prefill's ``GRANT_RENEW_S``): no ask says which piece is the last.
        """
        conn = self.peers.get(instance_id)
        if conn is None:
            raise NotHandshakenError(
                f"no successful handshake with prefill instance {instance_id!r}")
        res = self._reservation(request_id)
        if conn.control_address != res.prefill_address:
            raise BadRequest(f"request {request_id} is reserved for prefill "
                                 f"{res.prefill_address}, not {conn.control_address}")
        if seq_len != res.seq_len:
            raise BadRequest(f"request {request_id}: seq_len {seq_len} differs from the "
                                 f"reserved {res.seq_len}")
        snap = self.status(request_id)
        if res.peer_instance and res.peer_instance != conn.instance_id:
            raise BadRequest(f"request {request_id} is being written by prefill "
                                 f"instance {res.peer_instance}")
        # The same prefill instance on a new link: a resend after a transport error
        # (or a Send that could not use the offer made over the old link).
        relink = res.link_id is not None and res.link_id != conn.link.id
        resend, res.offered = not res.offered, False
        if relink and snap.state is TransferState.SUCCESS:
            raise AlreadyLanded(f"request {request_id} landed and was verified before "
                                "the resend: nothing to write again")
        if relink and res.checking:
            # Every byte of the old link's writes landed (its notification came) and
            # is being verified: a new landing must not reset it under the check.
            raise AlreadyLanded(f"request {request_id} landed before the resend and "
                                "its verification is under way: nothing to write again")
        if snap.state is TransferState.BOOTSTRAPPING:
            self.table.advance(request_id, TransferState.TRANSFERRING,
                               through=(TransferState.WAITING_FOR_INPUT,), now=now)
        elif snap.state is TransferState.TRANSFERRING:
            self.table.touch(request_id, now=now)  # a further chunk is progress
        else:
            self.table.advance(request_id, TransferState.TRANSFERRING, now=now)  # raises
        self.table.extend(request_id, self.transfer_budget(res.nbytes), now=now)
        res.peer_instance = conn.instance_id
        if relink:
            # A new transfer id on the new link: the old link's notification (if it
            # still comes) finds no request, and nothing has landed on this one yet.
            self._by_transfer.pop(res.transfer_id, None)
            res.transfer_id = self._transfer_id()
            self._by_transfer[res.transfer_id] = request_id
            res.relinked()  # the old landing's sub-batches count for nothing
        res.link_id = conn.link.id
        # Every ask says it (prefill's integrity does not change): a request sent in
        # pieces asks for its first piece and may write its final one without asking.
        res.digests_follow = digests_follow
        if relink and resend:
            log.warning("request %s: prefill resends it on a new link (transfer id %d)",
                        request_id, res.transfer_id, extra=fields(request_id, res.prefill_address))
        elif relink:
            # The grant went out as an Offer over the old link, and prefill may have
            # written over it before that link failed (no BeginWrite tells decode): from
            # here the request is either resent or written for the first time.
            log.info("request %s: prefill resends it on a new link, or writes it there "
                     "first: the offer went over the old one (transfer id %d)", request_id,
                     res.transfer_id, extra=fields(request_id, res.prefill_address))
        return res

    def prefill_of(self, request_id: str) -> str:
        """The prefill address a live reservation was made for ("" without one)."""
        res = self._res.get(request_id)
        return res.prefill_address if res is not None else ""

    def release(self, request_id: str) -> tuple[TransferStatus, Actions]:
        """The engine took over a request that reached Success: free its slot."""
        snap = self.status(request_id)
        if snap.state is not TransferState.SUCCESS:
            raise BadRequest(f"request {request_id} is {snap.state.value}, not Success: "
                                 "only a finished request is released (use Abort to cancel)")
        return snap, self._free(request_id, "released by the scheduler")

    def abort(self, request_id: str, *, from_peer: bool, detail: str,
              instance_id: str = "", checked: tuple[str, str | None] = ("", None),
              now: float) -> tuple[TransferStatus, Actions]:
        """Abort a request: fail it, make sure prefill stops writing, free the slot.

        ``from_peer`` (prefill reports its own failure, its writes drained) frees the
        slot at once only from the request's own prefill: ``instance_id`` is the
        prefill instance the request was granted to (BeginWrite or Offer) and still a
        verified peer, or no prefill was granted it (none can be writing), and the
        caller's credentials cover the request's prefill address. Instance ids are no
        secret (every Heartbeat answer carries one), so ``checked`` is the prefill address
        the caller's credentials were checked against (off the loop, by the driver: the
        check may resolve a host name; :meth:`prefill_of`) and why the caller may not
        speak for it (None: it may). A claim checked against another address than the
        request's is refused. Anyone else's claim is a scheduler's abort: prefill
        drains first (:class:`DrainPrefill`).
        """
        snap = self.status(request_id)
        if snap.state is TransferState.SUCCESS:
            return snap, self._free(request_id, "aborted after Success")
        res = self._res.get(request_id)
        claimed = res if from_peer and instance_id else None
        # The address is the one the grant went to (BeginWrite and Offer check it),
        # fixed at Reserve.
        address, refusal = checked
        if claimed is not None and refusal is None and address != claimed.prefill_address:
            refusal = f"the caller was checked against {address or 'no address'}"
        granted = res.peer_instance if res is not None else ""
        by_prefill = claimed is not None and res is claimed and refusal is None and (
            not granted or (granted == instance_id
                            and self.peers.verified(instance_id) is not None))
        if by_prefill:
            detail = detail or "aborted by prefill"
            failed = self.table.fail(request_id, FailureReason.PEER_FAILED, detail, now=now)
        else:
            failed = self.table.fail(request_id, FailureReason.ABORTED, detail or "aborted",
                                     now=now)
        if refusal is not None and claimed is not None:
            log.warning("request %s: not an Abort of its prefill at %s (%s): taken as a "
                        "scheduler's abort (prefill drains first)", request_id,
                        claimed.prefill_address, refusal, extra=fields(request_id, snap.peer))
        elif from_peer and not by_prefill and res is not None:
            log.warning("request %s: an Abort claiming to come from prefill names instance "
                        "%r, not %s, the prefill instance granted the request: taken as a "
                        "scheduler's abort (prefill drains first)", request_id, instance_id,
                        granted or "(none yet)", extra=fields(request_id, snap.peer))
        if by_prefill:
            # Prefill failed or was aborted and has drained its writes: free at once.
            if failed is not None:
                log.warning("request %s failed: prefill reported: %s", request_id, detail,
                            extra=fields(request_id, snap.peer))
            actions = self._free(request_id, "prefill aborted")
            return self.status(request_id), actions
        actions = []
        if failed is not None:
            log.info("request %s aborted by the scheduler", request_id,
                     extra=fields(request_id, snap.peer))
            actions = self._stop_prefill_then_free(request_id, detail or "aborted on decode")
        return self.status(request_id), actions

    def slot_of(self, request_id: str) -> int:
        """The slot a request holds, -1 once freed."""
        res = self._res.get(request_id)
        return res.slot if res else -1

    def _facts(self, request_id: str) -> TransferFacts | None:
        res = self._res.get(request_id)
        return None if res is None else res.facts(self._verification(request_id))

    def _verification(self, request_id: str | None) -> str:
        snap = self.table.get(request_id) if request_id is not None else None
        if snap is not None and snap.state is TransferState.SUCCESS:
            return snap.detail  # the check's verdict (VERIFIED_PREFIX, NOT_VERIFIED_*)
        if snap is not None and snap.reason is FailureReason.INTEGRITY:
            return f"failed: {snap.detail}"
        if snap is not None and snap.state is TransferState.FAILED:
            return "not checked: it ended first"
        if not self.integrity:
            return NOT_VERIFIED_OFF
        return "not yet: XXH3-128 of every buffer checked against prefill's once it lands"

    # ---- Offer: the reservation pushed to prefill ahead of its Send ----------------------
    def offer(self, res: Incoming, now: float) -> Actions:
        """Offer a fresh reservation to its prefill when that is a connected peer: the
        :class:`SendOffer`, or nothing (one missing heartbeats, or BeginWrite came
        first). The driver sends it and tells :meth:`offer_sent`; prefill answers only
        what decode must act on, to :meth:`answer_arrived`. With no connection to that
        prefill (or one whose peer channel closed), prefill is asked to connect
        (:class:`DialPrefill`, once per address at a time); :meth:`dialed` offers the
        reservations that waited for it."""
        conn = self.peers.by_address(res.prefill_address)
        lease = self.table.left(res.request_id, now=now)
        if lease is None:
            return []
        if conn is None or conn.closed or conn.retired_channel() is not None:
            return self._ask_prefill(res, now)
        if conn.missed_heartbeats:
            return []  # a peer not answering now: BeginWrite decides later
        if not self._unclaimed(res):
            return []  # BeginWrite came first, or the request ended or is gone
        res.peer_instance, res.link_id, res.offered = conn.instance_id, conn.link.id, True
        grant = WriteGrant(res.transfer_id, res.indices, res.draft, res.kv_skip,
                           res.mailbox_slot)
        return [SendOffer(conn, res.ref, res.seq_len, grant, lease)]

    def _ask_prefill(self, res: Incoming, now: float) -> Actions:
        """Ask the reservation's prefill to connect (decode-initiated pairing), unless an
        ask of it is under way or paused (the reservation is offered when it ends)."""
        if not self._unclaimed(res):
            return []
        return self._dial(res.prefill_address, now, res.request_id)

    def _unclaimed(self, res: Incoming) -> bool:
        """Whether ``res`` is still its request's live reservation and no prefill has
        claimed it yet (no BeginWrite or offer made)."""
        return (not res.peer_instance and self._res.get(res.request_id) is res
                and self.table.is_live(res.request_id))

    def _dial(self, address: str, now: float, request_id: str) -> Actions:
        """Ask the prefill at ``address`` to connect, naming every request that waits for
        the pair, unless an ask of it is under way or paused."""
        if not self._dialing.start(address, now):
            return []
        waiting = [r.request_id for r in self._res.values()
                   if r.prefill_address == address and not r.peer_instance]
        waiting += self._dialing.declines(address)
        request_log.info("request %s: no connection to prefill %s: asking it to connect",
                         request_id, address, extra=fields(request_id, address))
        return [DialPrefill(address, tuple(waiting))]

    def dialed(self, address: str, instance_id: str, error: DialRefused | None,
               now: float) -> Actions:
        """The prefill at ``address`` answered decode's ask to connect: connected (as
        ``instance_id``: every reservation naming it that waited is offered now), or
        ``error``: every reservation naming it that no prefill was granted fails at once
        with the cause (the refusal's text, not the Bootstrapping deadline later) and its
        pages are freed (prefill ended those the ask named itself, when its handshake
        was refused); an error that says nothing about the pair (``retry``) leaves them
        to their deadlines. Declines waiting for the pair are told once connected, else
        dropped (prefill's lease ends those requests)."""
        conn = self.peers.get(instance_id) if error is None else None
        if error is None and (conn is None or conn.closed or conn.control_address != address):
            error = DialRefused(FailureReason.PEER_FAILED, (
                f"prefill daemon at {address} connected, but its handshake names its "
                f"control address {conn.control_address if conn else '(gone)'}: the "
                "reservation must name the prefill daemon's advertised address "
                "(its --advertise, else --listen)"))
        self._dialing.done(address, now, pause=error is not None and error.retry)
        waiting = [r for r in self._res.values()
                   if r.prefill_address == address and not r.peer_instance]
        declines = self._dialing.take_declines(address)
        if error is None:
            log.info("prefill %s connected on this decode's ask: %d reservation(s) offered",
                     address, len(waiting), extra=fields(peer=address))
            actions: Actions = [Count("connects", "ok")]
            for res in waiting:
                actions += self.offer(res, now)
            assert conn is not None
            return actions + [TellPrefill(conn, rid, why) for rid, why in declines.items()]
        if error.retry:
            log.info("prefill %s did not connect (%s); its %d reservation(s) wait for its "
                     "Send's handshake or their deadline", address, error, len(waiting),
                     extra=fields(peer=address))
            return [Count("connects", "retry")]
        actions = [Count("connects", "unreachable" if error.reason is
                         FailureReason.PEER_UNREACHABLE else "refused")]
        for res in waiting:
            rid = res.request_id
            if self.table.fail(rid, error.reason, str(error), now=now):
                log.warning("request %s failed: %s: %s", rid, error.reason.value, error,
                            extra=fields(rid, address))
            snap = self.table.get(rid)
            if snap is not None and snap.state is TransferState.FAILED:
                actions += self._free(rid, "its prefill could not connect")
        return actions

    def _record(self, ref: RecordRef) -> Incoming | None:
        """The record ``ref`` names, while decode keeps it (None: freed, and maybe
        replaced by a newer reservation of the same id, which ``ref`` does not name)."""
        res = self._res.get(ref.request_id)
        return res if res is not None and res.ref == ref else None

    def offer_sent(self, ref: RecordRef, sent: bool, now: float) -> Actions:
        """The Offer of the request went to prefill (counted "made"; no answer means
        kept), or could not (no channel: as a refusal)."""
        res = self._record(ref)
        if res is None:
            return [Count("offers", "made" if sent else "refused")]  # freed meanwhile
        if not sent:
            return self.offer_answered(res, Offered.REFUSED)
        kept = res.offered  # not refused already (an answer may overtake this)
        left = self.table.left(res.request_id, now=now)
        if kept and left is not None:
            # The lease still bounds the wait for the Send, but no BeginWrite will move
            # the request to Transferring: a Send at the lease's very end must still have
            # the time its bytes take at the floor rate.
            self.table.extend(res.request_id, left + self.wire_s(res.nbytes), now=now)
        if log.isEnabledFor(logging.DEBUG):  # per request: its fields only when logged
            log.debug("request %s: offered to prefill %s", res.request_id,
                      res.prefill_address, extra=fields(res.request_id, res.prefill_address))
        return [Count("offers", "made")]

    def answer_arrived(self, request_id: str, transfer_id: int, instance_id: str,
                       answer: Offered) -> Actions:
        """Prefill ``instance_id`` answered an Offer (its OFFER_ANSWER): acted on when the
        reservation it names (request id and transfer id) is still offered to that
        prefill; an answer to anything else (the request ended, was offered again,
        BeginWrite came) is only counted."""
        res = self._res.get(request_id)
        current = (res is not None and res.transfer_id == transfer_id
                   and res.peer_instance == instance_id)
        if res is None or not current:
            log.debug("request %s: an answer to an offer it no longer has from %s: %s",
                      request_id, instance_id, answer.value)
            label = _ANSWER_COUNTS.get(answer)
            return [Count("offers", label)] if label else []
        return self.offer_answered(res, answer)

    def offer_answered(self, res: Incoming, answer: Offered) -> Actions:
        """Prefill's answer to the Offer of ``res`` (or "refused": none could be sent):
        counted; a refusal takes the grant back; kept without digests, the landing is
        checked when it was only waiting for prefill's integrity flag."""
        still = res.offered  # no BeginWrite since (it decides instead)
        if still and answer.kept:
            res.digests_follow = answer is Offered.DIGESTS_FOLLOW
        if still and answer is Offered.REFUSED and not res.landed:
            res.peer_instance, res.link_id, res.offered = "", None, False
        go = still and answer.kept and self._ready(res)
        tid = res.transfer_id
        log.debug("request %s: prefill %s answered its offer: %s", res.request_id,
                  res.prefill_address, answer.value,
                  extra=fields(res.request_id, res.prefill_address))
        label = _ANSWER_COUNTS.get(answer)
        actions: Actions = [Count("offers", label)] if label else []
        if go:
            actions.append(CheckLanding(res.ref, res.view(), tid))
        return actions

    # ---- the landing -------------------------------------------------------------------
    def on_event(self, event: Event, now: float) -> Actions:
        """NOTIFIED: a transfer (or one of its sub-batches) landed; LINK_FAILED: that
        link is gone (its peer stays: prefill resends on its next link)."""
        if event.kind is EventKind.LINK_FAILED:
            lost = link_failure(self.peers, event)
            return [lost] if lost is not None else []
        if event.kind is not EventKind.NOTIFIED or event.transfer_id is None:
            return []
        # A sub-batch's mark carries the grant's id plus its number (pools/sub_batches.py).
        base, mark = split_id(event.transfer_id)
        rid = self._by_transfer.get(base)
        res = self._res.get(rid) if rid else None
        # Only the link of the latest grant counts: its notification follows every
        # byte written on it. A link-only failure removed its connection already,
        # yet a notification it delivered before failing is still proof of arrival.
        ok = (res is not None and bool(res.peer_instance) and res.link_id == event.link
              and (not mark or mark <= len(res.sub_batches)))
        go = False
        if res is not None and ok and mark:
            # A landed sub-batch is progress: its Transferring deadline restarts (a
            # request in pieces asks BeginWrite again only about once a second).
            self._transferring(res.request_id, now, progress=True)
        elif res is not None and ok:
            res.notified(now)
            blocker = self._blocker(res)
            # Checked here and now (a small landing, the usual case): Success moves
            # through Transferring in one change, one push to the engine, and none
            # before the check. Else Transferring now: its deadline bounds the wait
            # for the digests, the marks or the digest pool.
            if not (blocker is None and checks_inline(res, self.integrity,
                                                      self.check_inline_below)):
                self._transferring(res.request_id, now)
            go = self._start_check(res, blocker)
        if res is None or not ok:
            conn = self.peers.by_link(event.link)
            log.warning("completion for unknown transfer id %s on link %d ignored%s",
                        event.transfer_id, event.link,
                        f" (mark {mark}: decode cut that request into "
                        f"{len(res.sub_batches)} marked sub-batches)" if res and mark else "",
                        extra=fields(rid, conn.control_address if conn else None))
            return []
        if mark:
            return [DigestMark(res.ref, res.view(), base, mark)]
        return [CheckLanding(res.ref, res.view(), base)] if go else []

    def mark_digesting(self, ref: RecordRef, transfer_id: int, mark: int,
                       job: DigestJob, parts: DigestParts | None = None) -> Actions:
        """Sub-batch ``mark`` of the landing of ``transfer_id`` is being digested
        (``job``; ``parts``: the request's digest parts the driver built for it, kept for
        its other marks and its check); the check follows when it was all that was
        missing. A mark decode did not cut, a repeated one, or one of a replaced landing
        is ignored (the record's count decides)."""
        res = self._record(ref)
        if res is None:
            return []  # freed meanwhile
        if res.parts is None:
            res.parts = parts
        fresh = (res.transfer_id == transfer_id and mark not in res.marked
                 and not res.checking)
        if fresh:
            res.marked[mark] = job
        go = fresh and self._ready(res)
        if not fresh:
            log.warning("request %s: mark %d of transfer %d came again, or after its "
                        "landing was replaced or verified: ignored", res.request_id, mark,
                        transfer_id, extra=fields(res.request_id, res.prefill_address))
        return [CheckLanding(res.ref, res.view(), transfer_id)] if go else []

    def _ready(self, res: Incoming) -> bool:
        """Landed, and prefill's integrity flag known: verify now, once (True)."""
        return self._start_check(res, self._blocker(res))

    def _blocker(self, res: Incoming) -> str | None:
        """What the landing's check still waits for (None: nothing, it may start; "": it
        is not landed, or its check began). Reads only.

        With our integrity on and prefill's flag not known yet (an Offer whose answer is
        not back), a record in the request's mailbox slot says prefill's integrity is on
        (the slot was cleared when it was reserved, and the record lands before the
        marker); without one the request waits for the answer.
        """
        if res.landing is not Landing.LANDED:
            return ""
        box = self.mailbox
        # The slot is read only where its record decides something.
        recorded = (self.integrity and (res.digests_follow is None or bool(res.sub_batches))
                    and box is not None and 0 <= res.mailbox_slot < box.slots
                    and box.has_record(res.mailbox_slot))
        if self.integrity and res.digests_follow is None and not recorded:
            return WAITING_FOR_DIGESTS
        if res.digests_follow is not False and res.sub_batches and recorded:
            assert box is not None
            # The record says how many marks came before it; a count decode did not cut
            # is refused by the check itself (naming both), not waited for.
            marks = box.marks(res.mailbox_slot)
            if marks == len(res.sub_batches) and len(res.marked) < marks:
                return (f"the marks of its sub-batches: the digest record says {marks} came "
                        f"before it, {len(res.marked)} did")
        return None

    def _start_check(self, res: Incoming, blocker: str | None) -> bool:
        """Start the landing's check if nothing blocks it (:meth:`_blocker`): True, once;
        else say in the table what it waits for."""
        if blocker:
            self.table.waiting_for(res.request_id, blocker)
        if blocker is not None:
            return False
        if self.integrity and res.digests_follow is None:
            res.digests_follow = True  # its record is in the slot (_blocker)
        res.verify()
        return True

    def checked(self, ref: RecordRef, transfer_id: int, verdict: Verdict,
                now: float) -> Actions:
        """The check of the landing of ``transfer_id`` is done: Success, or Failed
        (integrity: the slot is freed and prefill told). Its verdict counts only while
        that landing is still the request's (no resend replaced it, it was not freed)."""
        res = self._record(ref)
        if res is None:
            log.info("request %s: its landing was checked after it was freed: the verdict "
                     "is void", ref.request_id)
            return []
        rid = res.request_id
        current = res.transfer_id == transfer_id and res.landed
        failed = None
        if current and verdict.ok:
            res.digests = verdict.digests
            try:
                # A landing checked as it landed never left WaitingForInput (on_event).
                through = _TO_SUCCESS.get(self.table.state_of(rid), ())
                self.table.advance(rid, TransferState.SUCCESS, detail=verdict.detail,
                                   nbytes=res.nbytes, through=through, now=now)
            except Exception as exc:  # already failed (aborted, timed out): nothing to do
                log.info("request %s landed after it ended: %s", rid, exc,
                         extra=fields(rid, res.prefill_address))
                return []
            res.verified(now)
        elif current:
            failed = self.table.fail(rid, FailureReason.INTEGRITY, verdict.detail, now=now)
        if not current:
            log.warning("request %s: the landing of transfer %d was replaced while it was "
                        "verified: its verdict is void", rid, transfer_id,
                        extra=fields(rid, res.prefill_address))
            return []
        if verdict.ok:
            request_log.info("request %s: Success (%d bytes landed in slot %d; %s%s)", rid,
                             res.nbytes, res.slot, verdict.detail, verdict.timing,
                             extra=fields(rid, res.prefill_address))
            return []
        if failed is None:
            return []  # it had ended already (aborted, timed out): its own path frees it
        log.error("request %s failed: integrity: %s", rid, verdict.detail,
                  extra=fields(rid, res.prefill_address))
        actions = self._free(rid, "integrity failure")
        conn = self._prefill_conn(res)
        if conn is not None:
            actions.append(TellPrefill(conn, rid,
                                       f"decode integrity check failed: {verdict.detail}"))
        return actions

    def _transferring(self, rid: str, now: float, *, progress: bool = False) -> None:
        """An offered request landed without a BeginWrite: it is Transferring now (its
        deadline bounds the wait for the digests). ``progress``: a piece of it landed;
        one already Transferring has its deadline restarted."""
        state = self.table.state_of(rid)
        if state is TransferState.BOOTSTRAPPING:
            self.table.advance(rid, TransferState.TRANSFERRING,
                               through=(TransferState.WAITING_FOR_INPUT,), now=now)
        elif state is TransferState.WAITING_FOR_INPUT:
            self.table.advance(rid, TransferState.TRANSFERRING, now=now)
        elif progress and state is TransferState.TRANSFERRING:
            self.table.touch(rid, now=now)

    # ---- timers, answers, a lost peer -----------------------------------------------------
    def on_deadline(self, status: TransferStatus) -> Actions:
        """A deadline passed: make sure prefill stops, then free the slot."""
        return self._stop_prefill_then_free(status.request_id,
                                            f"decode timed out: {status.detail}")

    def periodic(self, now: float) -> Actions:
        """Free Success slots whose hand-off lease expired without a Release; ask again
        about the aborts prefill has not confirmed, and release the link of one past its
        transfer budget."""
        stale = [(r.request_id, r.prefill_address) for r in self._res.values()
                 if r.success_at is not None and now - r.success_at > self.handoff_lease_s]
        ask, overdue = self._unconfirmed_due(now)
        actions: Actions = []
        for rid, peer in stale:
            log.warning("request %s: no Release within the %.0f s hand-off lease; slot freed",
                        rid, self.handoff_lease_s, extra=fields(rid, peer))
            actions += self._free(rid, "hand-off lease expired")
        actions += [DrainPrefill(res.ref, self._prefill_conn(res), abort.detail)
                    for res, abort in ask]
        for res in overdue:
            actions += self._overdue(res)
        return actions

    def _unconfirmed_due(self, now: float
                         ) -> tuple[list[tuple[Incoming, UnconfirmedAbort]], list[Incoming]]:
        """Aborts prefill has not confirmed: those to ask again (a few at a time), and
        those past their transfer budget, whose link goes."""
        ask: list[tuple[Incoming, UnconfirmedAbort]] = []
        overdue: list[Incoming] = []
        unconfirmed = [(r, r.unconfirmed) for r in self._res.values()
                       if r.unconfirmed is not None]
        asking = sum(abort.asking for _r, abort in unconfirmed)
        for r, abort in unconfirmed:
            if abort.asking:
                continue
            if now - abort.since > self.transfer_budget(r.nbytes):
                abort.asking = True
                overdue.append(r)
            elif now - abort.asked_at >= self.ask_again_s and asking < MAX_ASKING:
                abort.asking, asking = True, asking + 1
                ask.append((r, abort))
        return ask, overdue

    def _overdue(self, res: Incoming) -> Actions:
        """An abort unconfirmed past the request's transfer budget: release its link only
        (the request is freed once it is: :meth:`link_dropped`), or free it now when that
        link is gone already."""
        conn = self.peers.get(res.peer_instance)
        if conn is not None and conn.link.id == res.link_id:
            log.warning("request %s: prefill did not confirm its writes drained within %.0f s: "
                        "releasing the link to %s; requests on it stay for prefill's resend",
                        res.request_id, self.transfer_budget(res.nbytes), conn.control_address,
                        extra=fields(res.request_id, res.prefill_address))
            return [DropLink(conn, f"prefill did not confirm the abort of {res.request_id}",
                             gone=False)]
        return self._free(res.request_id, "its link was released: no write of it can land")

    def drain_answered(self, ref: RecordRef, detail: str, confirmed: bool,
                       now: float) -> Actions:
        """Prefill answered the Abort of :class:`DrainPrefill` (``confirmed``: its writes
        drained). Freed once it confirmed or the request's link is gone; otherwise only
        this slot stays held (:meth:`periodic` asks again, then releases the link)."""
        res = self._record(ref)
        if res is None:
            return []  # freed meanwhile (its link went, say)
        if confirmed or self._link_gone(res):
            return self._free(res.request_id, detail)
        if res.unconfirmed is not None:
            res.unconfirmed.asking, res.unconfirmed.asked_at = False, now
        else:
            res.unconfirmed = UnconfirmedAbort(since=now, detail=detail, asked_at=now)
            log.warning("request %s: prefill did not confirm that its writes drained; slot %d "
                        "stays held until it does, its link goes, or %.0f s pass (then decode "
                        "releases that link); the peer's other requests go on", res.request_id,
                        res.slot, self.transfer_budget(res.nbytes),
                        extra=fields(res.request_id, res.prefill_address))
        return []

    def link_dropped(self, conn: PeerConn, detail: str, *, gone: bool, now: float) -> Actions:
        """``conn`` was removed and its link released (no more writes can land over it).

        ``gone`` False means only the link died (its QP failed, or the same instance
        handshook again): every reservation stays, those it began writing included,
        since prefill resends them on its next link (a new BeginWrite) or, failing,
        tells us by Abort; their deadlines still bound them. Requests that failed while
        prefill might still write over it (an abort not confirmed) are freed now.
        ``gone`` True (heartbeats lost, the peer restarted): its requests fail and their
        slots are freed at once.
        """
        if not gone:
            on_link = [r.request_id for r in self._res.values() if r.link_id == conn.link.id]
            actions: Actions = []
            for rid in on_link:
                snap = self.table.get(rid)
                if snap is not None and snap.state is TransferState.FAILED:
                    actions += self._free(rid, "its link was released: no write of it can land")
            return actions
        mine = [r for r in self._res.values()
                if r.peer_instance == conn.instance_id
                or (not r.peer_instance and r.prefill_address == conn.control_address)]
        actions = []
        for res in mine:
            if self.table.fail(res.request_id, FailureReason.PEER_FAILED, detail, now=now):
                log.warning("request %s failed: %s", res.request_id, detail,
                            extra=fields(res.request_id, res.prefill_address))
            snap = self.table.get(res.request_id)
            if snap is not None and snap.state is TransferState.FAILED:
                actions += self._free(res.request_id, "peer lost")
        return actions

    # ---- shutdown, an engine's memory ---------------------------------------------------
    def fail_live(self, detail: str, now: float) -> list[tuple[PeerConn, str]]:
        """Fail every live request (reason shutdown); the (connection, request id) of
        each whose prefill is connected, to be told at once (the driver's Aborts)."""
        calls: list[tuple[PeerConn, str]] = []
        for snap in self.table.live():
            if self.table.fail(snap.request_id, FailureReason.SHUTDOWN, detail, now=now):
                res = self._res.get(snap.request_id)
                conn = self._prefill_conn(res) if res is not None else None
                if conn is not None:
                    calls.append((conn, snap.request_id))
        return calls

    def free_all(self, why: str) -> Actions:
        """Forget every request and free its slot (after every link was released)."""
        rids = list(self._res)
        actions: Actions = []
        for rid in rids:
            actions += self._free(rid, why)
        return actions

    def _adopt(self, spec: PoolSpec, layout: SideLayout) -> None:
        """Pools came: reserve slots (and their items) of their config from now on."""
        self.slots = SlotPool(spec.num_req_slots)
        self._fit_mailbox(spec, layout)
        self._pages = PageBook()

    def use_mailbox(self, mailbox: RecordArea) -> None:
        """The daemon's digest mailbox (registered, advertised) from now on (an engine
        attach gives it before the pools: :meth:`take_pools`)."""
        self.mailbox = mailbox

    def _fit_mailbox(self, spec: PoolSpec, layout: SideLayout) -> None:
        """Keep a mailbox with a slot per request slot that holds this layout's record;
        the core makes its own when it has none that does (a test's core: a daemon's
        runtime gives it one it registered)."""
        box, size = self.mailbox, record_bytes(len(layout.flat_buffers))
        if box is not None and box.slots >= spec.num_req_slots and box.record_bytes >= size:
            return
        if box is not None:
            log.error("the daemon's digest mailbox (%d slots of %d bytes) does not fit %d "
                      "slots of %d: using an unregistered one, prefill will refuse it",
                      box.slots, box.record_bytes, spec.num_req_slots, size)
        self.mailbox = RecordArea(max(1, spec.num_req_slots), size)

    # ---- helpers -----------------------------------------------------------------------
    def _reservation(self, rid: str) -> Incoming:
        res = self._res.get(rid)
        if res is None:
            raise UnknownRequest(f"no reservation for request {rid!r} on this decode daemon")
        return res

    def _free(self, rid: str, why: str) -> Actions:
        """Forget the request and free its pages and slot: :class:`Freed` (nothing when it
        was forgotten already)."""
        res = self._res.pop(rid, None)
        if res is not None:
            self._by_transfer.pop(res.transfer_id, None)
            self.table.keep_facts(rid, res.facts(self._verification(rid)))
        self._pages.release(rid)
        if res is None:
            return []
        if self.slots.release(rid) is not None:
            request_log.info("request %s: slot %d freed (%s)", rid, res.slot, why,
                             extra=fields(rid, res.prefill_address))
        return [Freed(rid)]  # after the pages and the slot: the engine may reuse them

    def _stop_prefill_then_free(self, rid: str, detail: str) -> Actions:
        res = self._res.get(rid)
        if res is None:
            return []
        if not res.peer_instance:  # prefill never got the indices: it cannot write
            actions = self._free(rid, detail)
            conn = self._prefill_conn(res)
            if conn is not None:
                actions.append(TellPrefill(conn, rid, detail))
            return actions
        return [DrainPrefill(res.ref, self._prefill_conn(res), detail)]

    def _link_gone(self, res: Incoming) -> bool:
        """The link the request was granted on is released: none of its writes can land."""
        conn = self.peers.get(res.peer_instance)
        return conn is None or conn.closed or conn.link.id != res.link_id

    def _prefill_conn(self, res: Incoming) -> PeerConn | None:
        """The live connection to the request's prefill (the granted instance, if any)."""
        conn = (self.peers.get(res.peer_instance) if res.peer_instance
                else self.peers.by_address(res.prefill_address))
        return None if conn is None or conn.closed else conn
