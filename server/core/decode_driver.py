"""Decode's driver: the one place its core's decisions become I/O.

:class:`DecodeDriver` is what the daemon calls (the servicer, the engine channel, the
runtime's loops): every call hands an event to
:class:`~kvbeam.server.core.decode.DecodeCore`, which returns actions
(:mod:`kvbeam.server.core.decode_actions`), and the driver does them: it sends the
Offer, starts a sub-batch's digests, checks a landing
(:class:`~kvbeam.server.core.decode_landing.LandingCheck`), aborts a request on its
prefill, releases a link, pushes a freed request to the engine, counts. What an
action brings back (prefill's answer, a digest job, a verdict, a released link) goes
to the core as its next event, and the actions of that are done in turn.

Threads: nothing here starts one. The core is called on the daemon's loop only: a
call from another thread (a gRPC handler, an executor job) is handed to the loop and
waited for (``DriverBase.on_loop``, :meth:`DecodeDriver._event`). Actions that cannot
block run on the loop; a peer call, a link's release and a large landing's check run
on the daemon's bounded executor (``io``), and what they bring back goes to the core
on the loop again. No lock is held while any action runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

from kvbeam.errors import DialRefused
from kvbeam.logs import fields
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest_pool import DigestPool
from kvbeam.pools.engine_indices import ListLike
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.mailbox import RecordArea
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.actions import Count, DropLink
from kvbeam.server.core.base import DriverBase, named
from kvbeam.server.core.decode import DecodeCore
from kvbeam.server.core.decode_actions import (
    Actions,
    CheckLanding,
    DecodeAction,
    DialPrefill,
    DigestMark,
    DrainPrefill,
    Freed,
    SendOffer,
    TellPrefill,
)
from kvbeam.server.core.decode_landing import LandingCheck
from kvbeam.server.core.incoming import Incoming
from kvbeam.server.core.ports import Offered, PrefillPeers, abort_at_shutdown
from kvbeam.server.state.lifecycle import TransferTable
from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.server.state.slots import SlotPool
from kvbeam.states import FailureReason, TransferStatus
from kvbeam.transport import Event

log = logging.getLogger(__name__)


class DecodeDriver(DriverBase[DecodeCore]):
    """Decode's API for the daemon: each call is an event for the core, whose actions
    it does. See the module docstring."""

    role = "decode"

    def __init__(self, *, table: TransferTable, peers: Peers, prefill: PrefillPeers,
                 io: Executor, integrity: bool, handoff_lease_s: float,
                 transfer_budget: Callable[[int], float] = lambda _n: 0.0,
                 on_offer: Callable[[str], None] = lambda _event: None,
                 wire_s: Callable[[int], float] = lambda _n: 0.0,
                 digest_pool: DigestPool | None = None, sub_batch_bytes: int = 0,
                 clock: Callable[[], float]) -> None:
        """``prefill``: the calls to prefill daemons (:class:`PrefillPeers`); ``io``: the
        daemon's bounded executor; ``digest_pool``: the landed bytes' digests (owned by
        the daemon; None: on the calling thread). The rest is the core's
        (:class:`DecodeCore`)."""
        digest_pool = digest_pool or DigestPool(0)
        self.core = DecodeCore(table=table, peers=peers, integrity=integrity,
                               handoff_lease_s=handoff_lease_s,
                               transfer_budget=transfer_budget, wire_s=wire_s,
                               sub_batch_bytes=sub_batch_bytes,
                               check_inline_below=digest_pool.inline_below)
        self.prefill = prefill
        self.io = io
        self.clock = clock
        self.checker = LandingCheck(self._memory, integrity, digest_pool, clock)
        #: Metrics: one call per offer answered (made, refused, failed), per decline.
        self.on_offer = on_offer
        self.on_decline: Callable[[], None] = lambda: None
        #: Metrics: one call per answer to decode's ask to connect (ok, refused, ...).
        self.on_connect: Callable[[str], None] = lambda _result: None
        #: Called on the loop with a request id once its pages and slot are free: a
        #: failed request's may be reused from then, which is when the engine channel
        #: pushes its Failed (the runtime sets it; the table's Failed comes earlier, while
        #: prefill may still be writing them).
        self.on_freed: Callable[[str], None] = lambda _rid: None

    # ---- what the daemon reads ----------------------------------------------------------
    @property
    def slots(self) -> SlotPool:
        """The request slots (an engine's attach replaces them)."""
        return self.core.slots

    @property
    def mailbox(self) -> RecordArea | None:
        """The digest mailbox."""
        return self.core.mailbox

    @property
    def sub_batch_bytes(self) -> int:
        """The sub-batch size decode advertises (0: none)."""
        return self.core.sub_batch_bytes

    @property
    def digest_pool(self) -> DigestPool:
        """The landed bytes' digests' threads."""
        return self.checker.digest_pool

    @digest_pool.setter
    def digest_pool(self, pool: DigestPool) -> None:
        self.checker.digest_pool = pool

    def _memory(self) -> tuple[AllocatedSide, SideLayout, RecordArea | None]:
        return self.core.pools, self.core.layout, self.core.mailbox

    def slot_of(self, request_id: str) -> int:
        """The slot a request holds, -1 once freed."""
        return self.on_loop(lambda: self.core.slot_of(request_id))

    # ---- the API: engines, schedulers, prefill's BeginWrite -----------------------------
    def reserve(self, request_id: str, seq_len: int, prefill_address: str, *,
                indices: Mapping[IndexKind, ListLike] | None = None,
                draft: Mapping[IndexKind, ListLike] | None = None,
                kv_skip: int = 0) -> Incoming:
        """Hold a slot for a request (:meth:`DecodeCore.reserve`)."""
        return self.on_loop(lambda: self.core.reserve(
            request_id, seq_len, prefill_address, indices=indices, draft=draft,
            kv_skip=kv_skip, now=self.clock()))

    def offer(self, res: Incoming) -> bool:
        """Offer a fresh reservation to its prefill when that is a connected peer;
        whether it was sent. Never blocks."""
        def offer() -> bool:
            actions = self.core.offer(res, self.clock())
            self.execute(actions)
            return any(isinstance(a, SendOffer) for a in actions)

        return self.on_loop(offer)

    def begin_write(self, request_id: str, instance_id: str, seq_len: int,
                    digests_follow: bool) -> Incoming:
        """Prefill is about to write (a chunk of) a request (:meth:`DecodeCore.begin_write`)."""
        return self.on_loop(lambda: self.core.begin_write(request_id, instance_id, seq_len,
                                                          digests_follow, now=self.clock()))

    def release(self, request_id: str) -> TransferStatus:
        """The engine took over a request that reached Success: free its slot."""
        def release() -> TransferStatus:
            snap, actions = self.core.release(request_id)
            self.execute(actions)
            return snap

        return self.on_loop(release)

    def abort(self, request_id: str, *, from_peer: bool, detail: str, instance_id: str = "",
              caller_refusal: Callable[[str], str | None] = lambda _address: None
              ) -> TransferStatus:
        """Abort a request (:meth:`DecodeCore.abort`): prefill drains on the executor.
        ``caller_refusal`` says why the caller may not speak for a prefill at an address
        (None: it may; the default checks nothing, as a server without authentication);
        it runs on the calling thread, not the loop (it may resolve a host name)."""
        checked: tuple[str, str | None] = ("", None)
        if from_peer and instance_id:
            address = self.on_loop(lambda: self.core.prefill_of(request_id))
            checked = (address, caller_refusal(address) if address else None)

        def abort() -> TransferStatus:
            snap, actions = self.core.abort(request_id, from_peer=from_peer, detail=detail,
                                            instance_id=instance_id, checked=checked,
                                            now=self.clock())
            self.execute(actions)
            return snap

        return self.on_loop(abort)

    def decline(self, request_id: str, prefill_address: str, detail: str) -> bool:
        """Tell prefill the engine will not load a request it reserved nothing for
        (:meth:`DecodeCore.decline`). Blocking (the Abort, or the ask to connect first,
        on this thread): call it on the executor. True when prefill confirmed."""
        actions = self.on_loop(lambda: self.core.decline(request_id, prefill_address, detail,
                                                         self.clock()))
        told = False
        rest: Actions = []
        for action in actions:
            if isinstance(action, TellPrefill):
                told = self._tell(action)
            else:
                rest.append(action)
        self._event(lambda: rest)
        log.info("request %s: declined (%s); prefill %s told%s", request_id, detail,
                 prefill_address, "" if told else " (no confirmation yet)",
                 extra=fields(request_id, prefill_address))
        return told

    # ---- events -------------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        """A transport event: a landing (or a sub-batch of one), a failed link."""
        self._event(lambda: self.core.on_event(event, self.clock()))

    def on_deadline(self, status: TransferStatus) -> None:
        """A deadline passed (the request is Failed in the table already)."""
        self._event(lambda: self.core.on_deadline(status))

    def periodic(self) -> None:
        """The sweep: hand-off leases, aborts prefill has not confirmed."""
        self._event(lambda: self.core.periodic(self.clock()))

    def on_peer_lost(self, conn: PeerConn, detail: str, *, gone: bool = True) -> None:
        """Close the link first (no more writes can land), then tell the core
        (:meth:`DecodeCore.link_dropped`). Blocking (the link's release): never under a
        lock. When only the link failed, the peer channel stays open (see
        :meth:`PeerConn.close`): the reservations kept for prefill's resend still fail
        at once if it turns out prefill died."""
        self.peers.remove(conn, forget=gone)
        conn.close(keep_channel=not gone)
        self._event(lambda: self.core.link_dropped(conn, detail, gone=gone, now=self.clock()))

    def shutdown(self, detail: str = "decode shutting down") -> None:
        """Fail every live request (reason shutdown), tell prefill, release links, free.

        Prefill is told of every request at once, within ``SHUTDOWN_ABORT_S`` in all
        (a grace period must hold hundreds of live requests and a prefill that does not
        answer); the slots are freed after the links are released, so no confirmation
        is needed.
        """
        abort_at_shutdown(self.on_loop(lambda: self.core.fail_live(detail, self.clock())), detail,
                          "prefill", self.prefill.abort_all, self.clock)
        self.peers.close_all()
        self._event(lambda: self.core.free_all("shutdown"))

    # ---- an engine's memory (use_pools, drop_pools: DriverBase) -----------------------
    def use_mailbox(self, mailbox: RecordArea) -> None:
        """The daemon's digest mailbox (registered, advertised) from now on."""
        self.on_loop(lambda: self.core.use_mailbox(mailbox))

    # ---- the actions ---------------------------------------------------------------------
    def _event(self, event: Callable[[], Actions]) -> None:
        """Give the core an event and do its actions, on the daemon's loop: here when
        this is the loop (or no loop serves: a unit test's driver), else handed to the
        loop and waited for (what blocks goes on to the executor from there)."""
        if self._off_loop:
            self.on_loop(named(lambda: self.execute(event()), event))
        else:
            self.execute(event())

    def execute(self, actions: Actions) -> None:
        """Do the core's actions, in order: on this thread those that cannot block, on
        the executor the others."""
        for action in actions:
            if self._blocks(action):
                self.io.submit(self._do, action)
            else:
                self._do(action)

    def _blocks(self, action: DecodeAction) -> bool:
        """The action may block: a peer call, a link's release, a landing's check whose
        digests do not run inline."""
        # The action types are final: their identity, not isinstance (a Python call each).
        if type(action) is CheckLanding:
            return not self.checker.inline(action.landing)
        return type(action) in _BLOCKING

    def _do(self, action: DecodeAction) -> None:
        """Do one action on this thread (``execute`` chose the thread)."""
        # One lookup by the action's type, not a chain of isinstance tests (up to ten).
        _DOERS[type(action)](self, action)

    def _send_offer(self, action: SendOffer) -> None:
        ref = action.ref
        sent = self.prefill.offer(action.conn, ref.request_id, action.seq_len, action.grant,
                                  action.lease_s)
        self._event(lambda: self.core.offer_sent(ref, sent, self.clock()))

    def _digest_mark(self, action: DigestMark) -> None:
        job, parts = self.checker.digest_mark(action.landing, action.mark)
        self._event(lambda: self.core.mark_digesting(action.ref, action.transfer_id,
                                                     action.mark, job, parts))

    def _drop_link(self, action: DropLink) -> None:
        self.on_peer_lost(action.conn, action.detail, gone=action.gone)

    def _dial_action(self, action: DialPrefill) -> None:
        self._dial(action.address, action.request_ids)

    def _freed(self, action: Freed) -> None:
        self.on_freed(action.request_id)

    def _count(self, action: Count) -> None:
        if action.metric == "offers":
            self.on_offer(action.label)
        elif action.metric == "connects":
            self.on_connect(action.label)
        else:
            self.on_decline()

    def _dial(self, address: str, request_ids: tuple[str, ...]) -> None:
        """Ask the prefill at ``address`` to connect; the core offers or fails the
        reservations that waited for it. Blocking (the executor)."""
        instance_id, error = "", None
        try:
            instance_id = self.prefill.connect_back(address, request_ids)
        except DialRefused as exc:
            error = exc
        except Exception as exc:  # a bug in the call, not the peer's answer: said as such
            log.exception("asking prefill %s to connect failed unexpectedly", address)
            error = DialRefused(FailureReason.PEER_UNREACHABLE,
                                f"asking prefill daemon at {address} to connect: {exc}")
        self._event(lambda: self.core.dialed(address, instance_id, error, self.clock()))

    def offer_answer(self, request_id: str, transfer_id: int, instance_id: str,
                     answer: Offered) -> None:
        """Prefill ``instance_id``'s answer to an Offer (the daemon's loop):
        :meth:`DecodeCore.answer_arrived`."""
        self._event(lambda: self.core.answer_arrived(request_id, transfer_id, instance_id,
                                                     answer))

    def _check(self, action: CheckLanding) -> None:
        verdict = self.checker.check(action.landing, action.transfer_id)
        self._event(lambda: self.core.checked(action.ref, action.transfer_id, verdict,
                                              self.clock()))

    def _tell(self, action: TellPrefill) -> bool:
        """Abort the request on prefill; True when prefill confirmed none of its writes
        is in flight."""
        return self.prefill.abort(action.conn, action.request_id, action.detail)

    def _drain(self, action: DrainPrefill) -> None:
        confirmed = action.conn is not None and self.prefill.abort(
            action.conn, action.ref.request_id, action.detail)
        self._event(lambda: self.core.drain_answered(action.ref, action.detail, confirmed,
                                                     self.clock()))


#: The actions :meth:`DecodeDriver.execute` hands to the executor (a landing's check:
#: when its digests do not run inline).
_BLOCKING = frozenset({TellPrefill, DrainPrefill, DialPrefill, DropLink})
#: Each action's doer (:meth:`DecodeDriver._do`): the class's functions, so what they
#: read (``on_freed``, ``on_decline``, ``on_connect``: set after construction) is read
#: when they run.
_DOERS: dict[type, Callable[[DecodeDriver, Any], object]] = {
    SendOffer: DecodeDriver._send_offer, DigestMark: DecodeDriver._digest_mark,
    CheckLanding: DecodeDriver._check, TellPrefill: DecodeDriver._tell,
    DrainPrefill: DecodeDriver._drain, DropLink: DecodeDriver._drop_link,
    DialPrefill: DecodeDriver._dial_action, Freed: DecodeDriver._freed,
    Count: DecodeDriver._count}
