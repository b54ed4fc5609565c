"""The cores' peer calls over gRPC: handshake, BeginWrite, Digests, Offer and Abort.

:class:`GrpcDecodePeers` (prefill's view of decode daemons) and
:class:`GrpcPrefillPeers` (decode's view of prefill daemons) implement the protocols
of :mod:`kvbeam.server.core.ports`, mapping gRPC statuses to the cores' errors. Every
call blocks; the cores make them on the driver's executor only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import grpc

from kvbeam.errors import AlreadyLanded, NotReserved, SendFailed, UnknownRequest
from kvbeam.logs import fields
from kvbeam.pools.digest import digests_to_wire
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.side import SideInfo
from kvbeam.proto.transfer_codec import (
    draft_indices_from_proto,
    indices_from_proto,
    indices_to_proto,
)
from kvbeam.rpc_errors import peer_error
from kvbeam.server.core.ports import Offered, WriteGrant
from kvbeam.server.metrics import DaemonMetrics
from kvbeam.server.peer_client import ControlClient
from kvbeam.server.peers import PeerConn, peer_buffer_addrs
from kvbeam.server.settings import ControlOptions
from kvbeam.states import FailureReason
from kvbeam.transport import Transport

log = logging.getLogger(__name__)

#: Longest a Reserve waits for its Offer to prefill, s. The Offer is an optimisation (a
#: Send without it asks BeginWrite), so a slow or partitioned prefill must not make
#: Reserve itself slow: a scheduler's own deadline on Reserve is a few seconds.
OFFER_TIMEOUT_S = 1.0
#: Trailing metadata of prefill's answer to Abort: the request's writes still in flight
#: (absent or 0: drained). Prefill tells decode by Abort once they drained.
WRITES_IN_FLIGHT_KEY = "kvbeam-writes-in-flight"


def writes_in_flight(metadata: Iterable[tuple[str, str | bytes]] | None) -> int:
    """The count :data:`WRITES_IN_FLIGHT_KEY` carries in trailing metadata (0 if none)."""
    for key, value in metadata or ():
        if key == WRITES_IN_FLIGHT_KEY:
            try:
                return max(0, int(value))
            except (TypeError, ValueError):
                return 1  # unreadable: not a confirmation
    return 0


class Dialer:
    """Opens control channels with the daemon's options (a :data:`~kvbeam.server.peers.Dial`)."""

    def __init__(self, options: ControlOptions) -> None:
        self.options = options

    def __call__(self, address: str) -> ControlClient:
        return ControlClient(address, options=self.options)


def _abort(client: ControlClient, request: pb.AbortRequest, timeout: float,
           address: str) -> bool:
    """Abort on a peer; True when it confirmed none of the request's writes is in flight."""
    try:
        _reply, call = client.stub.Abort.with_call(request, timeout=timeout)
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.NOT_FOUND:
            return True  # the peer never heard of it: nothing of it is in flight
        log.info("could not tell %s that %s failed: %s", address, request.request_id,
                 exc.details(), extra=fields(request.request_id, address))
        return False
    except ValueError as exc:
        # The channel was closed between taking it and the call (its link failed
        # meanwhile): the caller says it again on a one-off channel.
        log.info("could not tell %s that %s failed: %s", address, request.request_id, exc,
                 extra=fields(request.request_id, address))
        return False
    left = writes_in_flight(call.trailing_metadata())
    if left:
        log.info("%s: %d write(s) of %s still in flight when it answered the Abort; it says "
                 "so once they drained", address, left, request.request_id,
                 extra=fields(request.request_id, address))
    return not left


def _await_aborts(pending: Sequence[grpc.Future[pb.TransferStatus]], total: int,
                  timeout: float, peer: str) -> int:
    """Wait for Aborts started at once (each bounded by its own deadline); how many the
    peer confirmed (answered with nothing in flight, or never heard of the request)."""
    confirmed = unanswered = 0
    for future in pending:
        try:
            future.result()
            # A call's future is its Call too: the answer's trailing metadata.
            metadata = future.trailing_metadata()  # type: ignore[attr-defined]
            confirmed += not writes_in_flight(metadata)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.NOT_FOUND:
                confirmed += 1
            else:
                unanswered += 1
    if unanswered or len(pending) < total:
        log.info("%d of %d Abort(s) to %s not answered within %.1f s", total - confirmed,
                 total, peer, timeout)
    return confirmed


class GrpcDecodePeers:
    """Prefill's calls to decode daemons."""

    def __init__(self, local: Callable[[], SideInfo], transport: Transport, dial: Dialer,
                 metrics: DaemonMetrics) -> None:
        self._local = local
        self.transport = transport
        self.dial = dial
        self.metrics = metrics

    @property
    def local(self) -> SideInfo:
        """Our side as the servicer sends it."""
        return self._local()

    @property
    def rpc_timeout_s(self) -> float:
        """The deadline of every call."""
        return self.dial.options.rpc_timeout_s

    def connect(self, address: str) -> PeerConn:
        """Handshake with the decode daemon at ``address``; connect a new link to it."""
        link = self.transport.create_link()
        client = self.dial(address)
        try:
            with self.metrics.handshake("client"):
                verified = client.handshake(self.local, endpoint=link.endpoint)
            addrs = peer_buffer_addrs(verified.layout, verified)
            link.connect(verified.endpoint)
        except Exception:
            link.release()
            client.close()
            raise
        client.close()
        log.info("decode %s at %s verified and connected (%s)", verified.instance_id,
                 address, self.transport.kind, extra=fields(peer=address))
        return PeerConn(verified, link, self.dial, addrs)

    def begin_write(self, conn: PeerConn, request_id: str, seq_len: int, final: bool,
                    digests_follow: bool) -> WriteGrant:
        """BeginWrite on decode; refusals become :class:`SendFailed` with their reason.

        Raises :class:`AlreadyLanded` when a resend finds the request landed on decode.
        """
        request = pb.BeginWriteRequest(
            request_id=request_id, instance_id=self.local.instance_id, seq_len=seq_len,
            final_chunk=final, digests_follow=digests_follow)
        self.metrics.begin_writes.inc()
        timeout = self.rpc_timeout_s
        try:
            reply = conn.client().stub.BeginWrite(request, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            details = exc.details() or ""
            if code is grpc.StatusCode.FAILED_PRECONDITION and "NotHandshaken" in details:
                # Decode restarted or dropped our link: that instance's reservation is gone.
                raise SendFailed(FailureReason.PEER_FAILED,
                                 f"decode at {conn.control_address} restarted or dropped the "
                                 f"connection: {details}", peer_lost=True) from None
            if code is grpc.StatusCode.FAILED_PRECONDITION and details.startswith(
                    AlreadyLanded.__name__):
                raise AlreadyLanded(details) from None  # a resend found it landed
            if code is grpc.StatusCode.NOT_FOUND and details.startswith(
                    UnknownRequest.__name__):
                raise NotReserved(FailureReason.INVALID_REQUEST,
                                  f"decode refused BeginWrite: {details}") from None
            if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise SendFailed(FailureReason.INVALID_REQUEST,
                                 f"decode refused BeginWrite: {details}") from None
            if code is grpc.StatusCode.FAILED_PRECONDITION:
                raise SendFailed(FailureReason.PEER_FAILED,
                                 f"decode refused BeginWrite: {details}") from None
            raise peer_error(exc, address=conn.control_address, method="BeginWrite",
                             timeout=timeout) from None
        return WriteGrant(reply.transfer_id, indices_from_proto(reply.indices, "indices"),
                          draft_indices_from_proto(reply.indices, "indices"),
                          kv_skip=reply.kv_skip)

    def send_digests(self, conn: PeerConn, request_id: str, transfer_id: int,
                     digests: list[int]) -> None:
        """Digests on decode (after the final writes were posted); errors as PeerError."""
        request = pb.DigestsRequest(request_id=request_id, instance_id=self.local.instance_id,
                                    transfer_id=transfer_id,
                                    digests=digests_to_wire(digests))
        timeout = self.rpc_timeout_s
        try:
            conn.client().stub.Digests(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise peer_error(exc, address=conn.control_address, method="Digests",
                             timeout=timeout) from None

    def abort(self, conn: PeerConn | None, address: str, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        """Abort the request on decode so it fails now, not at its lease (best effort)."""
        request = pb.AbortRequest(request_id=request_id, detail=detail, from_peer=True,
                                  instance_id=self.local.instance_id)
        timeout = timeout or self.rpc_timeout_s
        if conn is not None and not conn.closed:
            confirmed = _abort(conn.client(), request, timeout, address)
            if confirmed or not conn.closed:
                return confirmed
            # The connection closed under the call (its link failed meanwhile, which
            # now keeps decode's reservation): say it again on a one-off channel.
        with self.dial(address) as client:  # never connected: a one-off channel
            return _abort(client, request, timeout, address)

    def abort_all(self, calls: Sequence[tuple[PeerConn | None, str, str]], detail: str,
                  timeout: float) -> int:
        """Abort many requests on decode at once (gRPC futures, no thread each), all
        within ``timeout``; returns how many decode confirmed."""
        one_off: dict[str, ControlClient] = {}  # one channel per address never connected
        pending = []
        try:
            for conn, address, request_id in calls:
                request = pb.AbortRequest(request_id=request_id, detail=detail,
                                          from_peer=True, instance_id=self.local.instance_id)
                if conn is not None and not conn.closed:
                    client = conn.client()
                else:
                    client = one_off.get(address) or one_off.setdefault(address,
                                                                        self.dial(address))
                try:
                    pending.append(client.stub.Abort.future(request, timeout=timeout))
                except (grpc.RpcError, ValueError) as exc:  # a channel closed meanwhile
                    log.info("could not tell %s that %s failed: %s", address, request_id, exc,
                             extra=fields(request_id, address))
            return _await_aborts(pending, len(calls), timeout, "decode")
        finally:
            for client in one_off.values():
                client.close()


class GrpcPrefillPeers:
    """Decode's calls to prefill daemons."""

    def __init__(self, local: Callable[[], SideInfo], options: ControlOptions) -> None:
        self._local = local
        self.options = options

    @property
    def local(self) -> SideInfo:
        """Our side as the servicer sends it."""
        return self._local()

    def offer(self, conn: PeerConn, request_id: str, seq_len: int, grant: WriteGrant,
              slot: int, lease_s: float) -> Offered:
        """Offer on prefill: the reservation ahead of Send (never raises; see ports)."""
        request = pb.OfferRequest(
            request_id=request_id, instance_id=self.local.instance_id, seq_len=seq_len,
            transfer_id=grant.transfer_id, slot=slot,
            indices=indices_to_proto(grant.indices, grant.draft),
            lease_ms=max(1, int(lease_s * 1000)), kv_skip=grant.kv_skip)
        try:
            reply = conn.client().stub.Offer(
                request, timeout=min(self.options.rpc_timeout_s, OFFER_TIMEOUT_S))
        except grpc.RpcError as exc:
            # A status is prefill's refusal (it will ask BeginWrite); no answer may be a
            # kept offer whose reply was lost.
            sure = exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND,
                                  grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.FAILED_PRECONDITION)
            log.info("offer of %s to %s not made: %s: %s", request_id, conn.control_address,
                     exc.code().name, exc.details(),
                     extra=fields(request_id, conn.control_address))
            return Offered.REFUSED if sure else Offered.UNKNOWN
        if not reply.accepted:
            return Offered.REFUSED
        return Offered.DIGESTS_FOLLOW if reply.digests_follow else Offered.NO_DIGESTS

    def abort(self, conn: PeerConn, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        """Abort the request on prefill (it drains first); True when prefill confirmed."""
        request = pb.AbortRequest(request_id=request_id, detail=detail, from_peer=True,
                                  instance_id=self.local.instance_id)
        return _abort(conn.client(), request, timeout or self.options.rpc_timeout_s,
                      conn.control_address)

    def abort_all(self, calls: Sequence[tuple[PeerConn, str]], detail: str,
                  timeout: float) -> int:
        """Abort many requests on their prefills at once: every call is started before
        any answer is awaited (gRPC futures, no thread each), so all end within
        ``timeout``; returns how many prefill confirmed."""
        pending = []
        for conn, request_id in calls:
            request = pb.AbortRequest(request_id=request_id, detail=detail, from_peer=True,
                                      instance_id=self.local.instance_id)
            try:
                pending.append(conn.client().stub.Abort.future(request, timeout=timeout))
            except (grpc.RpcError, ValueError) as exc:  # a channel closed meanwhile
                log.info("could not tell %s that %s failed: %s", conn.control_address,
                         request_id, exc, extra=fields(request_id, conn.control_address))
        return _await_aborts(pending, len(calls), timeout, "prefill")
