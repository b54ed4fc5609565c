"""Decode's landing path: the request's record, and its proof of arrival.

The notification carrying a request's transfer id arrives after every byte (RC
ordering); :meth:`DecodeLanding._verify` then checks the landed bytes against
prefill's digests on the executor and makes the request Success, or fails it
(integrity) and tells prefill. :class:`DecodeLanding` is a base of
:class:`~kvbeam.server.core.decode.DecodeCore` (split to keep modules small).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from kvbeam.logs import fields
from kvbeam.pools.digest import request_digests
from kvbeam.server.core.base import CoreBase
from kvbeam.server.core.ports import IndexLists
from kvbeam.server.faults import FaultHooks
from kvbeam.states import (
    NOT_VERIFIED_NO_DIGESTS,
    NOT_VERIFIED_OFF,
    VERIFIED_PREFIX,
    FailureReason,
    TransferState,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Reservation:
    """Decode's one record of a request (its lifecycle state lives in the table)."""

    request_id: str
    slot: int
    seq_len: int
    prefill_address: str
    transfer_id: int
    indices: IndexLists
    nbytes: int
    peer_instance: str = ""          # set by BeginWrite: prefill may write from now on
    digests: list[int] | None = None
    success_at: float | None = None
    landed: bool = False
    draft: IndexLists = field(default_factory=dict)  # the draft's own lists (engine's)
    link_id: int | None = None       # the link prefill was granted: only its notification counts


class DecodeLanding(CoreBase):
    """Verification of a landed request (state is defined by the core)."""

    integrity: bool
    faults: FaultHooks
    _lock: threading.Lock

    def _free(self, rid: str, why: str) -> None:
        """Forget the request and free its slot (defined by the core)."""
        raise NotImplementedError

    def _tell_prefill(self, res: Reservation, detail: str, timeout: float | None = None) -> bool:
        """Abort the request on prefill (defined by the core)."""
        raise NotImplementedError

    def _verify(self, res: Reservation) -> None:
        """Check the landed bytes against prefill's digests (executor), then Success."""
        rid = res.request_id
        self.faults.after_landing(rid, self.pools, res.indices, res.draft)
        verified = NOT_VERIFIED_OFF
        if res.digests is not None and self.integrity:
            landed = request_digests(self.pools, res.indices, draft=res.draft)
            bad = [b.name for b, want, got in
                   zip(self.layout.flat_buffers, res.digests, landed, strict=True)
                   if want != got]
            if bad:
                detail = (f"CRC32C mismatch in {len(bad)} buffer(s): "
                          f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
                if self.table.fail(rid, FailureReason.INTEGRITY, detail):
                    log.error("request %s failed: integrity: %s", rid, detail,
                              extra=fields(rid, res.prefill_address))
                    self._free(rid, "integrity failure")
                    self._tell_prefill(res, f"decode integrity check failed: {detail}")
                return
            verified = f"{VERIFIED_PREFIX} {len(landed)} buffers match prefill's digests"
        elif res.digests is None and self.integrity:
            verified = NOT_VERIFIED_NO_DIGESTS
            log.warning("request %s: prefill sent no digests (its integrity check is off): "
                        "arrival proven by the completion, bytes not verified",
                        rid, extra=fields(rid, res.prefill_address))
        with self._lock:
            try:
                self.table.advance(rid, TransferState.SUCCESS, detail=verified,
                                   nbytes=res.nbytes)
            except Exception as exc:  # already failed (aborted, timed out): nothing to do
                log.info("request %s landed after it ended: %s", rid, exc,
                         extra=fields(rid, res.prefill_address))
                return
            res.success_at = time.monotonic()
        log.info("request %s: Success (%d bytes landed in slot %d; %s)", rid, res.nbytes,
                 res.slot, verified, extra=fields(rid, res.prefill_address))
