"""Prefill's book of reservations that decode offered ahead of Send.

When Reserve reaches decode and the named prefill is a verified peer, decode pushes
the reservation to prefill with Offer: exactly what BeginWrite would answer (the
transfer id and the destination lists). :class:`OfferBook` keeps each offer until
the request's Send uses it, so the send path posts its writes with no control round
trip; an offer not used is dropped when the reservation's lease passes, when the
request is aborted, when its peer is lost (its link is the one decode granted) or
when another decode instance answers for the address. The book is bounded: an
offer beyond ``capacity`` is refused and that request asks with BeginWrite
(docs/protocol.md, "The offer path and its fallback").

Like the core that holds it, the book is used on the daemon's loop only (no lock)
and reads no clock: the core passes its ``now``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvbeam.server.core.ports import WriteGrant
from kvbeam.server.state.peers import PeerConn

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Offer:
    """One reservation decode pushed: where the request goes, on which connection."""

    request_id: str
    conn: PeerConn      # the connection the offer came over: its link is decode's grant
    seq_len: int
    grant: WriteGrant
    expires: float      # the core's clock when the reservation's lease passes


class OfferBook:
    """Offers by request id, bounded; see the module docstring.

    Args:
        capacity: the most offers kept at once (refused beyond it).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._offers: dict[str, Offer] = {}

    def __len__(self) -> int:
        return len(self._offers)

    def put(self, offer: Offer, now: float) -> bool:
        """Keep an offer (replacing one for the same request); False when full."""
        if offer.request_id not in self._offers and len(self._offers) >= self.capacity:
            self.expire(now)
            if len(self._offers) >= self.capacity:
                return False
        self._offers[offer.request_id] = offer
        return True

    def take(self, request_id: str, conn: PeerConn, seq_len: int,
             now: float) -> Offer | None:
        """The request's offer if it came over ``conn`` (the same decode instance and
        link), names ``seq_len`` and has not expired; the offer is gone either way."""
        offer = self._offers.pop(request_id, None)
        if offer is None or offer.conn is not conn or conn.closed:
            return None
        if offer.seq_len != seq_len or offer.expires < now:
            return None
        return offer

    def conn_of(self, request_id: str) -> PeerConn | None:
        """The connection the request's kept offer came over (None: no offer): the decode
        a Send with no decode address goes to."""
        offer = self._offers.get(request_id)
        return None if offer is None else offer.conn

    def has(self, request_id: str) -> bool:
        """Whether an offer for the request is kept."""
        return request_id in self._offers

    def drop(self, request_id: str) -> None:
        """Forget a request's offer (it was aborted, or it writes with BeginWrite)."""
        self._offers.pop(request_id, None)

    def drop_conn(self, conn: PeerConn) -> None:
        """Forget every offer that came over ``conn`` (its peer or link is lost)."""
        for rid in [r for r, o in self._offers.items() if o.conn is conn]:
            del self._offers[rid]

    def expire(self, now: float) -> None:
        """Forget offers whose reservation lease passed."""
        for rid in [r for r, o in self._offers.items() if o.expires < now]:
            del self._offers[rid]
