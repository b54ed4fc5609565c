"""Prefill's driver: the one place its core's decisions become I/O.

:class:`PrefillDriver` is what the daemon calls (the servicer, the engine channel, the
runtime's loops): every call hands an event to
:class:`~kvbeam.server.core.prefill.PrefillCore`, which returns actions
(:mod:`kvbeam.server.core.prefill_actions`), and the driver does them: it handshakes
with a decode daemon, asks decode for a grant (BeginWrite), starts a request's
digests and posts its writes and digest record, tells decode of a failure, releases a
link, counts. What an action brings back (a connection, decode's answer, a post's
outcome, a released link) goes to the core as its next event, and the actions of that
are done in turn.

Threads: nothing here starts one. The core is called on the daemon's loop only: a
call from another thread (a gRPC handler, an executor job) is handed to the loop and
waited for (``DriverBase.on_loop``, :meth:`PrefillDriver._event`). A list of actions
runs in order: on the loop until an action that blocks (a handshake, a peer call, a
link's release, a digest record whose digests are still being computed), and from
there on the daemon's bounded executor (``io``), so what follows a link's release
sees it released; what an action there brings back goes to the core on the loop
again. A step runs on the loop when the core says it cannot block
(:meth:`PrefillCore.steps_inline`), else from its own executor job (a fresh stack).
No lock is held while any action runs; the Abort handler's wait for a drain (off the
loop only: on it the completions could not come) is on the core's condition, bounded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kvbeam.errors import Busy, NotPosted, PeerTimeoutError, SendFailed
from kvbeam.logs import fields, request_log
from kvbeam.pools.digest import DIGEST_BYTES, DigestParts, digest_parts
from kvbeam.pools.digest_pool import DigestJob, DigestPool
from kvbeam.pools.engine_indices import ListLike
from kvbeam.pools.mailbox import RecordArea, encode_record
from kvbeam.pools.plan import side_windows
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.actions import Count, DropLink, RecordRef
from kvbeam.server.core.base import DriverBase, named
from kvbeam.server.core.outgoing import Ranges
from kvbeam.server.core.ports import DecodePeers, WriteGrant, abort_at_shutdown
from kvbeam.server.core.prefill import PrefillCore
from kvbeam.server.core.prefill_actions import (
    Actions,
    AskGrant,
    Connect,
    DigestInputs,
    PostWrites,
    PrefillAction,
    RunStep,
    TellDecode,
)
from kvbeam.server.core.prefill_record import RecordStager, StagingSlot
from kvbeam.server.state.lifecycle import TransferTable
from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.states import FailureReason, TransferStatus
from kvbeam.transport import Event
from kvbeam.transport.blocks import Blocks

log = logging.getLogger(__name__)

#: Abort handlers that may wait on a request's drain at once; the others answer at once
#: (the answer then says writes are in flight): a burst of aborts must not hold every
#: thread that answers the peer channel's requests (``PEER_WORKERS``) or the RPCs.
ABORT_WAITERS = 4
#: Longest an Abort handler waits on its request's drain, s (less if its caller's
#: deadline is nearer): writes in flight usually complete within milliseconds.
ABORT_WAIT_S = 2.0
#: Connects (decode daemons asking prefill to handshake with them) handled at once;
#: more are refused RESOURCE_EXHAUSTED (each holds a handler thread for a handshake).
MAX_CONNECTS = 4
#: Longest a caller waits for another caller's handshake with the same decode, s (a
#: handshake is bounded by its RPC deadline and the peer channel's HELLO: far less).
DIAL_WAIT_S = 30.0


class Writer:
    """How the driver puts a step's writes onto their link and encodes a request's digest
    record: the driver's one seam for what goes on the wire, which a decorator may wrap
    (``--enable-fault-injection`` arms one at start: :mod:`kvbeam.server.faults`)."""

    @property
    def may_block(self) -> bool:
        """Whether :meth:`write` may block beyond posting (a step then runs on the
        executor only, never on the thread that handled an event)."""
        return False

    def write(self, request_id: str, conn: PeerConn, transfer_id: int, blocks: Blocks, *,
              notify: bool, first: bool) -> None:
        """Post ``blocks`` on ``conn``'s link as (a part of) transfer ``transfer_id``;
        ``first``: the step's first write."""
        conn.link.write(transfer_id, blocks, notify=notify)

    def record(self, request_id: str, transfer_id: int, slot: int, digests: bytes,
               marks: int) -> bytes:
        """The request's digest record (pools/mailbox.py) for decode's mailbox ``slot``."""
        return encode_record(transfer_id, slot, request_id, digests, marks=marks)


class PrefillDriver(DriverBase[PrefillCore]):
    """Prefill's API for the daemon: each call is an event for the core, whose actions
    it does. See the module docstring."""

    role = "prefill"

    def __init__(self, *, table: TransferTable, peers: Peers, decode: DecodePeers, io: Executor,
                 integrity: bool, drain_s: float,
                 transfer_budget: Callable[[int], float] = lambda _n: 0.0,
                 resend_retries: int = 0, on_resend: Callable[[], None] = lambda: None,
                 max_offers: int = 1024,
                 on_offer: Callable[[str], None] = lambda _event: None,
                 send_wait_s: float = 0.0, digest_pool: DigestPool | None = None,
                 staging_slots: int = 256, clock: Callable[[], float]) -> None:
        """``decode``: the calls to decode daemons (gRPC in the daemon, fakes in tests);
        ``io``: the daemon's bounded executor; ``digest_pool``: the threads integrity's
        digests are computed on (owned by the daemon; None: on the calling thread);
        ``on_resend``, ``on_offer``: metrics. The rest is the core's (:class:`PrefillCore`)."""
        self.core = PrefillCore(table=table, peers=peers, integrity=integrity,
                                drain_s=drain_s, transfer_budget=transfer_budget,
                                resend_retries=resend_retries, max_offers=max_offers,
                                send_wait_s=send_wait_s, staging_slots=staging_slots)
        self.decode = decode
        self.io = io
        #: How the step's writes go onto their link and how a digest record is encoded.
        self.writer = Writer()
        self.digest_pool = digest_pool or DigestPool(0)  # 0: on the calling thread
        self.clock = clock
        self.on_resend = on_resend
        self.on_offer = on_offer
        # Counts the Abort handlers waiting on a drain (taken without blocking).
        self._abort_waiters = threading.BoundedSemaphore(ABORT_WAITERS)
        # Counts the Connect handlers under way (taken without blocking).
        self._connects = threading.BoundedSemaphore(MAX_CONNECTS)
        # Handshakes under way, by decode address: a second caller waits for the
        # first's outcome instead of handshaking again. Taken before Peers' (a leaf).
        self._dial_lock = threading.Lock()
        self._dials: dict[str, Future[PeerConn]] = {}

    # ---- what the daemon reads ----------------------------------------------------------
    @property
    def integrity(self) -> bool:
        """Whether requests carry digests."""
        return self.core.integrity

    def in_flight(self, request_id: str) -> int:
        """Writes of the request that may still read its source (0 once drained)."""
        return self.on_loop(lambda: self.core.in_flight(request_id))

    def slot_of(self, request_id: str) -> int:
        """-1: prefill holds no request slots, its requests are addressed by their lists
        (a gRPC Send's source slot is turned into its lists at the API)."""
        return -1

    def known(self, request_id: str) -> bool:
        """True while the core keeps a record of the request (tests, diagnostics)."""
        return self.on_loop(lambda: self.core.known(request_id))

    def use_staging(self, area: RecordArea) -> None:
        """The daemon's staging slots for digest records (registered LOCAL) from now on."""
        self.on_loop(lambda: self.core.use_staging(area))

    # ---- the API: engines, schedulers, decode's Offer and Abort -------------------------
    def send(self, request_id: str, seq_len: int, decode_address: str, ranges: Ranges,
             final: bool, *, indices: Mapping[IndexKind, ListLike] | None = None,
             draft: Mapping[IndexKind, ListLike] | None = None,
             kv_offset: int | None = None, layers: int | None = None) -> TransferStatus:
        """Queue (a chunk of) a request for decode (:meth:`PrefillCore.send`); returns at
        once with its status (its step may have posted already, on the loop)."""
        self._event(lambda: self.core.send(request_id, seq_len, decode_address,
                                           ranges, final, indices=indices, draft=draft,
                                           kv_offset=kv_offset, layers=layers,
                                           now=self.clock()))
        return self.core.status(request_id)

    def offer(self, request_id: str, instance_id: str, seq_len: int, grant: WriteGrant,
              lease_s: float) -> bool:
        """Decode offers a reservation ahead of Send (:meth:`PrefillCore.offer`); True
        when it is kept."""
        def offer() -> bool:
            kept, actions = self.core.offer(request_id, instance_id, seq_len, grant, lease_s,
                                            self.clock())
            self.execute(actions)
            return kept

        return self.on_loop(offer)

    def connect_back(self, address: str, instance_id: str = "") -> PeerConn:
        """A decode daemon at ``address`` holds a reservation naming this prefill and the
        pair has no connection (its Connect RPC): handshake with it now, as a Send to it
        would (one handshake per address at a time; the requests waiting for it go on).
        Blocking: the gRPC handler's thread. Decode-initiated pairing, docs/protocol.md.

        Raises:
            NoEngineAttached: no engine memory yet (nothing to describe at a handshake).
            Busy: ``MAX_CONNECTS`` Connects are under way.
            PoolCompatibilityError, ProtocolVersionError, PeerError, ...: the handshake
                failed, as it fails a Send (the message is the refusal's).
        """
        _ = self.core.layout  # NoEngineAttached while there is none
        conn = self.core.peers.by_address(address)
        if (conn is not None and not conn.closed and conn.retired_channel() is None
                and (not instance_id or conn.instance_id == instance_id)):
            return conn  # connected meanwhile (a Send to it, or another Connect)
        if not self._connects.acquire(blocking=False):
            raise Busy(f"{MAX_CONNECTS} Connects from decode daemons are under way here; "
                       "the reservation's own deadline still bounds it")
        try:
            if conn is not None and not conn.closed:
                # Its peer channel closed, or it is to an earlier instance of that decode
                # (which restarted or re-attached): a new connection replaces it.
                retired = conn.retired_channel()
                log.info("decode %s asked to connect: %s; dropping that connection, a new "
                         "handshake opens another", address,
                         f"its peer channel closed ({retired.close_reason})"
                         if retired is not None else
                         f"it is to instance {conn.instance_id}, decode is {instance_id}")
                self._drop_link(DropLink(conn, "decode asked for a new connection",
                                         gone=conn.instance_id != instance_id
                                         and bool(instance_id)), on_executor=False)
            new, error = self._connect(address, on_executor=False)
        finally:
            self._connects.release()
        if error is not None:
            raise error
        assert new is not None
        return new

    def abort(self, request_id: str, *, from_peer: bool, detail: str,
              wait_s: float | None = None, instance_id: str = "",
              caller_refusal: Callable[[str], str | None] | None = None,
              reason: FailureReason | None = None) -> TransferStatus:
        """Fail the request; wait a little for its writes to drain; tell decode.

        The wait is bounded by ``ABORT_WAIT_S`` and ``wait_s`` (what the caller's
        deadline leaves; None: no deadline) and taken by at most ``ABORT_WAITERS`` calls at
        once; :meth:`in_flight` then says whether the writes drained. Those that did
        not drain are told to decode by Abort once they do (or the link is released:
        the sweep abandons them after ``drain_s``), even when decode asked.

        ``from_peer`` (decode reports its verdict: reason peer_failed, decode needs no
        Abort back) is taken only from the request's own decode, the rule decode applies
        to prefill's Aborts: with ``caller_refusal`` given (the daemon's handler; None: a
        test of the core, nothing checked), ``instance_id`` must be the decode instance
        the request is connected to (if any) and the caller's credentials must cover the
        request's decode address. Anyone else's claim is a scheduler's abort. ``reason``:
        decode's verdict's own reason (incompatible: the pair's handshake was refused),
        in place of peer_failed.
        """
        if from_peer and caller_refusal is not None:
            from_peer = self._from_its_decode(request_id, instance_id, caller_refusal)
        failed = self.on_loop(lambda: self.core.abort(
            request_id, from_peer=from_peer, detail=detail, now=self.clock(),
            reason=reason if from_peer else None))
        if failed is None:
            return self.core.status(request_id)  # ended and pruned, or UnknownRequest
        ref, said = failed
        drained = self._wait_drained(ref, wait_s)
        self._event(lambda: self.core.abort_answered(ref, from_peer=from_peer,
                                                     drained=drained, detail=said))
        return self.core.status(request_id)

    def _wait_drained(self, ref: RecordRef, wait_s: float | None) -> bool:
        """Whether the request's writes drained, waiting for them a bounded while when a
        waiter's permit is free: on an event the loop sets once they drained (never on
        the loop itself, through which their completions come)."""
        bound = min(self.core.drain_s, ABORT_WAIT_S, ABORT_WAIT_S if wait_s is None else wait_s)
        if self.on_loop_thread or bound <= 0 or not self._abort_waiters.acquire(blocking=False):
            return self.on_loop(lambda: self.core.drained(ref))
        try:
            event = self.on_loop(lambda: self.core.watch_drain(ref))
            if event is None:
                return True
            if event.wait(bound):
                return True
            # Not drained within the bound: stop watching (unless it drained just now).
            self.on_loop(lambda: self.core.unwatch_drain(ref, event))
            return event.is_set()
        finally:
            self._abort_waiters.release()

    def _from_its_decode(self, request_id: str, instance_id: str,
                         caller_refusal: Callable[[str], str | None]) -> bool:
        """Whether an Abort that says it is decode's comes from the request's decode."""
        known = self.on_loop(lambda: self.core.decode_of(request_id))
        if known is None:
            return True  # nothing here to protect (ended, unknown, or not yet sent)
        conn, address = known
        if not address:
            # A Send that named no decode, which no decode offered yet: any decode that
            # knows its id may end it (decode declined it, or its reservation failed),
            # as any caller that passes authentication may abort a request on prefill.
            return True
        # The check may resolve the decode's host name: no lock is held here.
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

    # ---- events from the transport and the runtime's loops ------------------------------
    def on_event(self, event: Event) -> None:
        """A transport event (a write's completion, a failed link): the loop's (another
        thread's is handed to it, as every call into the core)."""
        self._event(lambda: self.core.handle_event(event, self.clock()))

    def on_deadline(self, status: TransferStatus) -> None:
        """A deadline passed (the table failed it): decode is told once its writes drained."""
        self._event(lambda: self.core.handle_deadline(status))

    def on_peer_lost(self, conn: PeerConn, detail: str, *, gone: bool = True) -> None:
        """Release the link (its writes complete as failed), then fail or resend its
        requests (:meth:`PrefillCore.link_dropped`). Blocking (the link's release): on
        the executor or a daemon loop, never under a lock; what follows (Aborts to
        decode, resends) goes to the executor, so a heartbeat loop is not held by it."""
        self._drop_link(DropLink(conn, detail, gone), on_executor=False)

    def periodic(self) -> None:
        """The sweep's work (:meth:`PrefillCore.periodic`), every SWEEP_S."""
        self._event(lambda: self.core.periodic(self.clock()))

    def shutdown(self, detail: str = "prefill shutting down") -> None:
        """Fail every live request (reason shutdown), tell decode, release links.

        Decode is told of every request at once, within ``SHUTDOWN_ABORT_S`` in all.
        """
        failed = self.on_loop(lambda: self.core.fail_live(detail, self.clock()))
        abort_at_shutdown(failed, detail, "decode", self.decode.abort_all, self.clock)
        self.core.peers.close_all()

    # ---- doing the actions ----------------------------------------------------------------
    def _event(self, event: Callable[[], Actions], on_executor: bool = False) -> None:
        """Give the core an event and do its actions, on the daemon's loop: here when
        this is the loop (or no loop serves: a unit test's driver, where ``on_executor``
        says whether this thread may block), else handed to the loop and waited for
        (what blocks goes on to the executor from there)."""
        if self._off_loop:
            self.on_loop(named(lambda: self.execute(event()), event))
        else:
            self.execute(event(), on_executor)

    def execute(self, actions: Actions, on_executor: bool = False) -> None:
        """Do ``actions`` in order: here until one blocks (``on_executor`` False: this
        thread must not block), then the rest, in order, as one executor job."""
        for i, action in enumerate(actions):
            if not on_executor and type(action) is not RunStep and self._blocks(action):
                self.io.submit(self.execute, actions[i:], True)
                return
            try:
                self._do(action, on_executor)
            except Exception:  # one action's failure (a bug, a peer call) spares the rest
                log.exception("prefill: doing %s failed", type(action).__name__)

    def _blocks(self, action: PrefillAction) -> bool:
        """Whether doing ``action`` may block: a handshake, a peer call, a link's release;
        a post when its writer says so (:attr:`Writer.may_block`)."""
        kind = type(action)  # the action types are final: identity, not isinstance
        if kind is PostWrites:
            return self.writer.may_block
        return kind is not Count

    def _run_step(self, step: RunStep, on_executor: bool) -> None:
        """A step here when the core says it cannot block (and the writer cannot either);
        else its own executor job, a fresh stack (a chunked request's steps follow one
        another)."""
        if self._off_loop:  # what follows a blocking action, on the executor: the core's
            self.on_loop(lambda: self._run_step(step, on_executor=False))  # calls go back
            return
        ref = step.ref
        now = self.clock()
        if self.core.steps_inline(ref, now) and not self.writer.may_block:
            self.execute(self.core.step(ref, now), on_executor)
        else:
            self.io.submit(self._step_job, ref)

    def _step_job(self, ref: RecordRef) -> None:
        self._event(lambda: self.core.step(ref, self.clock()), on_executor=True)

    def _do(self, action: PrefillAction, on_executor: bool) -> None:
        """Do one action (the caller placed it on a thread that may run it)."""
        # One lookup by the action's type, not a chain of isinstance tests (a step, the
        # most frequent, came last: six of them).
        _DOERS[type(action)](self, action, on_executor)

    def _do_connect(self, action: Connect, on_executor: bool) -> None:
        self._connect(action.address, on_executor)

    def _count(self, action: Count, on_executor: bool) -> None:
        if action.metric == "resends":
            self.on_resend()
        else:
            self.on_offer(action.label)

    def _tell_decode(self, tell: TellDecode, on_executor: bool) -> None:
        """Abort the request on decode over the pair's peer channel. When every link the
        request had is gone (a link that failed on each resend), decode keeps its
        reservation for a resend that is not coming: the channel kept from the failed
        link says so (:meth:`~kvbeam.server.state.peers.Peers.keep`), else a new
        handshake, as a Send's, opens one (not for a request that never connected:
        decode granted it nothing, and its Offer, if one comes, is answered by an
        Abort)."""
        if tell.conn is not None and not self.decode.reaches(tell.conn, tell.address):
            _conn, error = self._connect(tell.address, on_executor)
            if error is not None:
                log.info("could not tell decode %s that %s failed: %s", tell.address,
                         tell.request_id, error, extra=fields(tell.request_id, tell.address))
                return
        self.decode.abort(tell.conn, tell.address, tell.request_id, tell.detail)

    def _drop_link(self, action: DropLink, on_executor: bool) -> None:
        """Remove the connection and release its link (its writes complete as failed);
        then the core fails or resends the requests on it."""
        self.core.peers.remove(action.conn)
        # Only the link failed: the peer channel stays, the way to tell decode of a
        # request whose resend finds no new link (decode waits for that resend).
        action.conn.close(keep_channel=not action.gone)
        if not action.gone:
            self.core.peers.keep(action.conn)
        self._event(lambda: self.core.link_dropped(action.conn, action.detail,
                                                   gone=action.gone, now=self.clock()),
                    on_executor)

    def _connect(self, address: str, on_executor: bool
                 ) -> tuple[PeerConn | None, Exception | None]:
        """Handshake with decode at ``address``; the core starts what waited for it.
        Returns the connection or the handshake's error."""
        conn: PeerConn | None = None
        error: Exception | None = None
        began = self.clock()
        try:
            conn = self._dial(address)
        except Exception as exc:
            error = exc
        self._event(lambda: self.core.connected(address, conn, error, began=began,
                                                now=self.clock()), on_executor)
        return conn, error

    def _dial(self, address: str) -> PeerConn:
        """The handshake with decode at ``address``, one at a time per address: a caller
        that finds one under way (a Send's step and decode's Connect, at once) waits for
        its outcome (bounded) instead of making a second link."""
        with self._dial_lock:
            pending = self._dials.get(address)
            mine = pending is None
            if pending is None:
                # A dial that ended since the caller looked (its step saw no connection,
                # then queued: a Connect's dial finished meanwhile) made the connection
                # this one would make again (Peers' and its locks: leaves, inside this one).
                existing = self.core.peers.by_address(address)
                if existing is not None and not existing.closed and \
                        existing.retired_channel() is None:
                    return existing
                pending = self._dials[address] = Future()
        if not mine:
            try:
                return pending.result(timeout=DIAL_WAIT_S)
            except FutureTimeout:
                raise PeerTimeoutError(f"handshake with decode at {address}: another "
                                       f"caller's did not end within {DIAL_WAIT_S:.0f} s",
                                       address=address) from None
        try:
            conn = self.decode.connect(address)
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        else:
            # In the registry before the dial is over: a caller that looks for a
            # connection to this address from now on (a Connect from that decode) finds
            # this one, not none (the core hears of it on the loop, a moment later).
            self.core.peers.add(conn)
            pending.set_result(conn)
            return conn
        finally:
            with self._dial_lock:
                self._dials.pop(address, None)

    def _ask_grant(self, ask: AskGrant, on_executor: bool) -> None:
        """BeginWrite: decode's grant for the chunk, or why there is none."""
        grant: WriteGrant | None = None
        error: Exception | None = None
        began = self.clock()
        try:
            grant = self.decode.begin_write(ask.conn, ask.ref.request_id, ask.seq_len,
                                            self.core.integrity)
        except Exception as exc:
            error = exc
        ended = self.clock()
        self._event(lambda: self.core.granted(ask.ref, ask.conn, ask.chunk, grant, error,
                                              elapsed=ended - began, now=ended),
                    on_executor)

    def _post(self, post: PostWrites, on_executor: bool) -> None:
        """Post the chunk's writes; with integrity the digests run on the digest pool
        while the data goes out and the record follows (at the end of the data's own
        write when they are at hand, else as one more write once they are)."""
        ref, conn, digest = post.ref, post.conn, post.digest
        writes = post.writes
        # The source does not change while the request lives: its digests are computed
        # once, while the writes are in flight. Digests with nothing to overlap (a small
        # request's job runs inline on this thread; a resend's are kept) put the record
        # at the end of the data's own write (one transfer, one completion).
        job = None
        if post.record and digest is not None and digest.digests is None:
            job = self._digest_job(digest, conn)
        together = post.record and (job is None or job.inline)
        separate = post.record and not together
        try:
            booked = self.on_loop(lambda: self.core.book(post, separate=separate))
        except SendFailed as exc:  # no staging slot for its record: nothing was booked
            if post.moved is not None:
                self._announce(post.moved)
            refused = exc
            self._event(lambda: self.core.step_failed(ref, conn, refused, self.clock()),
                        on_executor)
            return
        if booked is None:
            # It ended meanwhile: nothing to post.
            self._event(lambda: self.core.posted(ref, self.clock()), on_executor)
            return
        staging = booked.staging
        write, rid = self.writer.write, ref.request_id
        posted = 0
        try:
            for tid, part, notify in writes[:-1]:  # the marks: decode digests each as it lands
                write(rid, conn, tid, part, notify=notify, first=not posted)
                posted += 1
            tid, part, notify = writes[-1]
            if together:  # the record is the data write's last block
                part = Blocks.concat([part, self._record_blocks(post, job, staging)])
            write(rid, conn, tid, part, notify=notify and not separate, first=not posted)
        except Exception as exc:
            if post.moved is not None:
                self._announce(post.moved)
            # Only what was not posted: the rest completes as usual.
            left, error = len(writes) - posted, NotPosted(exc)
            self.on_loop(lambda: self.core.unbook(post, left=left, separate=separate))
            self._event(lambda: self.core.step_failed(ref, conn, error, self.clock()),
                        on_executor)
            return
        if post.moved is not None:  # its engine hears of Transferring after the bytes left
            self._announce(post.moved)
        if post.digest_early and digest is not None and digest.digests is None:
            self._digest_early(post, digest)
        request_log.info("request %s: posted %s%d bytes in %d blocks to %s%s", rid,
                         "final chunk, " if post.final else "chunk, ", post.total_bytes,
                         post.num_blocks, conn.control_address, self._marks_said(post),
                         extra=fields(rid, post.decode_address))
        if separate and not on_executor:
            # The digests are still being computed: the record waits for them on the
            # executor, and the step ends there.
            self.io.submit(self._post_record, post, job, staging)
        elif separate:
            self._post_record(post, job, staging)
        else:
            self._event(lambda: self.core.posted(ref, self.clock()), on_executor)

    @staticmethod
    def _marks_said(post: PostWrites) -> str:
        """The marks of a chunk's log line: how many sub-batches it made whole (decode
        verifies each as it lands), and with the final chunk how many came before."""
        if not post.marks:
            return ""
        grant = post.grant.transfer_id
        now = sum(1 for tid, _blocks, notify in post.writes if notify and tid != grant)
        if post.final:
            return f" ({post.marks} sub-batches marked before the last, {now} in this chunk)"
        return f" ({now} sub-batches marked whole in this chunk)" if now else ""

    def _announce(self, snap: TransferStatus) -> None:
        """Tell the table's observers (the engine's push, the metrics) of a change the
        core made without telling them, on the loop, where they run for every other
        change: handed to it without waiting from the executor (a later change they saw
        first wins: they keep the newest version)."""
        loop = self.loop
        if self._off_loop and loop is not None and not loop.stopped:
            loop.call_soon_threadsafe(lambda: self.table.announce(snap))
        else:  # the loop (or no loop serves, or it stopped: shutdown's stragglers)
            self.table.announce(snap)

    def _post_record(self, post: PostWrites, job: DigestJob | None,
                     staging: StagingSlot | None) -> None:
        """Post the request's digest record once its digests are done (the step's last
        write, counted when the data was booked); then the step ends. Blocking."""
        ref, conn = post.ref, post.conn
        try:
            self.writer.write(ref.request_id, conn, post.grant.transfer_id,
                              self._record_blocks(post, job, staging), notify=True,
                              first=False)
        except Exception as exc:
            error = NotPosted(exc)
            self.on_loop(lambda: self.core.unbook(post, left=0, separate=True))
            self._event(lambda: self.core.step_failed(ref, conn, error, self.clock()),
                        on_executor=True)
            return
        self._event(lambda: self.core.posted(ref, self.clock()), on_executor=True)

    def _record_blocks(self, post: PostWrites, job: DigestJob | None,
                       staging: StagingSlot | None) -> Blocks:
        """The request's digest record as the block that writes it into decode's mailbox
        (:meth:`RecordStager.blocks`); computed once per request, a resend writes the
        same digests with its new transfer id. It may wait for the digest pool, so it
        runs on the loop only when the job ran inline (the record goes with the data)."""
        ref, grant, digest = post.ref, post.grant, post.digest
        # A step that posts the record: the core gave both (PostWrites.digest, Booked).
        assert digest is not None and staging is not None
        digests = digest.digests
        if digests is None:
            done = digests = (job or self._digest_job(digest, post.conn)).result()
            self.on_loop(lambda: self.core.keep_digests(ref, done))
        raw = self.writer.record(ref.request_id, grant.transfer_id, grant.mailbox_slot,
                                 digests, post.marks)
        return RecordStager.blocks(staging, post.conn, grant, raw,
                                   len(digests) // DIGEST_BYTES)

    def _digest_parts(self, digest: DigestInputs, conn: PeerConn) -> DigestParts:
        """What the request's digests cover: the bytes of each item it moves to
        ``conn``'s decode that decode's layout takes, one part per flat buffer."""
        return digest_parts(self.core.pools, digest.source, draft=digest.draft,
                            windows=side_windows(self.core.layout, conn.peer.layout,
                                                 source=True))

    def _digest_early(self, post: PostWrites, digest: DigestInputs) -> None:
        """Start digesting the sub-batches this step made whole (their bytes no longer
        change: the engine's pages stay put until the request ends), so the final chunk
        digests only the rest (:meth:`_digest_job`)."""
        parts = self._digest_parts(digest, post.conn)
        jobs = {(lo, hi): self.digest_pool.start(parts[lo:hi])
                for lo, hi in post.digest_early if (lo, hi) not in digest.early}
        self.on_loop(lambda: self.core.keep_digest_jobs(post.ref, jobs))

    def _digest_job(self, digest: DigestInputs, conn: PeerConn) -> DigestJob:
        """The request's digests, started on the digest pool: the jobs its sub-batches
        started as they became whole, and one for the buffers no job covers."""
        parts = self._digest_parts(digest, conn)
        if not digest.early:
            return self.digest_pool.start(parts)
        jobs, at = [], 0
        for (lo, hi), job in sorted(digest.early.items()):
            if lo < at:
                continue  # (a range another attempt cut differently: not used)
            if lo > at:
                jobs.append(self.digest_pool.start(parts[at:lo]))
            jobs.append(job)
            at = hi
        if at < len(parts):
            jobs.append(self.digest_pool.start(parts[at:]))
        return DigestJob.joined(jobs)


#: Each action's doer (:meth:`PrefillDriver._do`): the class's functions, so what they
#: read (``on_offer``, set after construction) is read when they run.
_DOERS: dict[type, Callable[[PrefillDriver, Any, bool], None]] = {
    TellDecode: PrefillDriver._tell_decode, DropLink: PrefillDriver._drop_link,
    Connect: PrefillDriver._do_connect, AskGrant: PrefillDriver._ask_grant,
    PostWrites: PrefillDriver._post, Count: PrefillDriver._count,
    RunStep: PrefillDriver._run_step}
