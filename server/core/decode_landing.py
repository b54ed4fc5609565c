"""Decode's check of a landed request: its digest record, and the bytes against it.

The notification carrying a request's transfer id arrives after every byte (RC
ordering), the request's digest record included: with integrity on, prefill's last
write of the final chunk puts the record (its XXH3-128 digests) into the
request's slot of decode's digest mailbox (:mod:`kvbeam.pools.mailbox`), and the
marker follows it. A large request written in one chunk comes in sub-batches
(:mod:`kvbeam.pools.sub_batches`): each but the last has its own
notification (a *mark*), on which its buffers are digested at once
(:meth:`LandingCheck.digest_mark`), on the digest pool, while the rest is still on
the wire; the record says how many marks came before it, and the check waits for
each mark's digests.

When to check, and what the verdict does, are the core's decisions
(:class:`~kvbeam.server.core.decode.DecodeCore`: ``CheckLanding``, ``checked``).
:class:`LandingCheck` is the driver's part, the I/O: it copies the record out of the
slot and checks it (magic, version, count, self-digest, transfer id, slot, request
id), digests the landed bytes, compares, and returns a :class:`Verdict` (Success's
detail, or the failure naming the field or the buffers). It takes no lock and
changes no request state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvbeam.logs import fields
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest import (
    DIGEST_BYTES,
    DIGEST_NAME,
    DigestParts,
    digest_parts,
    split_digests,
)
from kvbeam.pools.digest_pool import DigestJob, DigestPool
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.mailbox import Expected, Record, RecordArea, RecordError, parse_record
from kvbeam.pools.sub_batches import bounds
from kvbeam.server.core.incoming import Incoming, LandingView
from kvbeam.states import NOT_VERIFIED_NO_DIGESTS, NOT_VERIFIED_OFF, VERIFIED_PREFIX

log = logging.getLogger(__name__)


def checks_inline(landing: Incoming | LandingView, integrity: bool,
                  inline_below: int) -> bool:
    """Whether the check of a landing (given its record or its view) runs on the thread
    that saw it land: integrity is off for it (prefill sends no digests), or its digests
    run inline anyway (fewer bytes than the digest pool hands to its threads,
    ``inline_below``). The core decides its states by it, the driver its thread: one
    rule for both."""
    follows = landing.digests_follow is not False
    return not (integrity and follows) or landing.nbytes < inline_below


@dataclass(frozen=True)
class Verdict:
    """What the check of one landing found."""

    ok: bool
    #: Success's detail (verified, or why not), or the failure (the field or buffers).
    detail: str
    #: For the Success log line: how long the record and the check took.
    timing: str = ""
    #: The digest record's digests (16 bytes per buffer), when one was checked.
    digests: bytes | None = None


class LandingCheck:
    """Checks landings against their digest records, on the digest pool.

    ``memory`` gives the pools, their layout, the mailbox and whether integrity is on,
    read at each check (an engine's attach replaces them); ``clock``: the driver's,
    which also stamped each landing, for the check's timing in its verdict.
    :meth:`before_digests` is the one step a decorating subclass may add to (it does
    nothing here).
    """

    def __init__(self, memory: Callable[[], tuple[AllocatedSide, SideLayout,
                                                  RecordArea | None]],
                 integrity: bool, digest_pool: DigestPool,
                 clock: Callable[[], float]) -> None:
        self.memory = memory
        self.clock = clock
        self.integrity = integrity
        self.digest_pool = digest_pool

    def inline(self, landing: LandingView) -> bool:
        """The check runs on the calling thread (:func:`checks_inline`)."""
        return checks_inline(landing, self.integrity, self.digest_pool.inline_below)

    def check(self, landing: LandingView, transfer_id: int) -> Verdict:
        """Check the landing of ``transfer_id`` (inline on the loop or on the executor:
        it reads only the view; the core decides whether the verdict still counts)."""
        pools, layout, box = self.memory()
        if not self.integrity:
            self.before_digests(landing, pools, None)
            return Verdict(True, NOT_VERIFIED_OFF)
        if not landing.digests_follow:
            self.before_digests(landing, pools, None)
            log.warning("request %s: prefill sent no digests (its integrity check is off): "
                        "arrival proven by the completion, bytes not verified",
                        landing.request_id,
                        extra=fields(landing.request_id, landing.prefill_address))
            return Verdict(True, NOT_VERIFIED_NO_DIGESTS)
        t0 = self.clock()
        try:
            record = self._record(landing, transfer_id, layout, box)
            landed = self._landed_digests(landing, pools, record.marks)
        except RecordError as exc:
            return Verdict(False, str(exc))
        if record.digests != landed:  # one comparison; which buffers only on a mismatch
            bad = [b.name for b, want, got in zip(layout.flat_buffers,
                                                 split_digests(record.digests),
                                                 split_digests(landed), strict=True)
                   if want != got]
            return Verdict(False, f"{DIGEST_NAME} mismatch in {len(bad)} buffer(s): "
                                  f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
        done = self.clock()
        timing = (f"; record and check {(done - t0) * 1e3:.1f} ms, "
                  f"{(done - landing.landed_at) * 1e3:.1f} ms after the landing"
                  + (f", {record.marks} of {record.marks + 1} sub-batches digested as "
                     "they landed" if record.marks else ""))
        return Verdict(True, f"{VERIFIED_PREFIX} {len(landed) // DIGEST_BYTES} buffers "
                             "match prefill's digests", timing, record.digests)

    def digest_mark(self, landing: LandingView, mark: int) -> tuple[DigestJob, DigestParts]:
        """Start digesting sub-batch ``mark``'s buffers on the digest pool (its
        notification came); the job and the request's digest parts are the core's to
        keep (:meth:`DecodeCore.mark_digesting`, on the loop)."""
        pools, _layout, _box = self.memory()
        parts = self._parts(landing, pools)
        lo, hi = bounds(landing.sub_batches, mark, len(parts))
        self.before_digests(landing, pools, range(lo, hi))
        return self.digest_pool.start(parts[lo:hi]), parts

    @staticmethod
    def _record(landing: LandingView, transfer_id: int, layout: SideLayout,
                box: RecordArea | None) -> Record:
        """The request's record in its mailbox slot, checked.

        Raises:
            RecordError: naming the field that failed, with both values.
        """
        if box is None or not 0 <= landing.mailbox_slot < box.slots:
            raise RecordError("slot", f"{landing.mailbox_slot} has no place in the mailbox of "
                                      f"{box.slots if box is not None else 0} slots")
        return parse_record(box.read(landing.mailbox_slot),
                            Expected(len(layout.flat_buffers), transfer_id,
                                     landing.mailbox_slot, landing.request_id))

    def before_digests(self, landing: LandingView, pools: AllocatedSide,
                       buffers: range | None) -> None:
        """Called just before the request's landed bytes of flat ``buffers`` (None: all)
        are digested (or, integrity off, accepted as they are): nothing here, the step a
        decorating subclass may act in."""

    @staticmethod
    def _parts(landing: LandingView, pools: AllocatedSide) -> DigestParts:
        """The request's digest parts, one per flat buffer: those its first mark's
        digest built, which the core kept, else built now (read here, written only by
        the core, on the loop)."""
        parts = landing.parts
        return parts if parts is not None else digest_parts(pools, landing.indices,
                                                            draft=landing.draft)

    def _landed_digests(self, landing: LandingView, pools: AllocatedSide,
                        marks: int) -> bytes:
        """The landed bytes' digests, in flat order, on the digest pool:
        the marked sub-batches' jobs (started as each landed) and the last part's, or
        every buffer's when the record says no mark came.

        Raises:
            RecordError: the record's marks count is not decode's cut of the request.
        """
        if not marks:
            # In parallel over the buffers; Success only once every digest was compared.
            self.before_digests(landing, pools, None)
            return self.digest_pool.digests(pools, landing.indices,
                                            draft=landing.draft).result()
        cut = landing.sub_batches
        if marks != len(cut):
            raise RecordError("marks", (
                f"{marks} sub-batches notified before the record, decode cut the request "
                f"into {len(cut)} (of {len(cut) + 1} parts, by its --verify-sub-batch-mib)"
                if cut else f"{marks} sub-batches notified before the record, decode cut "
                "this request into none (under two sub-batches, or its sub-batches off)"))
        parts = self._parts(landing, pools)
        lo, _hi = bounds(cut, marks + 1, len(parts))
        self.before_digests(landing, pools, range(lo, len(parts)))
        last = self.digest_pool.start(parts[lo:])
        return b"".join([*(landing.marked[k].result() for k in range(1, marks + 1)),
                         last.result()])
