"""Prefill's digest record (protocol 5): the request's digests, written in band.

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
makes) are the core's: a request takes one under the core lock when it posts its
record and gives it back once none of its writes is outstanding (the record's write
read it), or when its record is forgotten. :class:`PrefillRecords` is a base of
:class:`~kvbeam.server.core.prefill.PrefillCore` (split to keep modules small).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import numpy as np

from kvbeam.errors import SendFailed
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest_pool import DigestJob, DigestPool
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.mailbox import (
    MAILBOX_KEY,
    FreeSlots,
    RecordArea,
    encode_record,
    record_bytes,
    record_size,
)
from kvbeam.pools.plan import side_windows
from kvbeam.server.core.ports import WriteGrant
from kvbeam.server.faults import FaultHooks
from kvbeam.server.peers import PeerConn
from kvbeam.states import FailureReason
from kvbeam.transport.blocks import Blocks

if TYPE_CHECKING:
    from kvbeam.server.core.outgoing import Outgoing

log = logging.getLogger(__name__)


class PrefillRecords:
    """The digest record of the prefill core (state is defined by the core)."""

    pools: AllocatedSide
    layout: SideLayout
    digest_pool: DigestPool
    faults: FaultHooks | None
    _lock: threading.Lock
    #: How many staging slots the core's own area gets (``--max-inflight``).
    staging_slots: int
    _staging: RecordArea | None
    _free_staging: FreeSlots | None

    def use_staging(self, area: RecordArea) -> None:
        """The daemon's staging slots (registered LOCAL) from now on. Records of earlier
        requests that still hold a slot of the old area give it back to that one."""
        with self._lock:
            self._staging, self._free_staging = area, FreeSlots(area.slots)

    def _check_mailbox(self, conn: PeerConn, grant: WriteGrant) -> None:
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

    def _take_staging(self, rec: Outgoing) -> None:
        """Give the request a staging slot if it has none (core lock held).

        Raises:
            SendFailed: every slot holds the record of a request still in flight.
        """
        if rec.staging is not None:
            return
        size = record_bytes(len(self.layout.flat_buffers))
        if self._staging is None or self._staging.record_bytes < size:
            # A core without the daemon's registered area (a test's): its own.
            self._staging = RecordArea(self.staging_slots, size)
            self._free_staging = FreeSlots(self.staging_slots)
        free = self._free_staging
        assert free is not None
        slot = free.take()
        if slot is None:
            raise SendFailed(FailureReason.TRANSPORT_ERROR,
                             f"no free digest-record staging slot: all {free.size} hold "
                             "records of requests whose writes are in flight (--max-inflight)")
        rec.staging = (self._staging, free, slot)

    @staticmethod
    def _give_staging(rec: Outgoing, force: bool = False) -> None:
        """Give the request's staging slot back once no write of it is outstanding
        (``force``: its record is forgotten; its link is gone). Core lock held."""
        if rec.staging is None or (rec.outstanding > 0 and not force):
            return
        _area, free, slot = rec.staging
        rec.staging = None
        free.give(slot)

    def _record_blocks(self, rec: Outgoing, conn: PeerConn, grant: WriteGrant,
                       job: DigestJob | None, marks: int = 0) -> Blocks:
        """The request's digest record, in its staging slot, as the block that writes it
        into decode's mailbox slot (posted notified: the marker follows it); ``marks``:
        the sub-batches notified before it (pools/sub_batches.py). ``job``: the
        digests, started on the digest pool before the data was posted (the source does
        not change while the request lives); computed once per request, a resend writes
        the same digests with its new transfer id. Outside every lock, on the executor
        (it waits for the pool's threads, as the Digests message did)."""
        if rec.digests is None:
            rec.digests = (job or self.digest_pool.digests(
                self.pools, rec.moved_source, draft=rec.src_draft,
                windows=side_windows(self.layout, conn.peer.layout, source=True))).result()
        raw = encode_record(grant.transfer_id, grant.mailbox_slot, rec.request_id, rec.digests,
                            marks=marks)
        if self.faults is not None:  # test-only hook (--enable-fault-injection)
            raw = self.faults.corrupt_record(rec.request_id, raw, grant.transfer_id,
                                             grant.mailbox_slot, rec.digests, marks)
        assert rec.staging is not None and conn.mailbox is not None
        area, _free, slot = rec.staging
        area.put(slot, raw)
        n = min(len(raw), record_size(len(rec.digests)), conn.mailbox.record_bytes)
        return Blocks(np.array([area.slot_addr(slot)], dtype=np.uint64),
                      np.array([conn.mailbox.slot_addr(grant.mailbox_slot)], dtype=np.uint64),
                      np.array([n], dtype=np.uint64))
