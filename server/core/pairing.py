"""Decode-initiated pairing: which prefill daemons decode is asking to connect.

A reservation names its prefill daemon. When the pair has no connection (prefill never
sent this decode anything: a Send with no decode address waits for decode's Offer),
decode asks that prefill to handshake with it (the ``Connect`` RPC; prefill dials, as
for a Send, so the handshake, its checks and its credentials are the usual ones) and
offers the reservation once the connection is there. :class:`Dialing` is decode's book
of those asks: one per prefill address at a time, and a pause after an answer that
says nothing about the pair (an older prefill without ``Connect``, a busy one), so that
every reservation does not ask again. docs/protocol.md, "Decode-initiated pairing".

No lock of its own and no clock: the decode core calls it under its lock, with ``now``.
"""

from __future__ import annotations

#: Seconds decode does not ask a prefill again after an answer that said nothing about
#: the pair (``DialRefused.retry``): its reservations wait for a Send's handshake or
#: their deadline, as before decode could ask.
ASK_AGAIN_AFTER_S = 5.0
#: Paused addresses remembered at most (reservations name addresses their engine chose).
MAX_PAUSED = 1024


class Dialing:
    """The prefill addresses decode has asked to connect (one ask each at a time)."""

    def __init__(self) -> None:
        self._asking: set[str] = set()
        self._paused: dict[str, float] = {}

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
