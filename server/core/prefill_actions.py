"""What prefill's core asks of the I/O around it: one small class each.

:class:`~kvbeam.server.core.prefill.PrefillCore` decides and returns these (its send
path, its event handlers in :mod:`kvbeam.server.core.prefill_events`);
:class:`~kvbeam.server.core.prefill_driver.PrefillDriver` does them and hands what
comes back (a connection, decode's grant, a post's failure) to the core as its next
event. With :class:`~kvbeam.server.core.actions.DropLink` and
:class:`~kvbeam.server.core.actions.Count`, both roles' own.

Where each runs is the driver's choice: :class:`Connect`, :class:`AskGrant`,
:class:`TellDecode` and ``DropLink`` block (a handshake, a peer call, a link's
release) and run on the executor; :class:`RunStep` runs where it was asked when the
core says the step cannot block, else on the executor; :class:`PostWrites` and
``Count`` run on the thread that handled the event.

An action names its request's record by :class:`~kvbeam.server.core.actions.RecordRef`
and carries, as plain data, what the driver needs of it: the driver never reads or
writes a record (only the loop does), and hands the ref back with each event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvbeam.pools.digest_pool import DigestJob
from kvbeam.server.core.actions import Count, DropLink, RecordRef
from kvbeam.server.core.chunks import Chunk
from kvbeam.server.core.ports import IndexLists, WriteGrant
from kvbeam.server.core.prefill_record import StagingSlot
from kvbeam.server.state.peers import PeerConn
from kvbeam.states import TransferStatus
from kvbeam.transport.blocks import Blocks


@dataclass(frozen=True)
class TellDecode:
    """Abort the request on its decode over the pair's peer channel (``conn``'s, else
    the pair's newer connection's; when every link the request had failed, a new
    handshake opens one first): prefill failed it and none of its writes is in flight.
    Best effort: nothing waits on the answer."""

    conn: PeerConn | None
    address: str
    request_id: str
    detail: str


@dataclass(frozen=True)
class RunStep:
    """Run the request's step, which the core moved to RUNNING (its next chunk, or its
    resend on a new link): the driver calls :meth:`PrefillCore.step`."""

    ref: RecordRef


@dataclass(frozen=True)
class Connect:
    """Handshake with the decode daemon at ``address``; the answer (a connection or
    the error) goes to :meth:`PrefillCore.connected`, which starts every request that
    waited for it."""

    address: str


@dataclass(frozen=True)
class AskGrant:
    """Ask decode where to write this chunk (BeginWrite: no offer of its reservation
    was in hand); the answer goes to :meth:`PrefillCore.granted`."""

    ref: RecordRef
    seq_len: int
    conn: PeerConn
    chunk: Chunk  # what the step writes


@dataclass(frozen=True)
class DigestInputs:
    """What the driver digests for a step: copied from the record when the step was
    planned, on the loop (the record's staging slot comes with :class:`Booked`)."""

    source: IndexLists  # the source lists of what moves (``Outgoing.moved_source``)
    draft: IndexLists  # the draft's own source lists
    digests: bytes | None  # the request's digests, computed already (a resend's): reused
    #: The jobs of sub-batches earlier steps made whole (flat buffers ``[lo, hi)``).
    early: Mapping[tuple[int, int], DigestJob]


@dataclass(frozen=True)
class PostWrites:
    """Post the chunk's writes, planned and cut by the core: the blocks of each marked
    sub-batch under its mark's id (notified in the step that makes the sub-batch whole:
    decode digests it as it lands), then the rest under the grant's id. ``record``: the
    request's digest record goes too, as the last write's last block when its digests
    are at hand, else as one more notified write once they are. The driver books them
    with :meth:`PrefillCore.book` before the first post and reports the outcome with
    :meth:`PrefillCore.posted` or :meth:`PrefillCore.step_failed`."""

    ref: RecordRef
    decode_address: str  # the request's (its log lines')
    conn: PeerConn
    grant: WriteGrant
    #: (transfer id, blocks, notify) of each write, in posting order; with ``record``
    #: the last is the grant's own, notified unless the record follows on its own.
    writes: tuple[tuple[int, Blocks, bool], ...]
    final: bool
    record: bool
    #: The request's marked sub-batches (the record names their count).
    marks: int
    total_bytes: int
    num_blocks: int
    #: The request's move to Transferring, told to the table's observers (its engine's
    #: push) once the writes are handed to the transport, not before (None: no move).
    moved: TransferStatus | None = None
    #: Flat buffers ``[lo, hi)`` of the sub-batches this step makes whole before the
    #: final chunk: prefill digests them now, so the final chunk digests only the rest.
    digest_early: tuple[tuple[int, int], ...] = ()
    #: What to digest: with ``record`` or ``digest_early`` (integrity on), else None.
    digest: DigestInputs | None = None


@dataclass(frozen=True, slots=True)
class Booked:
    """A step's writes, counted in flight by :meth:`PrefillCore.book` before the
    driver posts them. ``staging``: the request's digest-record staging slot, which the
    driver writes the record into (a step that posts the record; else None)."""

    staging: StagingSlot | None


PrefillAction = TellDecode | RunStep | Connect | AskGrant | PostWrites | DropLink | Count
Actions = list[PrefillAction]
