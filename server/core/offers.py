"""Prefill's book of reservations that decode offered ahead of Send (protocol 2).

When Reserve reaches decode and the named prefill is a verified peer, decode pushes
the reservation to prefill with Offer: exactly what BeginWrite would answer (the
transfer id and the destination lists). :class:`OfferBook` keeps each offer until
the request's Send uses it, so the send path posts its writes with no control round
trip; an offer not used is dropped when the reservation's lease passes, when the
request is aborted, when its peer is lost (its link is the one decode granted) or
when another decode instance answers for the address. The book is bounded: an
offer beyond ``capacity`` is refused and that request asks with BeginWrite, as
every request did before protocol 2 (docs/protocol.md, "The offer path and its
fallback").

The book's lock is a leaf: nothing is called while it is held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbeam.errors import NotHandshakenError
from kvbeam.server.core.ports import DecodePeers, WriteGrant
from kvbeam.server.peers import PeerConn, Peers

if TYPE_CHECKING:
    from kvbeam.server.core.outgoing import Outgoing

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Offer:
    """One reservation decode pushed: where the request goes, on which connection."""

    request_id: str
    conn: PeerConn      # the connection the offer came over: its link is decode's grant
    seq_len: int
    grant: WriteGrant
    expires: float      # time.monotonic() when the reservation's lease passes


class OfferBook:
    """Offers by request id, bounded; see the module docstring.

    Args:
        capacity: the most offers kept at once (refused beyond it).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()  # leaf
        self._offers: dict[str, Offer] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._offers)

    def put(self, offer: Offer) -> bool:
        """Keep an offer (replacing one for the same request); False when full."""
        with self._lock:
            if offer.request_id not in self._offers and len(self._offers) >= self.capacity:
                self._expire(time.monotonic())
                if len(self._offers) >= self.capacity:
                    return False
            self._offers[offer.request_id] = offer
            return True

    def take(self, request_id: str, conn: PeerConn, seq_len: int) -> Offer | None:
        """The request's offer if it came over ``conn`` (the same decode instance and
        link), names ``seq_len`` and has not expired; the offer is gone either way."""
        with self._lock:
            offer = self._offers.pop(request_id, None)
        if offer is None or offer.conn is not conn or conn.closed:
            return None
        if offer.seq_len != seq_len or offer.expires < time.monotonic():
            return None
        return offer

    def has(self, request_id: str) -> bool:
        """Whether an offer for the request is kept."""
        with self._lock:
            return request_id in self._offers

    def drop(self, request_id: str) -> None:
        """Forget a request's offer (it was aborted, or it writes with BeginWrite)."""
        with self._lock:
            self._offers.pop(request_id, None)

    def drop_conn(self, conn: PeerConn) -> None:
        """Forget every offer that came over ``conn`` (its peer or link is lost)."""
        with self._lock:
            for rid in [r for r, o in self._offers.items() if o.conn is conn]:
                del self._offers[rid]

    def expire(self) -> None:
        """Forget offers whose reservation lease passed."""
        with self._lock:
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        for rid in [r for r, o in self._offers.items() if o.expires < now]:
            del self._offers[rid]


class PrefillOffers:
    """The offer path of the prefill core: keep offers, use them.

    State is defined by :class:`~kvbeam.server.core.prefill.PrefillCore`.
    """

    peers: Peers
    decode: DecodePeers
    integrity: bool
    offers: OfferBook
    #: Called with "received", "refused", "used" or "missed" (the daemon's metrics).
    on_offer: Callable[[str], None]
    _lock: threading.Lock
    _out: dict[str, Outgoing]

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

    def _unpark(self, request_id: str) -> None:
        """Write a request whose Send waits for this reservation (the core's)."""
        raise NotImplementedError

    def _waits_for_offer(self, rec: Outgoing, conn: PeerConn, final: bool) -> bool:
        """Whether a Send with no offer waits for one before asking (the core's)."""
        raise NotImplementedError

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
