"""Decode's landing path: the request's record, and its proof of arrival.

The notification carrying a request's transfer id arrives after every byte (RC
ordering); prefill's digests arrive separately, in Digests, which prefill sends
once it posted the final writes (it digests while they are in flight). Whichever
of the two comes second queues :meth:`DecodeLanding._verify` on the executor: it
checks the landed bytes against the digests and makes the request Success, or
fails it (integrity) and tells prefill. With integrity on, no Success without
both; digests that never come leave the request to its Transferring deadline,
whose detail names them. :class:`DecodeLanding` is a base of
:class:`~kvbeam.server.core.decode.DecodeCore` (split to keep modules small).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

from kvbeam.errors import BadRequest, NotHandshakenError, UnknownRequest
from kvbeam.logs import fields
from kvbeam.pools.digest import DIGEST_NAME
from kvbeam.pools.digest_pool import DigestPool
from kvbeam.server.core.base import CoreBase
from kvbeam.server.core.ports import IndexLists
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


@dataclass(eq=False)
class Incoming:
    """Decode's one record of a request (its lifecycle state lives in the table).

    Prefill's counterpart is :class:`~kvbeam.server.core.prefill.Outgoing`; the
    scheduler's view of the same reservation is :class:`kvbeam.client.Reservation`
    (what Reserve answered).
    """

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
    # Prefill's integrity flag (from BeginWrite or its answer to Offer): True, its
    # digests come with Digests; None, not known yet (an Offer not answered).
    digests_follow: bool | None = None
    offered: bool = False            # granted by Offer, no BeginWrite since
    # time.monotonic() of the landing and of the digests' arrival: the Success log line
    # says which came last and how long the check took (where integrity's time goes).
    landed_at: float = 0.0
    digests_at: float = 0.0
    verifying: bool = False          # verification is queued (once per landing)
    # An abort prefill did not confirm (its writes may be in flight): when it was first
    # left unconfirmed and last asked again; ``asking``: an Abort of it is under way.
    unconfirmed_since: float | None = None
    asked_at: float = 0.0
    asking: bool = False
    abort_detail: str = ""
    kv_skip: int = 0                 # leading KV pages the engine holds: not written


#: What a landed request waits for when its digests are missing (a timeout names it).
WAITING_FOR_DIGESTS = "the writes landed; prefill's digests (Digests) never arrived"


class DecodeLanding(CoreBase):
    """Verification of a landed request (state is defined by the core)."""

    integrity: bool
    faults: FaultHooks | None
    peers: Peers
    io: Executor
    digest_pool: DigestPool
    _lock: threading.Lock
    _res: dict[str, Incoming]

    def digests(self, request_id: str, instance_id: str, transfer_id: int,
                digests: list[int]) -> None:
        """Prefill's digests of a request it posted; verify if it landed already.

        Digests for another transfer id (an attempt a resend replaced) are ignored:
        the resend sends them again with its own.
        """
        if self.peers.get(instance_id) is None:
            raise NotHandshakenError(
                f"no successful handshake with prefill instance {instance_id!r}")
        if len(digests) != len(self.layout.flat_buffers):
            raise BadRequest(f"request {request_id}: {len(digests)} digests for "
                             f"{len(self.layout.flat_buffers)} buffers")
        with self._lock:
            res = self._res.get(request_id)
            if res is None:
                raise UnknownRequest(f"no reservation for request {request_id!r} on this "
                                     "decode daemon")
            if res.peer_instance != instance_id:
                raise BadRequest(f"request {request_id} is not being written by prefill "
                                 f"instance {instance_id}")
            current = transfer_id == res.transfer_id
            if current:
                res.digests, res.digests_follow = list(digests), True
                res.digests_at = time.monotonic()
            go = current and self._ready(res)
        if not current:
            log.info("request %s: digests for the replaced transfer %d ignored", request_id,
                     transfer_id, extra=fields(request_id, res.prefill_address))
        if go:
            self.io.submit(self._verify, res, transfer_id)

    def _ready(self, res: Incoming) -> bool:
        """Landed, and the digests arrived where they are needed: verify now, once.

        Core lock held. Digests are needed when our integrity is on and prefill's is
        on or not known yet.
        """
        if not res.landed or res.verifying:
            return False
        if self.integrity and res.digests_follow is not False and res.digests is None:
            self.table.waiting_for(res.request_id, WAITING_FOR_DIGESTS)
            return False
        res.verifying = True
        return True

    def _free(self, rid: str, why: str) -> None:
        """Forget the request and free its slot (defined by the core)."""
        raise NotImplementedError

    def _tell_prefill(self, res: Incoming, detail: str, timeout: float | None = None) -> bool:
        """Abort the request on prefill (defined by the core)."""
        raise NotImplementedError

    @staticmethod
    def _current(res: Incoming, transfer_id: int) -> bool:
        """The landing of ``transfer_id`` is still the request's (no resend replaced it).
        Core lock held."""
        return res.transfer_id == transfer_id and res.landed

    def _verify(self, res: Incoming, transfer_id: int) -> None:
        """Check the landed bytes against prefill's digests (executor), then Success.

        ``transfer_id`` is the landing that was queued: its result counts only while
        that landing is still the request's (checked under the lock, with the verdict).
        """
        rid = res.request_id
        if self.faults is not None:  # test-only hook (--enable-fault-injection)
            self.faults.after_landing(rid, self.pools, res.indices, res.draft)
        verified = NOT_VERIFIED_OFF
        timing = ""
        if res.digests is not None and self.integrity:
            t0 = time.monotonic()
            # In parallel over the buffers, on the digest pool; no lock held while it runs,
            # and Success (below) only once every buffer's digest was compared.
            landed = self.digest_pool.digests(self.pools, res.indices, draft=res.draft).result()
            lag = (res.digests_at - res.landed_at) * 1e3
            timing = (f"; digests {abs(lag):.1f} ms {'after' if lag > 0 else 'before'} the "
                      f"landing, check {(time.monotonic() - t0) * 1e3:.1f} ms")
            bad = [b.name for b, want, got in
                   zip(self.layout.flat_buffers, res.digests, landed, strict=True)
                   if want != got]
            if bad:
                detail = (f"{DIGEST_NAME} mismatch in {len(bad)} buffer(s): "
                          f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
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
                return
            verified = f"{VERIFIED_PREFIX} {len(landed)} buffers match prefill's digests"
        elif res.digests is None and self.integrity:
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
                res.success_at = time.monotonic()
        if not current:
            self._replaced(res, transfer_id)
            return
        log.info("request %s: Success (%d bytes landed in slot %d; %s%s)", rid, res.nbytes,
                 res.slot, verified, timing, extra=fields(rid, res.prefill_address))

    @staticmethod
    def _replaced(res: Incoming, transfer_id: int) -> None:
        log.warning("request %s: the landing of transfer %d was replaced while it was "
                    "verified: its verdict is void", res.request_id, transfer_id,
                    extra=fields(res.request_id, res.prefill_address))
