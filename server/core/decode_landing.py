"""Decode's landing path: a request's proof of arrival, and its verification.

The notification carrying a request's transfer id arrives after every byte (RC
ordering), the request's digest record included: with integrity on, prefill's last
write of the final chunk puts the record (its XXH3-128 digests, protocol 5) into the
request's slot of decode's digest mailbox (:mod:`kvbeam.pools.mailbox`), and the
marker follows it. A large request written in one chunk comes in sub-batches
(:mod:`kvbeam.pools.sub_batches`, protocol 6): each but the last has its own
notification (a *mark*), on which its buffers are digested at once
(:meth:`DecodeLanding._on_mark`), on the digest pool, while the rest is still on the
wire; the record says how many marks came before it, and the check waits for each
mark's digests. The notification starts :meth:`DecodeLanding._verify`
(:meth:`DecodeLanding._start_verify`): it copies the record out of the slot and checks
it (magic, version, count, self-digest, transfer id, slot, request id), then the
landed bytes against its digests, and makes the request Success, or fails it
(integrity, naming the field or the buffers) and tells prefill. No message is
awaited. A landing small enough that its digests run on the calling thread anyway
is verified on the thread that saw it land (no hand-off); a larger one on the
executor, and a failure is always handled there (telling prefill is a peer call).
:class:`DecodeLanding` is the base of :class:`~kvbeam.server.core.decode.DecodeCore`
that verifies; the request's record and its landing phase are
:mod:`kvbeam.server.core.incoming`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

from kvbeam.logs import fields
from kvbeam.pools.digest import DIGEST_NAME, DigestPart, digest_parts
from kvbeam.pools.digest_pool import DigestPool
from kvbeam.pools.mailbox import Expected, Record, RecordArea, RecordError, parse_record
from kvbeam.pools.sub_batches import bounds
from kvbeam.server.core.base import CoreBase
from kvbeam.server.core.incoming import Incoming, Landing
from kvbeam.server.faults import FaultHooks
from kvbeam.server.peers import Peers
from kvbeam.states import (
    NOT_VERIFIED_NO_DIGESTS,
    NOT_VERIFIED_OFF,
    VERIFIED_PREFIX,
    FailureReason,
    TransferState,
)

log = logging.getLogger(__name__)


#: What a landed request waits for when prefill's integrity flag is not known (its
#: answer to the Offer never came) and no record is in the slot (a timeout names it).
WAITING_FOR_DIGESTS = ("the writes landed without a digest record, and prefill's answer "
                       "to the Offer (its integrity flag) never came")


class DecodeLanding(CoreBase):
    """Verification of a landed request (state is defined by the core)."""

    integrity: bool
    faults: FaultHooks | None
    peers: Peers
    io: Executor
    digest_pool: DigestPool
    #: The digest mailbox: one record slot per request slot (set by the core).
    mailbox: RecordArea | None
    _lock: threading.Lock
    _res: dict[str, Incoming]
    #: Forget a request and free its slot (the core's: ``_free(request_id, why)``).
    _free: Callable[[str, str], None]
    #: Abort a request on prefill; True once prefill confirmed its writes drained (the
    #: core's: ``_tell_prefill(res, detail, timeout=None)``).
    _tell_prefill: Callable[..., bool]

    def _ready(self, res: Incoming) -> bool:
        """Landed, and prefill's integrity flag known: verify now, once.

        Core lock held. With our integrity on and prefill's flag not known yet (an
        Offer whose answer is not back), a record in the request's mailbox slot says
        prefill's integrity is on (the slot was cleared when it was reserved, and the
        record lands before the marker); without one the request waits for the answer.
        """
        if res.landing is not Landing.LANDED:
            return False
        box = self.mailbox
        # The slot is read only where its record decides something.
        recorded = (self.integrity and (res.digests_follow is None or bool(res.sub_batches))
                    and box is not None and 0 <= res.mailbox_slot < box.slots
                    and box.has_record(res.mailbox_slot))
        if self.integrity and res.digests_follow is None:
            if not recorded:
                self.table.waiting_for(res.request_id, WAITING_FOR_DIGESTS)
                return False
            res.digests_follow = True
        if res.digests_follow and res.sub_batches and recorded:
            assert box is not None
            # The record says how many marks came before it; a count decode did not cut
            # is refused by the check itself (naming both), not waited for.
            marks = box.marks(res.mailbox_slot)
            if marks == len(res.sub_batches) and len(res.marked) < marks:
                self.table.waiting_for(res.request_id, (
                    f"the marks of its sub-batches: the digest record says {marks} came "
                    f"before it, {len(res.marked)} did"))
                return False
        res.verify()
        return True

    def _record(self, res: Incoming, transfer_id: int) -> Record:
        """The request's record in its mailbox slot, checked (executor, no lock: nothing
        writes the slot while the landing is verified).

        Raises:
            RecordError: naming the field that failed, with both values.
        """
        box = self.mailbox
        if box is None or not 0 <= res.mailbox_slot < box.slots:
            raise RecordError("slot", f"{res.mailbox_slot} has no place in the mailbox of "
                                      f"{box.slots if box is not None else 0} slots")
        return parse_record(box.read(res.mailbox_slot),
                            Expected(len(self.layout.flat_buffers), transfer_id,
                                     res.mailbox_slot, res.request_id))

    def _start_verify(self, res: Incoming, transfer_id: int) -> None:
        """Verify a landing (no lock held): here when it cannot block, i.e. integrity is
        off or its digests run inline (fewer bytes than the digest pool hands to its
        threads), else on the executor."""
        if not (self.integrity and res.digests_follow) \
                or res.nbytes < self.digest_pool.inline_below:
            self._verify(res, transfer_id, inline=True)
        else:
            self.io.submit(self._verify, res, transfer_id)

    def _integrity_failed(self, res: Incoming, transfer_id: int, detail: str) -> None:
        """Fail a landing whose record or bytes do not check out (executor)."""
        rid = res.request_id
        with self._lock:
            current = self._current(res, transfer_id)
        if not current:
            self._replaced(res, transfer_id)
            return
        if self.table.fail(rid, FailureReason.INTEGRITY, detail):
            log.error("request %s failed: integrity: %s", rid, detail,
                      extra=fields(rid, res.prefill_address))
            self._free(rid, "integrity failure")
            self._tell_prefill(res, f"decode integrity check failed: {detail}")

    @staticmethod
    def _current(res: Incoming, transfer_id: int) -> bool:
        """The landing of ``transfer_id`` is still the request's (no resend replaced it).
        Core lock held."""
        return res.transfer_id == transfer_id and res.landed

    def _verify(self, res: Incoming, transfer_id: int, inline: bool = False) -> None:
        """Check the landed bytes against prefill's digests, then Success.

        ``transfer_id`` is the landing that was queued: its result counts only while
        that landing is still the request's (checked under the lock, with the verdict).
        ``inline``: on the thread that saw the landing (:meth:`_start_verify`), which
        must not block: a failure is handled on the executor.
        """
        def failed(detail: str) -> None:
            if inline:
                self.io.submit(self._integrity_failed, res, transfer_id, detail)
            else:
                self._integrity_failed(res, transfer_id, detail)

        rid = res.request_id
        verified = NOT_VERIFIED_OFF
        timing = ""
        if not self.integrity:
            self._corrupt_landed(res, None)
        if res.digests_follow and self.integrity:
            t0 = time.monotonic()
            try:
                record = self._record(res, transfer_id)
                res.digests = record.digests
                landed = self._landed_digests(res, record.marks)
            except RecordError as exc:
                failed(str(exc))
                return
            timing = (f"; record and check {(time.monotonic() - t0) * 1e3:.1f} ms, "
                      f"{(time.monotonic() - res.landed_at) * 1e3:.1f} ms after the landing"
                      + (f", {record.marks} of {record.marks + 1} sub-batches digested as "
                         "they landed" if record.marks else ""))
            bad = [b.name for b, want, got in
                   zip(self.layout.flat_buffers, res.digests, landed, strict=True)
                   if want != got]
            if bad:
                detail = (f"{DIGEST_NAME} mismatch in {len(bad)} buffer(s): "
                          f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
                failed(detail)
                return
            verified = f"{VERIFIED_PREFIX} {len(landed)} buffers match prefill's digests"
        elif self.integrity:
            self._corrupt_landed(res, None)
            verified = NOT_VERIFIED_NO_DIGESTS
            log.warning("request %s: prefill sent no digests (its integrity check is off): "
                        "arrival proven by the completion, bytes not verified",
                        rid, extra=fields(rid, res.prefill_address))
        with self._lock:
            current = self._current(res, transfer_id)
            if current:
                try:
                    self.table.advance(rid, TransferState.SUCCESS, detail=verified,
                                       nbytes=res.nbytes)
                except Exception as exc:  # already failed (aborted, timed out): nothing to do
                    log.info("request %s landed after it ended: %s", rid, exc,
                             extra=fields(rid, res.prefill_address))
                    return
                res.verified(time.monotonic())
        if not current:
            self._replaced(res, transfer_id)
            return
        log.info("request %s: Success (%d bytes landed in slot %d; %s%s)", rid, res.nbytes,
                 res.slot, verified, timing, extra=fields(rid, res.prefill_address))

    def _corrupt_landed(self, res: Incoming, buffers: range | None) -> None:
        """The test-only hook that flips a landed byte (--enable-fault-injection), among
        ``buffers`` (None: any), before they are digested."""
        if self.faults is not None:
            self.faults.after_landing(res.request_id, self.pools, res.indices, res.draft,
                                      buffers=buffers)

    def _parts(self, res: Incoming) -> list[DigestPart]:
        """The request's digest parts, one per flat buffer (built once; no lock needed:
        a race builds the same list twice)."""
        parts = res.parts
        if parts is None:
            parts = res.parts = digest_parts(self.pools, res.indices, draft=res.draft)
        return parts

    def _landed_digests(self, res: Incoming, marks: int) -> list[int]:
        """The landed bytes' digests, in flat order, on the digest pool (no lock held):
        the marked sub-batches' jobs (started as each landed) and the last part's, or
        every buffer's when the record says no mark came.

        Raises:
            RecordError: the record's marks count is not decode's cut of the request.
        """
        if not marks:
            # In parallel over the buffers; Success only once every digest was compared.
            self._corrupt_landed(res, None)
            return self.digest_pool.digests(self.pools, res.indices, draft=res.draft).result()
        cut = res.sub_batches
        if marks != len(cut):
            raise RecordError("marks", (
                f"{marks} sub-batches notified before the record, decode cut the request "
                f"into {len(cut)} (of {len(cut) + 1} parts, by its --verify-sub-batch-mib)"
                if cut else f"{marks} sub-batches notified before the record, decode cut "
                "this request into none (under two sub-batches, or its sub-batches off)"))
        parts = self._parts(res)
        lo, _hi = bounds(cut, marks + 1, len(parts))
        self._corrupt_landed(res, range(lo, len(parts)))
        last = self.digest_pool.start(parts[lo:])
        out: list[int] = []
        for k in range(1, marks + 1):
            out.extend(res.marked[k].result())
        out.extend(last.result())
        return out

    def _on_mark(self, res: Incoming, transfer_id: int, mark: int) -> None:
        """Sub-batch ``mark`` of the landing of ``transfer_id`` landed (its notification
        came): digest its buffers now, on the digest pool (no lock held), and verify the
        request if it was all that was missing. A mark decode did not cut, a repeated
        one, or one of a replaced landing is ignored (the record's count decides)."""
        rid = res.request_id
        parts = self._parts(res)
        lo, hi = bounds(res.sub_batches, mark, len(parts))
        self._corrupt_landed(res, range(lo, hi))
        job = self.digest_pool.start(parts[lo:hi])
        with self._lock:
            fresh = (res.transfer_id == transfer_id and mark not in res.marked
                     and not res.checking)
            if fresh:
                res.marked[mark] = job
            go = fresh and self._ready(res)
        if not fresh:
            log.warning("request %s: mark %d of transfer %d came again, or after its "
                        "landing was replaced or verified: ignored", rid, mark, transfer_id,
                        extra=fields(rid, res.prefill_address))
        elif go:
            self._start_verify(res, transfer_id)

    @staticmethod
    def _replaced(res: Incoming, transfer_id: int) -> None:
        log.warning("request %s: the landing of transfer %d was replaced while it was "
                    "verified: its verdict is void", res.request_id, transfer_id,
                    extra=fields(res.request_id, res.prefill_address))
