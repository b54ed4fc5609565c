"""What decode's core asks of its driver: one small frozen class per kind of I/O
(:class:`DropLink` and :class:`Count` are both roles', :mod:`kvbeam.server.core.actions`).

:class:`~kvbeam.server.core.decode.DecodeCore` decides and returns these;
:class:`~kvbeam.server.core.decode_driver.DecodeDriver` is the only place that does
them (a peer call, a link's release, a digest, a push to the engine, a metric), and
feeds what comes back (an answer, a digest job, a verdict) to the core as the next
event. The core holds no executor, no peer client and no clock: a test calls it and
compares the list it returns (tests/unit/test_decode_core_actions.py).

Where each runs (the driver's choice, not the core's): :class:`SendOffer`,
:class:`DigestMark`, :class:`Freed` and :class:`Count` never block and run on the
thread that handled the event; :class:`CheckLanding` runs there too when its digests
run inline anyway, else on the executor; :class:`TellPrefill`, :class:`DrainPrefill`,
:class:`DialPrefill` and :class:`DropLink` block (a peer call, a link's release) and
always run on the executor.

An action names its request's record by
:class:`~kvbeam.server.core.actions.RecordRef` and carries, as plain data, what the
driver needs of it (a check's :class:`~kvbeam.server.core.incoming.LandingView`): the
driver never reads or writes a record (only the loop does), and hands the ref back
with each event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbeam.server.core.actions import Count, DropLink, RecordRef
from kvbeam.server.core.incoming import LandingView
from kvbeam.server.core.ports import WriteGrant
from kvbeam.server.state.peers import PeerConn


@dataclass(frozen=True)
class SendOffer:
    """Offer ``grant`` to the request's prefill on ``conn``'s peer channel (one frame,
    one-way); the driver tells :meth:`~kvbeam.server.core.decode.DecodeCore.offer_sent`
    whether it went, and an answer, if prefill sends one, comes back as
    :meth:`~kvbeam.server.core.decode.DecodeCore.answer_arrived`."""

    conn: PeerConn
    ref: RecordRef
    seq_len: int
    grant: WriteGrant
    lease_s: float


@dataclass(frozen=True)
class DigestMark:
    """Start digesting sub-batch ``mark`` of the landing of ``transfer_id`` (its
    notification came); the job goes back as
    :meth:`~kvbeam.server.core.decode.DecodeCore.mark_digesting`."""

    ref: RecordRef
    #: What the driver's digests read of the request (not compared: derived data).
    landing: LandingView = field(compare=False)
    transfer_id: int
    mark: int


@dataclass(frozen=True)
class CheckLanding:
    """Check the landing of ``transfer_id``: its digest record, and the landed bytes
    against it (:class:`~kvbeam.server.core.decode_landing.LandingCheck`); the verdict
    goes back as :meth:`~kvbeam.server.core.decode.DecodeCore.checked`."""

    ref: RecordRef
    #: What the driver's digests read of the request (not compared: derived data).
    landing: LandingView = field(compare=False)
    transfer_id: int


@dataclass(frozen=True)
class TellPrefill:
    """Abort the request on its prefill over ``conn``, best effort: nothing waits on
    the answer (prefill could not be writing it, or decode no longer needs to know)."""

    conn: PeerConn
    request_id: str
    detail: str


@dataclass(frozen=True)
class DrainPrefill:
    """Abort the request on its prefill over ``conn`` and learn whether prefill
    confirmed its writes drained (no connection: it did not); the answer goes back as
    :meth:`~kvbeam.server.core.decode.DecodeCore.drain_answered`."""

    ref: RecordRef
    conn: PeerConn | None
    detail: str


@dataclass(frozen=True)
class DialPrefill:
    """Ask the prefill daemon at ``address`` to handshake with us (its Connect RPC): a
    reservation or a decline names it and the pair has no connection. ``request_ids``
    are those requests: prefill ends them itself if its handshake with us is refused.
    The answer goes back as :meth:`~kvbeam.server.core.decode.DecodeCore.dialed`."""

    address: str
    request_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Freed:
    """The request's pages and slot are free: the engine may reuse them, and the driver
    forgets whatever it held for the request (its sub-batches' digest jobs)."""

    request_id: str


DecodeAction = (SendOffer | DigestMark | CheckLanding | TellPrefill | DrainPrefill
                | DialPrefill | DropLink | Freed | Count)
Actions = list[DecodeAction]
