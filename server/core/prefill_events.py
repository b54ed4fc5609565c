"""Prefill's core, its events: completions, failures, deadlines, peer loss, resends.

:class:`PrefillEvents`, the base of :class:`~kvbeam.server.core.prefill.PrefillCore`,
decides what happens to a request after its writes are posted: their completions,
failures, deadlines, a lost link or peer, the resend after a transient link failure
(its policy: :class:`~kvbeam.server.core.resend.ResendPolicy`), the sweep. Each
handler takes an event and returns actions (:mod:`kvbeam.server.core.prefill_actions`:
tell decode, run a step, drop a link, count) and does no I/O: no executor, no peer
call, no clock (the sweep's time is its argument). The driver,
:class:`~kvbeam.server.core.prefill_driver.PrefillDriver`, does the actions.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbeam.errors import (
    BadRequest,
    HandshakeRejectedError,
    PeerError,
    PlanError,
    PoolCompatibilityError,
    ProtocolError,
    ProtocolVersionError,
    RoleConflictError,
    SendFailed,
    TransportError,
)
from kvbeam.logs import fields, request_log
from kvbeam.pools.layout import SideLayout
from kvbeam.server.core.actions import Count, DropLink, link_failure
from kvbeam.server.core.base import request_bytes
from kvbeam.server.core.prefill_actions import Actions, RunStep, TellDecode
from kvbeam.server.core.resend import ResendPolicy, transient
from kvbeam.server.state.lifecycle import TransferTable
from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.states import FailureReason, TransferState, TransferStatus
from kvbeam.transport import Event, EventKind

if TYPE_CHECKING:
    from kvbeam.server.core.offers import OfferBook
    from kvbeam.server.core.outgoing import Outgoing
    from kvbeam.server.core.prefill_record import RecordStager

log = logging.getLogger(__name__)


def reason_for(exc: BaseException) -> FailureReason:
    """The lifecycle failure reason for an exception of a send step."""
    if isinstance(exc, SendFailed):
        return exc.reason
    if isinstance(exc, PoolCompatibilityError | ProtocolVersionError | RoleConflictError
                  | HandshakeRejectedError):
        return FailureReason.INCOMPATIBLE
    if isinstance(exc, PeerError):
        return FailureReason.PEER_UNREACHABLE
    if isinstance(exc, PlanError | ProtocolError | BadRequest):
        return FailureReason.INVALID_REQUEST
    return FailureReason.TRANSPORT_ERROR


def after_resends(detail: str, resends: int, first: str) -> str:
    """A failure's detail, saying how many resends were tried and what broke the first link.

    ``first`` is empty when no link failure ever marked the request for a resend.
    """
    if not first:
        return detail
    text = f"{detail} after {resends} resend{'s' if resends != 1 else ''}"
    return text if first in detail else f"{text}; the link failed first with {first}"


class PrefillEvents:
    """Event handlers of the prefill core: events in, actions out (state is defined by
    the subclass)."""

    table: TransferTable
    peers: Peers
    drain_s: float
    _drain_waiters: dict[str, list[threading.Event]]
    _out: dict[str, Outgoing]
    _writes: dict[tuple[int, int], str]
    _ended_unfinished: set[str]
    offers: OfferBook
    records: RecordStager
    resend: ResendPolicy
    layout: SideLayout

    _verification: Callable[[str | None], str]  # the core's: how its bytes are verified

    @staticmethod
    def _late_verdict(request_id: str, detail: str, decode_address: str) -> None:
        # Our Success means every write completed here; decode's verdict (e.g. an
        # integrity failure found after landing) is the one the scheduler acts on.
        log.error("request %s: decode reports a failure after this side ended: %s",
                  request_id, detail, extra=fields(request_id, decode_address))

    def _wake_drained(self, rec: Outgoing) -> None:
        """Set the events of the Abort handlers waiting for ``rec``'s writes, if drained."""
        if rec.drained:
            for event in self._drain_waiters.pop(rec.request_id, ()):
                event.set()

    def _ended(self, rec: Outgoing) -> bool:
        return not self.table.is_live(rec.request_id)

    def handle_event(self, event: Event, now: float) -> Actions:
        """COMPLETED: one write finished; LINK_FAILED: the decode peer's link is gone."""
        if event.kind is EventKind.LINK_FAILED:
            dropped = link_failure(self.peers, event)
            return [dropped] if dropped is not None else []
        if event.kind is not EventKind.COMPLETED or event.transfer_id is None:
            return []
        lost: PeerConn | None = None
        # The chunks of a request on one link share its transfer id (decode's), so
        # the key stays until the record is pruned.
        rid = self._writes.get((event.link, event.transfer_id))
        rec = self._out.get(rid) if rid else None
        if rec is not None and event.link != rec.attempt.link:
            # A resend starts only once every write on the old link completed: a
            # completion from a link this attempt does not use is stray.
            rec = None
        if rec is None:
            log.warning("completion of unknown transfer %s on link %d ignored",
                        event.transfer_id, event.link, extra=fields(rid))
            return []
        if not event.ok:
            # A failed write leaves the link unusable (an RC QP in error, a TCP stream
            # broken): forget it now so a request connecting meanwhile handshakes a
            # new link instead of picking this dead one.
            conn = self.peers.by_link(event.link)
            if conn is not None and self.peers.remove(conn):
                lost = conn
        # The final write acknowledged on this attempt's link means every byte
        # landed: a Success even if a resend was owed.
        landed = rec.completed(event.ok, event.link)
        self.records.give(rec)  # once no write of it reads the staging slot
        self._wake_drained(rec)
        snap = self.table.get(rec.request_id)
        success = (landed and snap is not None
                   and snap.state is TransferState.TRANSFERRING)
        if success:
            self.table.advance(rec.request_id, TransferState.SUCCESS,
                               nbytes=rec.attempt.bytes_done, now=now)
        spared = not event.ok and self._note_link_failure(
            rec, event.link, event.status, f"{event.status}: {event.detail}")
        actions: Actions = []
        if success:
            request_log.info("request %s: Success (%d bytes written)", rec.request_id,
                             rec.attempt.bytes_done,
                             extra=fields(rec.request_id, rec.decode_address))
        elif spared:
            actions = self._maybe_resend(rec, now)
        elif not event.ok:
            actions = self._fail(rec, FailureReason.TRANSPORT_ERROR,
                                 f"write failed: {event.status}: {event.detail}", now)
        elif snap is not None and snap.state is TransferState.FAILED:
            actions = self._tell_decode_once(rec, f"prefill failed: {snap.detail}")
        if lost is not None:
            actions.append(DropLink(lost, f"write failed: {event.status}", gone=False))
        return actions

    def handle_deadline(self, status: TransferStatus) -> Actions:
        """A deadline passed (the table failed it): tell decode once its writes drained."""
        rec = self._out.get(status.request_id)
        if rec is None:
            return []
        return self._tell_decode_once(rec, f"prefill timed out: {status.detail}")

    def link_dropped(self, conn: PeerConn, detail: str, *, gone: bool, now: float) -> Actions:
        """``conn`` was removed and its link released (its writes complete as failed):
        fail or resend its requests.

        ``gone`` False means only the link died (a QP error, a partitioned data path):
        decode is still there and keeps the requests, so each is resent on a new link
        while its retries and deadline allow (:mod:`kvbeam.server.core.resend`); one that
        fails is told to decode by Abort once its writes are drained, instead of decode
        waiting for its own deadline. ``gone`` True (heartbeats lost, the peer
        restarted): every request on the connection fails at once.
        """
        self.offers.drop_conn(conn)  # decode granted them on this link
        mine = [r for r in self._out.values() if r.conn is conn]
        if gone:
            for rec in mine:
                rec.told_decode = True  # the peer is gone; there is no one to tell
        spared = [] if gone else [r for r in mine
                                  if self._note_link_failure(r, conn.link.id, None,
                                                             detail)]
        actions: Actions = []
        for rec in mine:
            if rec in spared:
                actions += self._maybe_resend(rec, now)
            else:
                actions += self._fail(rec, FailureReason.PEER_FAILED, detail, now)
        return actions

    def _fail(self, rec: Outgoing, reason: FailureReason, detail: str, now: float) -> Actions:
        """Fail a request at ``now``; decode is told once none of its writes is in flight."""
        detail = after_resends(detail, rec.resends, rec.first_failure)
        if self.table.fail(rec.request_id, reason, detail, now=now):
            log.warning("request %s failed: %s: %s", rec.request_id, reason.value, detail,
                        extra=fields(rec.request_id, rec.decode_address))
        return self._tell_decode_once(rec, f"prefill failed: {reason.value}: {detail}")

    def _step_failed(self, rec: Outgoing, exc: BaseException, now: float) -> Actions:
        reason = reason_for(exc)
        if rec.resends and reason is FailureReason.PEER_UNREACHABLE:
            # Decode served this request until its link failed; now it does not answer
            # the resend's handshake: the peer failed (as a lost peer is reported).
            reason = FailureReason.PEER_FAILED
        detail = str(exc)
        if rec.rehandshake and reason in (FailureReason.INVALID_REQUEST,
                                          FailureReason.PEER_UNREACHABLE):
            # Decode had forgotten us (restarted, say) and the new handshake did not help
            # (its reservation is gone too): the peer failed, as before the second try.
            reason = FailureReason.PEER_FAILED
            detail = f"{rec.rehandshake}; after handshaking again: {exc}"
        if reason is FailureReason.TRANSPORT_ERROR and not isinstance(
                exc, TransportError | SendFailed):
            log.error("request %s: unexpected error", rec.request_id, exc_info=exc,
                      extra=fields(rec.request_id, rec.decode_address))
        return self._fail(rec, reason, detail, now)

    def _tell_decode_once(self, rec: Outgoing, detail: str) -> Actions:
        """Tell decode of a failed request exactly once, when its writes have drained.

        Check and set in one call on the loop: two failure paths (a failed completion
        and a lost peer, say) send one Abort, not two.
        """
        snap = self.table.get(rec.request_id)
        if (rec.told_decode or not rec.drained or snap is None
                or snap.state is not TransferState.FAILED):
            return []
        rec.told_decode = True
        # The connection even once closed (its link failed first, say): it says that
        # decode granted the request, so the driver handshakes again to tell it.
        conn = rec.conn
        if not rec.decode_address:
            return []  # a Send that named no decode and no decode offered: nobody to tell
        return [TellDecode(conn, rec.decode_address, rec.request_id, detail)]

    def sweep(self, now: float) -> Actions:
        """Abandon failed requests whose writes hang (their link goes, so none can read
        the source any longer); forget requests that ended."""
        self.offers.expire(now)
        hung: list[tuple[Outgoing, PeerConn | None, int]] = []
        self._ended_unfinished = {r for r in self._ended_unfinished
                                  if self.table.get(r) is not None}
        for rid, rec in list(self._out.items()):
            snap = self.table.get(rid)
            ended = snap is None or snap.state.terminal
            if not ended:
                continue
            if not rec.drained:
                if snap is not None and snap.state is TransferState.FAILED:
                    outstanding = rec.attempt.outstanding
                    if rec.hung(now, self.drain_s):  # drained from now on: its link goes
                        hung.append((rec, rec.conn, outstanding))
                continue
            if rec.told_decode or snap is None or snap.state is TransferState.SUCCESS:
                del self._out[rid]
                self.table.keep_facts(rid, rec.facts(self._verification(rid)))
                self.records.give(rec, force=True)
                if snap is not None and not rec.final_submitted:
                    self._ended_unfinished.add(rid)  # a late chunk gets its status
                for key in rec.write_keys:
                    self._writes.pop(key, None)
        for rec, _conn, _n in hung:
            self._wake_drained(rec)  # an Abort waiting on it answers now
        actions: Actions = []
        for rec, conn, outstanding in hung:
            log.warning("request %s: %d write(s) still in flight after %.1f s: releasing the "
                        "link so none can read the source any longer", rec.request_id,
                        outstanding, self.drain_s,
                        extra=fields(rec.request_id, rec.decode_address))
            if conn is not None:
                # Only the link goes: its other requests are resent on a new one (or fail
                # and are told to decode), not failed with this one.
                actions.append(DropLink(conn, f"writes of {rec.request_id} did not drain",
                                        gone=False))
        return actions

    def fail_live(self, detail: str, now: float) -> list[tuple[PeerConn | None, str, str]]:
        """Fail every live request (reason shutdown); the (connection or None, decode
        address, request id) of each that decode was not told of, to tell at once."""
        calls: list[tuple[PeerConn | None, str, str]] = []
        for snap in self.table.live():
            if self.table.fail(snap.request_id, FailureReason.SHUTDOWN, detail, now=now):
                rec = self._out.get(snap.request_id)
                tell = rec is not None and not rec.told_decode
                if rec is not None:
                    rec.told_decode = True
                if rec is not None and tell and rec.decode_address:
                    conn = rec.conn if rec.conn is not None and not rec.conn.closed else None
                    calls.append((conn, rec.decode_address, rec.request_id))
        return calls

    # ---- the resend (server/core/resend.py: its policy) ---------------------------------
    def _note_link_failure(self, rec: Outgoing, link_id: int, status: str | None,
                           cause: str) -> bool:
        """A link ``rec`` may use failed; True when that does not fail the request.

        True: a resend is (or already was) owed, or the link is not the one this attempt
        posts on (an older one, or the request has posted nothing on it: its next step
        picks a new link). False: the request must fail now (it ended, the status is
        not transient, or no resend is left).
        ``cause``: what broke the link (a verbs or TCP status and detail), for the logs.
        """
        if self._ended(rec) or not transient(status):
            return False
        return rec.link_failed(link_id, cause, self.resend.retries)

    def _maybe_resend(self, rec: Outgoing, now: float) -> Actions:
        """Start an owed resend once no step runs and none of its writes is outstanding."""
        if not rec.resend_due():
            return []
        if self._ended(rec):
            rec.give_up_resend()
            return []
        cause = rec.attempt.broken_by
        left, need = self.table.left(rec.request_id, now=now), self.resend.cost()
        late = left is not None and left < need
        if late:
            rec.give_up_resend()
            if not rec.resends:
                rec.first_failure = ""  # no resend was tried: the detail is the error's
        else:
            rec.replay()  # RUNNING: its step is submitted below
        n = rec.resends
        if late:
            return self._fail(rec, FailureReason.TRANSPORT_ERROR,
                              f"{cause}; no time left to resend ({left:.2f} s to the "
                              f"deadline, a new link takes about {need:.2f} s)", now)
        log.warning("request %s: resend %d/%d on a new link after a transport error: %s",
                    rec.request_id, n, self.resend.retries, cause,
                    extra=fields(rec.request_id, rec.decode_address))
        return [Count("resends"), RunStep(rec.ref)]

    def _landed_already(self, rec: Outgoing, now: float) -> None:
        """Decode says the request had landed before our resend: it is a Success here too.

        The failed write was acknowledged to decode but not to us (an RC retry that
        lost only its acknowledgements): decode received the final notification and
        verified the bytes, so nothing is resent.
        """
        rec.chunks.clear()
        snap = self.table.get(rec.request_id)
        if snap is None or snap.state is not TransferState.TRANSFERRING:
            return
        # The request's bytes, not this attempt's (it wrote none): what landed.
        nbytes = request_bytes(self.layout, rec.src_indices, rec.src_draft)
        self.table.advance(rec.request_id, TransferState.SUCCESS, nbytes=nbytes, now=now)
        request_log.info("request %s: Success (decode had it landed before the resend)",
                         rec.request_id, extra=fields(rec.request_id, rec.decode_address))
