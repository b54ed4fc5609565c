"""Prefill's resend: a transient transport error re-sends the request on a fresh link.

A write that fails with a transport error (an RC QP's retries exhausted, a flushed
WR, our own write timeout, a broken TCP stream) leaves the request intact: its
source bytes are only ever read, and decode keeps its reservation when only the
link failed (:meth:`~kvbeam.server.core.decode.DecodeCore.on_peer_lost` with
``gone=False``). So instead of failing it, prefill marks the request for a resend
(:meth:`PrefillResend._note_link_failure`), waits until none of its writes on the
dead link is outstanding (each write completes exactly once, as failed or
cancelled, when the link fails or is released), then replays every chunk it had
posted (:meth:`PrefillResend._maybe_resend`): the next step handshakes a new link
(one handshake per address, as for a first send) and asks decode for a new grant
with BeginWrite, which gives a new transfer id on the new link, so a late
notification from the old one can never mark the request landed.

At most ``resend_retries`` resends per request (``--resend-retries``, 0: off); the
request's deadline still bounds every attempt (the table fails it when it passes,
and a pending resend then never starts). A resend needs a handshake and a BeginWrite
before its grant restarts the deadline; when less time is left than that takes
(:meth:`PrefillResend._resend_cost`: twice the recent handshake plus BeginWrite, at
least ``resend_floor_s``), the request fails at once with the transport's error and
"no time left to resend", instead of a resend the deadline would cut without naming
what broke. Errors that are not transient fail at
once: a write outside the peer's memory (its status says so), our own region
check, a decode refusal, a lost or restarted peer (``gone=True``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from kvbeam.logs import fields
from kvbeam.pools.layout import SideLayout
from kvbeam.server.core.base import request_bytes
from kvbeam.server.core.prefill_events import PrefillEvents
from kvbeam.server.lifecycle import TransferTable
from kvbeam.server.peers import PeerConn
from kvbeam.states import FailureReason, TransferState
from kvbeam.transport import status as st

if TYPE_CHECKING:
    from kvbeam.server.core.outgoing import Outgoing

log = logging.getLogger(__name__)

#: Write statuses that say the request itself is wrong, not the wire: resending it
#: on a new link would fail the same way. Everything else (retries exhausted, a
#: flushed WR, a timeout, a broken stream, a QP in error) is transient.
NOT_TRANSIENT = frozenset({
    "IBV_WC_REM_ACCESS_ERR", "IBV_WC_LOC_PROT_ERR", "IBV_WC_LOC_ACCESS_ERR",
    "IBV_WC_LOC_LEN_ERR", "IBV_WC_MW_BIND_ERR", st.TCP_REMOTE_ACCESS_ERR,
})


#: The least time before its deadline a resend starts with (seconds).
RESEND_FLOOR_S = 0.25
#: A resend starts only with this many times the measured handshake and BeginWrite left.
RESEND_MARGIN = 2.0
#: Each measurement's weight against the older ones: a slow handshake is remembered a while.
_DECAY = 0.9


def transient(status: str | None) -> bool:
    """True when a write that failed with ``status`` may succeed on a new link."""
    return status not in NOT_TRANSIENT


class PrefillResend(PrefillEvents):
    """The resend bookkeeping of the prefill core (state is defined by the subclass)."""

    table: TransferTable
    layout: SideLayout
    io: Executor
    _lock: threading.Lock
    #: Resends allowed per request (0: a transport error fails the request at once).
    resend_retries: int
    #: Called once per resend (the daemon counts it in ``kvbeam_resends_total``).
    on_resend: Callable[[], None]
    #: The least time before the deadline a resend starts with (see the module docstring).
    resend_floor_s: float = RESEND_FLOOR_S
    #: Recent handshake and BeginWrite times (a decaying maximum, seconds).
    _handshake_s: float = 0.0
    _begin_write_s: float = 0.0

    def _measured(self, *, handshake: float | None = None,
                  begin_write: float | None = None) -> None:
        """Record how long a handshake or a BeginWrite took (what a resend will need)."""
        with self._lock:
            if handshake is not None:
                self._handshake_s = max(handshake, _DECAY * self._handshake_s)
            if begin_write is not None:
                self._begin_write_s = max(begin_write, _DECAY * self._begin_write_s)

    def _resend_cost(self) -> float:
        """The time a resend needs before its grant restarts the deadline (lock held)."""
        return max(self.resend_floor_s,
                   RESEND_MARGIN * (self._handshake_s + self._begin_write_s))

    def _step(self, rec: Outgoing) -> None:
        """Run the request's next chunk (defined by the core)."""
        raise NotImplementedError

    def _note_link_failure(self, rec: Outgoing, link_id: int, status: str | None,
                           cause: str) -> bool:
        """A link ``rec`` may use failed; True when that does not fail the request.

        Called with the core lock held. True: a resend is (or already was) owed, or
        the link is not the one this attempt posts on (an older one, or the request
        has posted nothing on it: its next step picks a new link). False: the request
        must fail now (it ended, the status is not transient, or no resend is left).
        ``cause``: what broke the link (a verbs or TCP status and detail), for the logs.
        """
        if self._ended(rec) or not transient(status):
            return False
        return rec.link_failed(link_id, cause, self.resend_retries)

    def _maybe_resend(self, rec: Outgoing) -> None:
        """Start an owed resend once no step runs and none of its writes is outstanding."""
        with self._lock:
            if not rec.resend_due():
                return
            cause = rec.resend_cause
            if self._ended(rec):
                rec.resend_cause = None
                return
            left, need = self.table.left(rec.request_id), self._resend_cost()
            late = left is not None and left < need
            if late:
                rec.resend_cause = None
                if not rec.resends:
                    rec.first_failure = ""  # no resend was tried: the detail is the error's
            else:
                rec.replay()  # RUNNING: its step is submitted below
            n = rec.resends
        if late:
            self._fail(rec, FailureReason.TRANSPORT_ERROR,
                       f"{cause}; no time left to resend ({left:.2f} s to the "
                       f"deadline, a new link takes about {need:.2f} s)")
            return
        log.warning("request %s: resend %d/%d on a new link after a transport error: %s",
                    rec.request_id, n, self.resend_retries, cause,
                    extra=fields(rec.request_id, rec.decode_address))
        self.on_resend()
        self.io.submit(self._step, rec)

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

    def _landed_already(self, rec: Outgoing) -> None:
        """Decode says the request had landed before our resend: it is a Success here too.

        The failed write was acknowledged to decode but not to us (an RC retry that
        lost only its acknowledgements): decode received the final notification and
        verified the bytes, so nothing is resent.
        """
        with self._lock:
            rec.chunks.clear()
            snap = self.table.get(rec.request_id)
            if snap is None or snap.state is not TransferState.TRANSFERRING:
                return
            # The request's bytes, not this attempt's (it wrote none): what landed.
            nbytes = request_bytes(self.layout, rec.src_indices, rec.src_draft)
            self.table.advance(rec.request_id, TransferState.SUCCESS, nbytes=nbytes)
        log.info("request %s: Success (decode had it landed before the resend)",
                 rec.request_id, extra=fields(rec.request_id, rec.decode_address))
