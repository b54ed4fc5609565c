"""Decode-initiated pairing: which prefill daemons decode is asking to connect.

A reservation names its prefill daemon. When the pair has no connection (prefill never
sent this decode anything: a Send with no decode address waits for decode's Offer),
decode asks that prefill to handshake with it (the ``Connect`` RPC; prefill dials, as
for a Send, so the handshake, its checks and its credentials are the usual ones) and
offers the reservation once the connection is there; a request its engine declined is
told over the new connection's peer channel the same way. :class:`Dialing` is decode's
book of those asks: one per prefill address at a time, and a pause after an answer that
says nothing about the pair (a busy prefill), so that every reservation does not ask
again; and the declines that wait for an ask's answer. docs/protocol.md,
"Decode-initiated pairing".

No lock of its own and no clock: the decode core calls it on the daemon's loop, with ``now``.
"""

from __future__ import annotations

#: Seconds decode does not ask a prefill again after an answer that said nothing about
#: the pair (``DialRefused.retry``): its reservations wait for a Send's handshake or
#: their deadline, as before decode could ask.
ASK_AGAIN_AFTER_S = 5.0
#: Paused addresses remembered at most (reservations name addresses their engine chose).
MAX_PAUSED = 1024
#: Declines waiting for a connection, at most (the oldest is dropped first: its prefill
#: then ends that request at its own lease).
MAX_DECLINES = 1024


class Dialing:
    """The prefill addresses decode has asked to connect (one ask each at a time)."""

    def __init__(self) -> None:
        self._asking: set[str] = set()
        self._paused: dict[str, float] = {}
        #: Declined requests to tell each prefill once connected: address -> id -> detail.
        self._declines: dict[str, dict[str, str]] = {}
        self._declined = 0

    def start(self, address: str, now: float) -> bool:
        """Whether to ask ``address`` now: not when an ask is under way or paused."""
        if address in self._asking or self._paused.get(address, 0.0) > now:
            return False
        self._paused.pop(address, None)
        self._asking.add(address)
        return True

    def done(self, address: str, now: float, *, pause: bool) -> None:
        """The ask of ``address`` was answered; ``pause``: do not ask it again for
        :data:`ASK_AGAIN_AFTER_S`."""
        self._asking.discard(address)
        if pause:
            if len(self._paused) >= MAX_PAUSED:
                self._paused = {a: t for a, t in self._paused.items() if t > now}
            if len(self._paused) < MAX_PAUSED:
                self._paused[address] = now + ASK_AGAIN_AFTER_S

    def asking(self, address: str) -> bool:
        """Whether an ask of ``address`` is under way."""
        return address in self._asking

    def hold_decline(self, address: str, request_id: str, detail: str) -> None:
        """Keep a declined request to tell the prefill at ``address`` once connected."""
        if self._declined >= MAX_DECLINES:
            oldest = next(iter(self._declines))
            held = self._declines[oldest]
            del held[next(iter(held))]
            self._declined -= 1
            if not held:
                del self._declines[oldest]
        held = self._declines.setdefault(address, {})
        self._declined += request_id not in held
        held[request_id] = detail

    def declines(self, address: str) -> list[str]:
        """The declined requests waiting for ``address`` (kept)."""
        return list(self._declines.get(address, ()))

    def take_declines(self, address: str) -> dict[str, str]:
        """The declined requests waiting for ``address``, and why (forgotten here)."""
        held = self._declines.pop(address, {})
        self._declined -= len(held)
        return held
