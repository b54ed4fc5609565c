"""Prefill's resend: a transient transport error re-sends the request on a fresh link.

A write that fails with a transport error (an RC QP's retries exhausted, a flushed
WR, our own write timeout, a broken TCP stream) leaves the request intact: its
source bytes are only ever read, and decode keeps its reservation when only the
link failed (:meth:`~kvbeam.server.core.decode.DecodeCore.on_peer_lost` with
``gone=False``). So instead of failing it, prefill marks the request for a resend
(:meth:`~kvbeam.server.core.prefill_events.PrefillEvents._note_link_failure`), waits
until none of its writes on the dead link is outstanding (each write completes
exactly once, as failed or cancelled, when the link fails or is released), then
replays every chunk it had posted
(:meth:`~kvbeam.server.core.prefill_events.PrefillEvents._maybe_resend`): the next
step handshakes a new link
(one handshake per address, as for a first send) and asks decode for a new grant
with BeginWrite, which gives a new transfer id on the new link, so a late
notification from the old one can never mark the request landed.

At most ``resend_retries`` resends per request (``--resend-retries``, 0: off); the
request's deadline still bounds every attempt (the table fails it when it passes,
and a pending resend then never starts). A resend needs a handshake and a BeginWrite
before its grant restarts the deadline; when less time is left than that takes
(:meth:`ResendPolicy.cost`: twice the recent handshake plus BeginWrite, at
least its ``floor_s``), the request fails at once with the transport's error and
"no time left to resend", instead of a resend the deadline would cut without naming
what broke. Errors that are not transient fail at
once: a write outside the peer's memory (its status says so), our own region
check, a decode refusal, a lost or restarted peer (``gone=True``).

This module holds the policy (:class:`ResendPolicy`, no state of any request: each
request's owed resend is its record's, :mod:`kvbeam.server.core.outgoing`); the core's
event handlers drive it (:mod:`kvbeam.server.core.prefill_events`).
"""

from __future__ import annotations

from kvbeam.transport import status as st

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


class ResendPolicy:
    """When a request whose link failed is resent: how many times, and whether its
    deadline leaves the time a new link takes (pure; the core calls it on the loop).

    Args:
        retries: resends allowed per request (0: a transport error fails it at once).
        floor_s: the least time before its deadline a resend starts with.
    """

    def __init__(self, retries: int, floor_s: float = RESEND_FLOOR_S) -> None:
        self.retries = retries
        self.floor_s = floor_s
        #: Recent handshake and BeginWrite times (a decaying maximum, seconds).
        self.handshake_s = 0.0
        self.begin_write_s = 0.0

    def measured(self, *, handshake: float | None = None,
                 begin_write: float | None = None) -> None:
        """Record how long a handshake or a BeginWrite took (what a resend will need)."""
        if handshake is not None:
            self.handshake_s = max(handshake, _DECAY * self.handshake_s)
        if begin_write is not None:
            self.begin_write_s = max(begin_write, _DECAY * self.begin_write_s)

    def cost(self) -> float:
        """The time a resend needs before its grant restarts the deadline."""
        return max(self.floor_s, RESEND_MARGIN * (self.handshake_s + self.begin_write_s))
