"""Decode pushes a reservation to its prefill peer ahead of Send (protocol 2).

When Reserve names a prefill that is a verified peer with a live connection,
:meth:`DecodeOffer.offer` sends Offer on the pair's peer channel with exactly what
BeginWrite would answer (the transfer id, the destination lists), outside every
lock, and does not wait: prefill's answer is an event, handled where it arrives
(:meth:`DecodeOffer.offer_answered`, on the peer channel's thread; bounded by
``OFFER_TIMEOUT_S``, 1 s or less if the RPC timeout is, after which the channel
answers "unknown"). No offer is made while the peer misses heartbeats: Reserve stays
fast when prefill is slow or cut off, and no thread waits on prefill's answer.
Prefill's Send then writes at once, with no control round trip; without an offer
(the first request before any handshake, a Send before the Reserve, a resend on a
new link) prefill asks with BeginWrite as before (docs/protocol.md, "The offer path
and its fallback").

The reservation counts as granted BEFORE the offer is sent (``peer_instance`` and
the link set): prefill may post its writes, and its notification arrive, before
Offer's answer is back here. From then on an abort asks prefill to drain first, as
after a BeginWrite. Only an explicit refusal (prefill will not use it) takes the
grant back; a call that got no answer may have been kept, so the grant stays.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from kvbeam.logs import fields
from kvbeam.server.core.decode_landing import DecodeLanding, Incoming, Landing
from kvbeam.server.core.ports import Offered, PrefillPeers, WriteGrant

log = logging.getLogger(__name__)


class DecodeOffer(DecodeLanding):
    """The Offer side of the decode core (state is defined by the core)."""

    prefill: PrefillPeers
    #: Seconds a request's bytes take at the floor rate (``--transfer-floor-mbps``).
    wire_s: Callable[[int], float]
    #: Called with "made", "refused" or "failed" (the daemon's metrics).
    on_offer: Callable[[str], None]

    def offer(self, res: Incoming) -> bool:
        """Offer a fresh reservation to its prefill when that is a connected peer.

        Returns whether the offer was sent (False: no connection, or BeginWrite came
        first); prefill's answer comes later, to :meth:`offer_answered`. Never blocks:
        any thread, no lock held.
        """
        conn = self.peers.by_address(res.prefill_address)
        lease = self.table.left(res.request_id)
        if conn is None or conn.closed or lease is None or conn.missed_heartbeats:
            return False  # no peer, or one not answering now: BeginWrite decides later
        with self._lock:
            snap = self.table.get(res.request_id)
            if (res.peer_instance or self._res.get(res.request_id) is not res
                    or snap is None or snap.state.terminal):
                return False  # BeginWrite came first, or the request ended or is gone
            res.peer_instance, res.link_id, res.offered = conn.instance_id, conn.link.id, True
        self.prefill.offer(conn, res.request_id, res.seq_len,
                           WriteGrant(res.transfer_id, res.indices, res.draft,
                                      res.kv_skip, res.mailbox_slot),
                           res.slot, lease, functools.partial(self.offer_answered, res))
        return True

    def offer_answered(self, res: Incoming, answer: Offered) -> None:
        """Prefill's answer to the Offer of ``res`` (any thread, no lock held; it takes
        the core lock for bookkeeping only, and queues the check when it landed)."""
        with self._lock:
            still = res.offered  # no BeginWrite since (it decides instead)
            if still and answer.kept:
                res.digests_follow = answer is Offered.DIGESTS_FOLLOW
            if still and answer is Offered.REFUSED and res.landing is Landing.AWAITED:
                res.peer_instance, res.link_id, res.offered = "", None, False
            go = still and answer.kept and self._ready(res)
            tid = res.transfer_id
        left = self.table.left(res.request_id)
        if answer.kept and left is not None:
            # The lease still bounds the wait for the Send, but no BeginWrite will move
            # the request to Transferring: a Send at the lease's very end must still have
            # the time its bytes take at the floor rate.
            self.table.extend(res.request_id, left + self.wire_s(res.nbytes))
        self.on_offer({Offered.REFUSED: "refused", Offered.UNKNOWN: "failed"}.get(answer, "made"))
        log.debug("request %s: offered to prefill %s: %s", res.request_id,
                  res.prefill_address, answer.value,
                  extra=fields(res.request_id, res.prefill_address))
        if go:
            self._start_verify(res, tid)
