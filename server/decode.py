"""The decode daemon: reserves slots, tells prefill where to write, proves arrival.

Per request: Reserve holds a slot and computes the destination indices
(Bootstrapping, its deadline is the reservation lease); prefill's BeginWrite
moves it to Transferring and learns the indices and the transfer id; the RDMA
WRITE WITH IMMEDIATE carrying that id arrives after every byte (RC ordering), the
digests are checked, and the request is Success. The slot stays held until the
scheduler's Release (the engine took over) or the hand-off lease expires.

No slot is freed while the prefill side might still write into it: a failure
decode originates after prefill began writing is propagated to prefill first
(prefill drains its writes before answering); if prefill cannot confirm, the link
to it is torn down, after which no write from it can land.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
import numpy.typing as npt

from kvbeam.errors import BadRequest, NotHandshakenError, UnknownRequest
from kvbeam.logs import fields
from kvbeam.pools.digest import request_digests
from kvbeam.pools.indices import request_indices
from kvbeam.pools.types import IndexKind
from kvbeam.proto.fields import host_port
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.transfer_codec import indices_to_proto
from kvbeam.rpc_errors import handled
from kvbeam.server.daemon_servicer import DaemonServicer
from kvbeam.server.handshake import VerifiedPeer
from kvbeam.server.peers import PeerConn
from kvbeam.server.runtime import Runtime
from kvbeam.server.slots import SlotPool
from kvbeam.server.validation import request_id_of, seq_len_of
from kvbeam.states import (
    NOT_VERIFIED_NO_DIGESTS,
    NOT_VERIFIED_OFF,
    VERIFIED_PREFIX,
    FailureReason,
    TransferState,
    TransferStatus,
)
from kvbeam.transport.base import Event, EventKind, Link
from kvbeam.transport.endpoint import Endpoint

log = logging.getLogger(__name__)


@dataclass
class Reservation:
    """Decode's books for one request."""

    request_id: str
    slot: int
    seq_len: int
    prefill_address: str
    transfer_id: int
    indices: dict[IndexKind, npt.NDArray[np.int64]]
    nbytes: int
    peer_instance: str = ""          # set by BeginWrite: prefill may write from now on
    digests: list[int] | None = None
    success_at: float | None = None
    landed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class DecodeServicer(DaemonServicer):
    """Reserve, BeginWrite, Release, Abort and the arrival of transfers."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime)
        self.slots = SlotPool(runtime.config.target.num_req_slots)
        self._res: dict[str, Reservation] = {}
        self._by_transfer: dict[int, str] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending_links: dict[str, Link] = {}

    # ---- handshake hooks: one link per verified prefill -------------------------
    def endpoint_for(self, peer: VerifiedPeer) -> Endpoint:
        """Create this peer's link; its endpoint (QPN, rkeys) goes into our reply."""
        link = self.rt.transport.create_link()
        with self._lock:
            old = self._pending_links.pop(peer.instance_id, None)
            self._pending_links[peer.instance_id] = link
        if old is not None:
            old.release()
        return link.endpoint

    def on_verified(self, peer: VerifiedPeer) -> None:
        """Connect the peer's link (before our reply leaves, so before any write)."""
        with self._lock:
            link = self._pending_links.pop(peer.instance_id)
        previous = self.rt.peers.get(peer.instance_id)
        try:
            link.connect(peer.endpoint)
            conn = PeerConn(peer, link, self.rt.options)
        except Exception:
            link.release()
            self.peers.remove(peer.instance_id)
            raise
        if previous is not None:  # the same instance handshook again (e.g. after a link error)
            self.peer_lost(previous, "peer handshook again; the old link is replaced",
                           gone=False)
        self.rt.peers.add(conn)
        log.info("prefill %s at %s verified and connected (%s)", peer.instance_id,
                 peer.control_address, self.rt.transport.kind,
                 extra=fields(peer=peer.control_address))

    # ---- RPCs ----------------------------------------------------------------------
    @handled
    def Reserve(self, request: pb.ReserveRequest,
                context: grpc.ServicerContext) -> pb.ReserveResponse:
        """Hold a slot for a request and compute its destination indices."""
        rid = request_id_of(request.request_id)
        spec = self.rt.config.target
        seq_len = seq_len_of(request.seq_len, spec.max_context_len)
        host_port(request.prefill_address, "prefill_address")
        prefill = request.prefill_address
        slot = self.slots.acquire(rid)
        try:
            self.table.create(rid, prefill)
        except Exception:
            self.slots.release(rid)
            raise
        indices = request_indices(spec, slot, seq_len)
        tid = next(self._ids) & 0xFFFFFFFF
        nbytes = sum(len(indices[b.index_kind]) * b.item_len
                     for b in self.rt.layout.flat_buffers)
        with self._lock:
            self._res[rid] = Reservation(rid, slot, seq_len, prefill, tid, indices, nbytes)
            self._by_transfer[tid] = rid
        log.info("request %s: reserved slot %d for %d tokens from prefill %s", rid, slot,
                 seq_len, prefill, extra=fields(rid, prefill))
        return pb.ReserveResponse(
            request_id=rid, slot=slot, indices=indices_to_proto(indices),
            lease_ms=int(self.rt.settings.deadline_bootstrap_s * 1000),
            instance_id=self.local.instance_id)

    @handled
    def BeginWrite(self, request: pb.BeginWriteRequest,
                   context: grpc.ServicerContext) -> pb.BeginWriteResponse:
        """Prefill is about to write (a chunk of) a request: check it may, say where."""
        rid = request_id_of(request.request_id)
        conn = self.rt.peers.get(request.instance_id)
        if conn is None:
            raise NotHandshakenError(
                f"no successful handshake with prefill instance {request.instance_id!r}")
        res = self._reservation(rid)
        if conn.control_address != res.prefill_address:
            raise BadRequest(f"request {rid} is reserved for prefill {res.prefill_address}, "
                             f"not {conn.control_address}")
        if request.seq_len != res.seq_len:
            raise BadRequest(f"request {rid}: seq_len {request.seq_len} differs from the "
                             f"reserved {res.seq_len}")
        if request.has_digests:
            n = len(self.rt.layout.flat_buffers)
            if len(request.digests) != n:
                raise BadRequest(f"request {rid}: {len(request.digests)} digests for {n} buffers")
        with res.lock:
            snap = self._require_status(rid)
            if res.peer_instance and res.peer_instance != conn.instance_id:
                raise BadRequest(f"request {rid} is being written by prefill instance "
                                 f"{res.peer_instance}")
            if snap.state is TransferState.BOOTSTRAPPING:
                self.table.advance(rid, TransferState.WAITING_FOR_INPUT)
                self.table.advance(rid, TransferState.TRANSFERRING)
            elif snap.state is TransferState.TRANSFERRING:
                self.table.touch(rid)  # a further chunk is progress
            else:
                self.table.advance(rid, TransferState.TRANSFERRING)  # raises: not writable
            res.peer_instance = conn.instance_id
            if request.final_chunk and request.has_digests:
                res.digests = list(request.digests)
        return pb.BeginWriteResponse(request_id=rid, transfer_id=res.transfer_id, slot=res.slot,
                                     indices=indices_to_proto(res.indices),
                                     instance_id=self.local.instance_id)

    @handled
    def Release(self, request: pb.ReleaseRequest,
                context: grpc.ServicerContext) -> pb.TransferStatus:
        """The engine took over a request that reached Success: free its slot."""
        rid = request_id_of(request.request_id)
        snap = self._require_status(rid)
        if snap.state is not TransferState.SUCCESS:
            raise BadRequest(f"request {rid} is {snap.state.value}, not Success: only a "
                             "finished request is released (use Abort to cancel)")
        self._free(rid, "released by the scheduler")
        return self._status(snap)

    @handled
    def Abort(self, request: pb.AbortRequest,
              context: grpc.ServicerContext) -> pb.TransferStatus:
        """Abort a request: fail it, make sure prefill stops writing, free the slot."""
        rid = request_id_of(request.request_id)
        snap = self._require_status(rid)
        if snap.state is TransferState.SUCCESS:
            self._free(rid, "aborted after Success")
            return self._status(snap)
        if request.from_peer:
            # Prefill failed or was aborted and has drained its writes: free at once.
            detail = request.detail or "aborted by prefill"
            failed = self.table.fail(rid, FailureReason.PEER_FAILED, detail)
            if failed is not None:
                log.warning("request %s failed: prefill reported: %s", rid, detail,
                            extra=fields(rid, snap.peer))
            self._free(rid, "prefill aborted")
            return self._status(self._require_status(rid))
        failed = self.table.fail(rid, FailureReason.ABORTED, request.detail or "aborted")
        if failed is not None:
            log.info("request %s aborted by the scheduler", rid, extra=fields(rid, snap.peer))
            self._stop_prefill_then_free(rid, request.detail or "aborted on decode")
        return self._status(self._require_status(rid))

    # ---- events and deadlines -----------------------------------------------------
    def on_event(self, event: Event) -> None:
        """NOTIFIED: a transfer landed; LINK_FAILED: the peer is gone."""
        conn = self.rt.peers.by_link(event.link)
        if event.kind is EventKind.LINK_FAILED:
            if conn is not None:
                self.peer_lost(conn, f"link failed: {event.status}: {event.detail}", gone=False)
            return
        if event.kind is not EventKind.NOTIFIED or event.transfer_id is None:
            return
        with self._lock:
            rid = self._by_transfer.get(event.transfer_id)
            res = self._res.get(rid) if rid else None
        if res is None or conn is None or res.peer_instance != conn.instance_id:
            log.warning("completion for unknown transfer id %s on link %d ignored",
                        event.transfer_id, event.link,
                        extra=fields(rid, conn.control_address if conn else None))
            return
        self._landed(res)

    def _landed(self, res: Reservation) -> None:
        with res.lock:
            res.landed = True
            self.rt.faults.after_landing(res.request_id, self.rt.pools, res.indices)
            verified = NOT_VERIFIED_OFF
            if res.digests is not None and self.rt.settings.integrity:
                landed = request_digests(self.rt.pools, res.indices)
                bad = [b.name for b, want, got in
                       zip(self.rt.layout.flat_buffers, res.digests, landed, strict=True)
                       if want != got]
                if bad:
                    detail = (f"CRC32C mismatch in {len(bad)} buffer(s): "
                              f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
                    if self.table.fail(res.request_id, FailureReason.INTEGRITY, detail):
                        log.error("request %s failed: integrity: %s", res.request_id, detail,
                                  extra=fields(res.request_id, res.prefill_address))
                        self._free(res.request_id, "integrity failure")
                        self._tell_prefill(res, f"decode integrity check failed: {detail}")
                    return
                verified = f"{VERIFIED_PREFIX} {len(landed)} buffers match prefill's digests"
            elif res.digests is None and self.rt.settings.integrity:
                verified = NOT_VERIFIED_NO_DIGESTS
                log.warning("request %s: prefill sent no digests (its integrity check is off): "
                            "arrival proven by the completion, bytes not verified",
                            res.request_id, extra=fields(res.request_id, res.prefill_address))
            try:
                self.table.advance(res.request_id, TransferState.SUCCESS, detail=verified,
                                   nbytes=res.nbytes)
            except Exception as exc:  # already failed (aborted, timed out): nothing to do
                log.info("request %s landed after it ended: %s", res.request_id, exc,
                         extra=fields(res.request_id, res.prefill_address))
                return
            res.success_at = time.monotonic()
        log.info("request %s: Success (%d bytes landed in slot %d; %s)", res.request_id,
                 res.nbytes, res.slot, verified, extra=fields(res.request_id, res.prefill_address))

    def on_expired(self, status: TransferStatus) -> None:
        """A deadline passed: make sure prefill stops, then free the slot."""
        self._stop_prefill_then_free(status.request_id, f"decode timed out: {status.detail}")

    def periodic(self) -> None:
        """Free Success slots whose hand-off lease expired without a Release."""
        lease = self.rt.settings.handoff_lease_s
        now = time.monotonic()
        with self._lock:
            stale = [(r.request_id, r.prefill_address) for r in self._res.values()
                     if r.success_at is not None and now - r.success_at > lease]
        for rid, peer in stale:
            log.warning("request %s: no Release within the %.0f s hand-off lease; slot freed",
                        rid, lease, extra=fields(rid, peer))
            self._free(rid, "hand-off lease expired")

    def peer_lost(self, conn: PeerConn, detail: str, *, gone: bool = True) -> None:
        """Close the link first (no more writes can land), then fail and free its requests.

        ``gone`` False means only the link died (its QP failed, or the same prefill
        instance handshook again): requests it began writing fail, but reservations it
        has not touched yet stay, since the next handshake serves them. Failing those
        too would fail the very request whose Send triggered the new handshake.
        """
        self.rt.peers.remove(conn)
        if gone:
            self.peers.remove(conn.instance_id)
        conn.close()
        with self._lock:
            mine = [r for r in self._res.values()
                    if r.peer_instance == conn.instance_id
                    or (gone and not r.peer_instance
                        and r.prefill_address == conn.control_address)]
        for res in mine:
            if self.table.fail(res.request_id, FailureReason.PEER_FAILED, detail):
                log.warning("request %s failed: %s", res.request_id, detail,
                            extra=fields(res.request_id, res.prefill_address))
            snap = self.table.get(res.request_id)
            if snap is not None and snap.state is TransferState.FAILED:
                self._free(res.request_id, "peer lost")

    def shutdown(self) -> None:
        """Fail every live request (reason shutdown) and tell prefill, briefly."""
        for snap in self.table.live():
            if self.table.fail(snap.request_id, FailureReason.SHUTDOWN, "decode shutting down"):
                with self._lock:
                    res = self._res.get(snap.request_id)
                if res is not None:
                    self._tell_prefill(res, "decode shutting down", timeout=1.0)
        for conn in self.rt.peers.all():
            self.rt.peers.remove(conn)
            conn.close()
        with self._lock:
            rids = list(self._res)
        for rid in rids:
            self._free(rid, "shutdown")

    # ---- helpers ---------------------------------------------------------------------
    def slot_of(self, request_id: str) -> int:
        with self._lock:
            res = self._res.get(request_id)
        return res.slot if res else -1

    def bytes_of(self, request_id: str) -> tuple[int, int]:
        with self._lock:
            res = self._res.get(request_id)
        if res is None:
            return (0, 0)
        return (res.nbytes if res.landed else 0, res.nbytes)

    def _reservation(self, rid: str) -> Reservation:
        with self._lock:
            res = self._res.get(rid)
        if res is None:
            raise UnknownRequest(f"no reservation for request {rid!r} on this decode daemon")
        return res

    def _free(self, rid: str, why: str) -> None:
        with self._lock:
            res = self._res.pop(rid, None)
            if res is not None:
                self._by_transfer.pop(res.transfer_id, None)
        if res is not None and self.slots.release(rid) is not None:
            log.info("request %s: slot %d freed (%s)", rid, res.slot, why,
                     extra=fields(rid, res.prefill_address))

    def _stop_prefill_then_free(self, rid: str, detail: str) -> None:
        with self._lock:
            res = self._res.get(rid)
        if res is None:
            return
        if not res.peer_instance:  # prefill never got the indices: it cannot write
            self._free(rid, detail)
            threading.Thread(target=self._tell_prefill, args=(res, detail), daemon=True).start()
            return
        threading.Thread(target=self._drain_then_free, args=(res, detail), daemon=True).start()

    def _drain_then_free(self, res: Reservation, detail: str) -> None:
        if not self._tell_prefill(res, detail):
            conn = self.rt.peers.get(res.peer_instance)
            if conn is not None:
                self.peer_lost(conn, f"prefill did not confirm the abort of {res.request_id}")
        self._free(res.request_id, detail)

    def _tell_prefill(self, res: Reservation, detail: str, timeout: float | None = None) -> bool:
        """Abort the request on prefill (it drains first); True when prefill confirmed."""
        conn = (self.rt.peers.get(res.peer_instance) if res.peer_instance
                else self.rt.peers.by_address(res.prefill_address))
        if conn is None or conn.closed:
            return False
        try:
            conn.client().stub.Abort(
                pb.AbortRequest(request_id=res.request_id, detail=detail, from_peer=True,
                                instance_id=self.local.instance_id),
                timeout=timeout or self.rt.settings.rpc_timeout_s)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.NOT_FOUND:
                return True  # prefill never heard of it: nothing of it is in flight
            log.warning("telling prefill %s to abort %s failed: %s", conn.control_address,
                        res.request_id, exc.details(),
                        extra=fields(res.request_id, conn.control_address))
            return False
        return True
