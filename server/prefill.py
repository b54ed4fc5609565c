"""The prefill daemon: handshakes with decode once per pair, plans and writes each request.

Send queues a chunk of a request; a worker handshakes with the decode daemon if
needed (Bootstrapping), asks decode where to write with BeginWrite
(WaitingForInput -> Transferring), plans against decode's indices and posts the
writes; the final chunk carries the states and the completion notification. A
request is Success once every write completed. A request never ends (Success or
Failed) while a write that reads its source may still be in flight: failures
wait for the link to drain, or release the link, before they are reported.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
import numpy.typing as npt

from kvbeam.errors import (
    BadRequest,
    DuplicateRequest,
    HandshakeRejectedError,
    KvbeamError,
    PeerError,
    PlanError,
    PoolCompatibilityError,
    ProtocolError,
    ProtocolVersionError,
    RegionError,
    RoleConflictError,
    TransportError,
)
from kvbeam.logs import fields
from kvbeam.pools.digest import request_digests
from kvbeam.pools.indices import request_indices
from kvbeam.pools.plan import build_plan
from kvbeam.pools.types import IndexKind
from kvbeam.proto.fields import host_port
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.transfer_codec import indices_from_proto
from kvbeam.rpc_errors import handled, peer_error
from kvbeam.server.daemon_servicer import DaemonServicer
from kvbeam.server.faults import outside_peer_mr
from kvbeam.server.peer_client import ControlClient
from kvbeam.server.peers import PeerConn, peer_buffer_addrs
from kvbeam.server.runtime import Runtime
from kvbeam.server.validation import request_id_of, seq_len_of
from kvbeam.states import FailureReason, TransferState, TransferStatus
from kvbeam.transport.base import Event, EventKind

log = logging.getLogger(__name__)
IndexLists = dict[IndexKind, npt.NDArray[np.int64]]


@dataclass
class Outgoing:
    """Prefill's books for one request."""

    request_id: str
    src_slot: int
    seq_len: int
    decode_address: str
    src_indices: IndexLists
    conn: PeerConn | None = None
    transfer_id: int | None = None
    sent_pages: npt.NDArray[np.bool_] | None = None
    final_submitted: bool = False
    final_posted: bool = False
    outstanding: int = 0
    bytes_total: int = 0
    bytes_done: int = 0
    pending_bytes: list[int] = field(default_factory=list)
    told_decode: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)


class SendFailed(KvbeamError):
    """A send step failed; ``reason`` is the lifecycle failure reason to report."""

    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _reason_for(exc: BaseException) -> FailureReason:
    if isinstance(exc, SendFailed):
        return exc.reason
    if isinstance(exc, PoolCompatibilityError | ProtocolVersionError | RoleConflictError
                  | HandshakeRejectedError):
        return FailureReason.INCOMPATIBLE
    if isinstance(exc, PeerError):
        return FailureReason.PEER_UNREACHABLE
    if isinstance(exc, PlanError | ProtocolError | BadRequest):
        return FailureReason.INVALID_REQUEST
    return FailureReason.TRANSPORT_ERROR


class PrefillServicer(DaemonServicer):
    """Send, Abort and the completion of writes."""

    def __init__(self, runtime: Runtime, workers: int = 8) -> None:
        super().__init__(runtime)
        self._out: dict[str, Outgoing] = {}
        self._writes: dict[tuple[int, int], str] = {}
        self._lock = threading.Lock()
        self._connect_locks: dict[str, threading.Lock] = {}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvbeam-send")

    # ---- RPCs ----------------------------------------------------------------------
    @handled
    def Send(self, request: pb.SendRequest, context: grpc.ServicerContext) -> pb.TransferStatus:
        """Queue (a chunk of) a request for decode; returns at once (poll Status)."""
        rid = request_id_of(request.request_id)
        spec = self.rt.config.target
        seq_len = seq_len_of(request.seq_len, spec.max_context_len)
        host_port(request.decode_address, "decode_address")
        ranges = [(r.start, r.end) for r in request.chunks]
        for start, end in ranges:
            if not 0 <= start < end <= seq_len:
                raise BadRequest(f"chunk [{start}, {end}) is not inside [0, {seq_len})")
        if not request.final_chunk and not ranges:
            raise BadRequest("a non-final chunk must name its token ranges (chunks)")
        with self._lock:
            out = self._out.get(rid)
            if out is None:
                indices = request_indices(spec, request.source_slot, seq_len)
                self.table.create(rid, request.decode_address)
                out = Outgoing(rid, request.source_slot, seq_len, request.decode_address,
                               indices)
                out.sent_pages = np.zeros(len(indices[IndexKind.KV_PAGES]), dtype=np.bool_)
                self._out[rid] = out
            else:
                snap = self.table.get(rid)
                if out.final_submitted or snap is None or snap.state.terminal:
                    raise DuplicateRequest(f"request id {rid!r}: its final chunk was already "
                                           "sent or it ended; request ids are unique")
                if (out.src_slot, out.seq_len, out.decode_address) != (
                        request.source_slot, seq_len, request.decode_address):
                    raise BadRequest(f"request {rid}: a further chunk must keep the source "
                                     "slot, seq_len and decode address of the first")
            out.final_submitted = request.final_chunk
        self._pool.submit(self._run_chunk, out, ranges, request.final_chunk)
        return self._status(self._require_status(rid))

    @handled
    def Abort(self, request: pb.AbortRequest,
              context: grpc.ServicerContext) -> pb.TransferStatus:
        """Fail the request, wait until none of its writes is in flight, tell decode."""
        rid = request_id_of(request.request_id)
        with self._lock:
            out = self._out.get(rid)
        if out is None:  # ended and pruned, or never seen
            return self._status(self._require_status(rid))
        reason = FailureReason.PEER_FAILED if request.from_peer else FailureReason.ABORTED
        detail = request.detail or ("aborted by decode" if request.from_peer else "aborted")
        if self.table.fail(rid, reason, detail):
            log.warning("request %s failed: %s: %s", rid, reason.value, detail,
                        extra=fields(rid, out.decode_address))
        elif request.from_peer:
            # Our Success means every write completed here; decode's verdict (e.g. an
            # integrity failure found after landing) is the one the scheduler acts on.
            log.error("request %s: decode reports a failure after this side ended: %s",
                      rid, detail, extra=fields(rid, out.decode_address))
        self._drain(out)
        if request.from_peer:
            out.told_decode = True  # decode asked: it knows
        else:
            self._tell_decode_async(out, f"aborted on prefill: {detail}")
        return self._status(self._require_status(rid))

    # ---- the send path -----------------------------------------------------------------
    def _run_chunk(self, out: Outgoing, ranges: list[tuple[int, int]], final: bool) -> None:
        with out.cond:
            snap = self.table.get(out.request_id)
            if snap is None or snap.state.terminal:
                return
            try:
                self._write_chunk(out, ranges, final)
            except Exception as exc:
                reason = _reason_for(exc)
                if reason is FailureReason.TRANSPORT_ERROR and not isinstance(
                        exc, TransportError | SendFailed):
                    log.exception("request %s: unexpected error", out.request_id,
                                  extra=fields(out.request_id, out.decode_address))
                self._fail(out, reason, str(exc))

    def _write_chunk(self, out: Outgoing, ranges: list[tuple[int, int]], final: bool) -> None:
        rid = out.request_id
        if out.conn is None or out.conn.closed:
            out.conn = self._connect(out.decode_address)
        conn = out.conn
        digests = (request_digests(self.rt.pools, out.src_indices)
                   if final and self.rt.settings.integrity else None)
        reply = self._begin_write(out, conn, final, digests)
        snap = self._require_status(rid)
        if snap.state is TransferState.BOOTSTRAPPING:
            self.table.advance(rid, TransferState.WAITING_FOR_INPUT)
            self.table.advance(rid, TransferState.TRANSFERRING)
        else:
            self.table.touch(rid)
        out.transfer_id = reply.transfer_id
        dst = indices_from_proto(reply.indices, "indices")
        src_sel, dst_sel = self._select_pages(out, dst, ranges, final)
        plan = build_plan(self.rt.layout, self.rt.pools.buffer_addrs(), src_sel,
                          conn.peer.layout, conn.addrs, dst_sel, include_states=final)
        with self._lock:
            self._writes[(conn.link.id, reply.transfer_id)] = rid
        out.outstanding += 1
        out.pending_bytes.append(plan.total_bytes)
        out.bytes_total += plan.total_bytes
        blocks = plan.blocks
        if self.rt.faults.writes_outside(rid):  # test-only hook, off unless armed
            blocks = outside_peer_mr(conn.link, conn.peer.endpoint, blocks)
        try:
            conn.link.write(reply.transfer_id, blocks, notify=final)
        except Exception as exc:
            out.outstanding -= 1
            out.pending_bytes.pop()
            if isinstance(exc, TransportError) and not isinstance(exc, RegionError):
                self.peer_lost(conn, f"link unusable: {exc}", gone=False)
            raise
        out.final_posted = final
        log.info("request %s: posted %s%d bytes in %d blocks to %s", rid,
                 "final chunk, " if final else "chunk, ", plan.total_bytes, plan.num_blocks,
                 conn.control_address, extra=fields(rid, out.decode_address))

    def _select_pages(self, out: Outgoing, dst: IndexLists, ranges: list[tuple[int, int]],
                      final: bool) -> tuple[IndexLists, IndexLists]:
        """This chunk's KV pages (not sent before); the states go with the final chunk."""
        assert out.sent_pages is not None
        page = self.rt.config.target.page_size
        want = np.zeros_like(out.sent_pages)
        if final:
            want[:] = True
        for start, end in ranges:
            want[start // page: -(-end // page)] = True
        want &= ~out.sent_pages
        out.sent_pages |= want
        if len(dst[IndexKind.KV_PAGES]) == len(want) and bool(want.all()):
            return out.src_indices, dst  # the usual single-chunk request: no mask copies
        src, dst_sel = dict(out.src_indices), dict(dst)
        src[IndexKind.KV_PAGES] = out.src_indices[IndexKind.KV_PAGES][want]
        if len(dst[IndexKind.KV_PAGES]) != len(want):
            raise SendFailed(FailureReason.INVALID_REQUEST,
                             f"decode reserved {len(dst[IndexKind.KV_PAGES])} KV pages, "
                             f"prefill has {len(want)}")
        dst_sel[IndexKind.KV_PAGES] = dst[IndexKind.KV_PAGES][want]
        return src, dst_sel

    def _begin_write(self, out: Outgoing, conn: PeerConn, final: bool,
                     digests: list[int] | None) -> pb.BeginWriteResponse:
        request = pb.BeginWriteRequest(
            request_id=out.request_id, instance_id=self.local.instance_id, seq_len=out.seq_len,
            final_chunk=final, has_digests=digests is not None, digests=digests or [])
        timeout = self.rt.settings.rpc_timeout_s
        try:
            return conn.client().stub.BeginWrite(request, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            details = exc.details() or ""
            if code is grpc.StatusCode.FAILED_PRECONDITION and "NotHandshaken" in details:
                # Decode restarted or dropped our link: that instance's reservation is gone.
                self.peer_lost(conn, f"decode no longer knows us: {details}")
                raise SendFailed(FailureReason.PEER_FAILED,
                                 f"decode at {conn.control_address} restarted or dropped the "
                                 f"connection: {details}") from None
            if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise SendFailed(FailureReason.INVALID_REQUEST,
                                 f"decode refused BeginWrite: {details}") from None
            if code is grpc.StatusCode.FAILED_PRECONDITION:
                raise SendFailed(FailureReason.PEER_FAILED,
                                 f"decode refused BeginWrite: {details}") from None
            raise peer_error(exc, address=conn.control_address, method="BeginWrite",
                             timeout=timeout) from None

    def _connect(self, address: str) -> PeerConn:
        """The verified connection to the decode daemon at ``address``; handshakes once."""
        with self._lock:
            lock = self._connect_locks.setdefault(address, threading.Lock())
        with lock:
            conn = self.rt.peers.by_address(address)
            if conn is not None and not conn.closed:
                return conn
            link = self.rt.transport.create_link()
            client = ControlClient(address, options=self.rt.options)
            try:
                with self.rt.metrics.handshake("client"):
                    verified = client.handshake(self.local, endpoint=link.endpoint)
                addrs = peer_buffer_addrs(verified.layout, verified)
                link.connect(verified.endpoint)
                conn = PeerConn(verified, link, self.rt.options, addrs)
            except Exception:
                link.release()
                client.close()
                raise
            client.close()
            self.rt.peers.add(conn)
            log.info("decode %s at %s verified and connected (%s)", verified.instance_id,
                     address, self.rt.transport.kind, extra=fields(peer=address))
            return conn

    # ---- completion, failure, drain --------------------------------------------------------
    def on_event(self, event: Event) -> None:
        """COMPLETED: one write finished; LINK_FAILED: the decode peer is gone."""
        if event.kind is EventKind.LINK_FAILED:
            conn = self.rt.peers.by_link(event.link)
            if conn is not None:
                self.peer_lost(conn, f"link failed: {event.status}: {event.detail}",
                               gone=False)
            return
        if event.kind is not EventKind.COMPLETED or event.transfer_id is None:
            return
        with self._lock:
            rid = self._writes.get((event.link, event.transfer_id))
            out = self._out.get(rid) if rid else None
        if out is None:
            log.warning("completion of unknown transfer %s on link %d ignored",
                        event.transfer_id, event.link, extra=fields(rid))
            return
        if not event.ok:
            # A failed write leaves the link unusable (an RC QP in error, a TCP stream
            # broken): drop the connection so the next request handshakes afresh.
            # Forget it at once (not in the thread): a request connecting meanwhile must
            # handshake a new link, not pick this dead one and fail too.
            conn = self.rt.peers.by_link(event.link)
            if conn is not None and self.rt.peers.remove(conn):
                threading.Thread(target=self.peer_lost, daemon=True,
                                 args=(conn, f"write failed: {event.status}"),
                                 kwargs={"gone": False}).start()
        with out.cond:
            out.outstanding -= 1
            done = out.pending_bytes.pop(0) if out.pending_bytes else 0
            if event.ok:
                out.bytes_done += done
            else:
                self._fail(out, FailureReason.TRANSPORT_ERROR,
                           f"write failed: {event.status}: {event.detail}")
            out.cond.notify_all()
            snap = self.table.get(out.request_id)
            if (event.ok and out.final_posted and out.outstanding == 0 and snap is not None
                    and snap.state is TransferState.TRANSFERRING):
                self.table.advance(out.request_id, TransferState.SUCCESS, nbytes=out.bytes_done)
                log.info("request %s: Success (%d bytes written)", out.request_id,
                         out.bytes_done, extra=fields(out.request_id, out.decode_address))
            elif snap is not None and snap.state is TransferState.FAILED and out.outstanding == 0:
                self._tell_decode_async(out, f"prefill failed: {snap.detail}")

    def _fail(self, out: Outgoing, reason: FailureReason, detail: str) -> None:
        """Fail a request; decode is told once none of its writes is in flight."""
        if self.table.fail(out.request_id, reason, detail):
            log.warning("request %s failed: %s: %s", out.request_id, reason.value, detail,
                        extra=fields(out.request_id, out.decode_address))
        if out.outstanding == 0:
            self._tell_decode_async(out, f"prefill failed: {reason.value}: {detail}")

    def _drain(self, out: Outgoing) -> None:
        """Wait until no write of the request is in flight; release the link if it hangs."""
        limit = self.rt.transport_timeout()
        with out.cond:
            if not out.cond.wait_for(lambda: out.outstanding <= 0, timeout=limit):
                conn = out.conn
                log.warning("request %s: %d write(s) still in flight after %.1f s: releasing "
                            "the link so none can read the source any longer", out.request_id,
                            out.outstanding, limit,
                            extra=fields(out.request_id, out.decode_address))
                if conn is not None:
                    self.peer_lost(conn, f"writes of {out.request_id} did not drain")
                out.outstanding = 0

    def _tell_decode_async(self, out: Outgoing, detail: str) -> None:
        if out.told_decode:
            return
        out.told_decode = True
        threading.Thread(target=self._tell_decode, args=(out, detail), daemon=True).start()

    def _tell_decode(self, out: Outgoing, detail: str, timeout: float | None = None) -> None:
        """Abort the request on decode so it fails now, not at its lease (best effort)."""
        request = pb.AbortRequest(request_id=out.request_id, detail=detail, from_peer=True,
                                  instance_id=self.local.instance_id)
        timeout = timeout or self.rt.settings.rpc_timeout_s
        conn = out.conn if out.conn is not None and not out.conn.closed else None
        try:
            if conn is not None:
                conn.client().stub.Abort(request, timeout=timeout)
            else:  # never connected: still tell decode, over a one-off channel
                with ControlClient(out.decode_address, options=self.rt.options) as client:
                    client.stub.Abort(request, timeout=timeout)
        except grpc.RpcError as exc:
            log.info("could not tell decode %s that %s failed: %s", out.decode_address,
                     out.request_id, exc.details(),
                     extra=fields(out.request_id, out.decode_address))

    def on_expired(self, status: TransferStatus) -> None:
        """A deadline passed: drain the request's writes, then tell decode."""
        with self._lock:
            out = self._out.get(status.request_id)
        if out is not None:
            threading.Thread(target=self._expire, args=(out, status.detail), daemon=True).start()

    def _expire(self, out: Outgoing, detail: str) -> None:
        self._drain(out)
        self._tell_decode_async(out, f"prefill timed out: {detail}")

    def peer_lost(self, conn: PeerConn, detail: str, *, gone: bool = True) -> None:
        """Release the link (its writes complete as failed), fail the peer's requests.

        ``gone`` False means only the link died (a QP error, a partitioned data path):
        decode is still there and learns of each failed request by Abort once its writes
        are drained, instead of waiting for its own deadline.
        """
        self.rt.peers.remove(conn)
        conn.close()
        with self._lock:
            mine = [o for o in self._out.values() if o.conn is conn]
        for out in mine:
            if self.table.fail(out.request_id, FailureReason.PEER_FAILED, detail):
                log.warning("request %s failed: %s", out.request_id, detail,
                            extra=fields(out.request_id, out.decode_address))
            if gone:
                out.told_decode = True  # the peer is gone; there is no one to tell
            elif out.outstanding == 0:
                # No lock: another sender may hold out.cond while it calls us. The failed
                # state is set above, so a completion that brings outstanding to 0 after
                # this read tells decode itself (on_event).
                self._tell_decode_async(out, f"prefill failed: {detail}")

    def shutdown(self) -> None:
        """Fail every live request (reason shutdown), tell decode briefly, release links."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for snap in self.table.live():
            if self.table.fail(snap.request_id, FailureReason.SHUTDOWN, "prefill shutting down"):
                with self._lock:
                    out = self._out.get(snap.request_id)
                if out is not None and not out.told_decode:
                    out.told_decode = True
                    self._tell_decode(out, "prefill shutting down", timeout=1.0)
        for conn in self.rt.peers.all():
            self.rt.peers.remove(conn)
            conn.close()

    def periodic(self) -> None:
        """Forget requests that ended with nothing in flight (the table keeps their status)."""
        with self._lock:
            for rid, out in list(self._out.items()):
                snap = self.table.get(rid)
                if out.outstanding == 0 and (snap is None or snap.state.terminal) and (
                        out.told_decode or snap is None
                        or snap.state is TransferState.SUCCESS):
                    del self._out[rid]
                    if out.conn is not None and out.transfer_id is not None:
                        self._writes.pop((out.conn.link.id, out.transfer_id), None)

    # ---- helpers -------------------------------------------------------------------------
    def slot_of(self, request_id: str) -> int:
        with self._lock:
            out = self._out.get(request_id)
        return out.src_slot if out else -1

    def bytes_of(self, request_id: str) -> tuple[int, int]:
        with self._lock:
            out = self._out.get(request_id)
        return (out.bytes_done, out.bytes_total) if out else (0, 0)
