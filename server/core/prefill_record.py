"""Prefill's digest record: the request's digests, written in band.

With integrity on, the final chunk's data goes out with ``notify=False`` and one more
write of the same transfer id follows it: the request's digest record
(:mod:`kvbeam.pools.mailbox`), from one of prefill's staging slots into the request's
slot of decode's mailbox, with ``notify=True``, so the completion marker comes after
the record and every byte before it (across QPs too: :mod:`kvbeam.transport.verbs.lanes`
orders a transfer's marker after its earlier writes on other lanes, as for a chunked
request's final chunk). The digests are computed once per request on the digest pool,
started before the data is posted; a resend on a new link writes the record again
with its new transfer id.

The staging slots (``--max-inflight`` of them, one LOCAL registration the runtime
makes) are the core's: a request takes one, on the daemon's loop, when the driver books
the step that posts its record (:meth:`~kvbeam.server.core.prefill.PrefillCore.book`,
whose ``Booked`` answer hands the slot to the driver), and gives it back once none of
its writes is outstanding (the record's write read it), or when its record is
forgotten. :class:`RecordStager` owns them; the core holds one and calls it on the loop
for the slots (``take``, ``give``, ``use``); the driver calls it for the record's bytes
(``blocks``), writing only its own request's slot.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from kvbeam.errors import SendFailed
from kvbeam.pools.mailbox import (
    MAILBOX_KEY,
    FreeSlots,
    RecordArea,
    record_bytes,
    record_size,
)
from kvbeam.server.core.ports import WriteGrant
from kvbeam.server.state.peers import PeerConn
from kvbeam.states import FailureReason
from kvbeam.transport.blocks import Blocks

if TYPE_CHECKING:
    from kvbeam.server.core.outgoing import Outgoing

log = logging.getLogger(__name__)

#: A request's staging slot: the area, its free list, the slot.
StagingSlot = tuple[RecordArea, FreeSlots, int]


class RecordStager:
    """Prefill's digest-record staging slots, and the record's block into decode's mailbox.

    Args:
        slots: how many slots an area of its own gets (``--max-inflight``), when the
            daemon gave none (:meth:`use`) or gave one too small for the layout's records.

    Not thread-safe: the core calls ``use``, ``take`` and ``give`` on the daemon's loop.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._area: RecordArea | None = None
        self._free: FreeSlots | None = None

    @property
    def free(self) -> FreeSlots | None:
        """The free list of the current area (tests, diagnostics)."""
        return self._free

    def use(self, area: RecordArea) -> None:
        """The daemon's staging slots (registered LOCAL) from now on. Records of earlier
        requests that still hold a slot of the old area give it back to that one."""
        self._area, self._free = area, FreeSlots(area.slots)

    @staticmethod
    def check_mailbox(conn: PeerConn, grant: WriteGrant) -> None:
        """Decode's mailbox and the grant's slot in it (untrusted: the peer's word)."""
        box = conn.mailbox
        if box is None:
            raise SendFailed(FailureReason.INCOMPATIBLE,
                             f"decode at {conn.control_address} advertised no digest mailbox "
                             f"({MAILBOX_KEY}), and this prefill's integrity check is on")
        if not 0 <= grant.mailbox_slot < box.slots:
            raise SendFailed(FailureReason.INVALID_REQUEST,
                             f"decode's grant: mailbox slot {grant.mailbox_slot} outside its "
                             f"mailbox of {box.slots} slots")

    def take(self, rec: Outgoing, buffers: int) -> None:
        """Give the request a staging slot if it has none; ``buffers``: the layout's flat
        buffers (a record's size).

        Raises:
            SendFailed: every slot holds the record of a request still in flight.
        """
        if rec.staging is not None:
            return
        size = record_bytes(buffers)
        if self._area is None or self._area.record_bytes < size:
            # A core without the daemon's registered area (a test's): its own.
            self._area = RecordArea(self.slots, size)
            self._free = FreeSlots(self.slots)
        free = self._free
        assert free is not None
        slot = free.take()
        if slot is None:
            raise SendFailed(FailureReason.TRANSPORT_ERROR,
                             f"no free digest-record staging slot: all {free.size} hold "
                             "records of requests whose writes are in flight (--max-inflight)")
        rec.staging = (self._area, free, slot)

    @staticmethod
    def give(rec: Outgoing, force: bool = False) -> None:
        """Give the request's staging slot back once no write of it is outstanding
        (``force``: its record is forgotten; its link is gone)."""
        if rec.staging is None or (rec.attempt.outstanding > 0 and not force):
            return
        _area, free, slot = rec.staging
        rec.staging = None
        free.give(slot)

    @staticmethod
    def blocks(staging: StagingSlot, conn: PeerConn, grant: WriteGrant, raw: bytes,
               buffers: int) -> Blocks:
        """The request's digest record ``raw`` (of ``buffers`` digests, encoded by the
        driver's :class:`~kvbeam.server.core.prefill_driver.Writer`), put in its
        ``staging`` slot, as the block that writes it into decode's mailbox slot (posted
        notified: the marker follows it). No lock needed: only the request's own step
        writes its slot."""
        assert conn.mailbox is not None
        area, _free, slot = staging
        area.put(slot, raw)
        n = min(len(raw), record_size(buffers), conn.mailbox.record_bytes)
        return Blocks(np.array([area.slot_addr(slot)], dtype=np.uint64),
                      np.array([conn.mailbox.slot_addr(grant.mailbox_slot)], dtype=np.uint64),
                      np.array([n], dtype=np.uint64))
