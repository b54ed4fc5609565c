"""The cores' peer calls: the handshake over gRPC, then BeginWrite, Offer and
Abort over the pair's peer channel (:mod:`kvbeam.server.peer_channel`).

:class:`GrpcDecodePeers` (prefill's view of decode daemons) and
:class:`GrpcPrefillPeers` (decode's view of prefill daemons) implement the protocols
of :mod:`kvbeam.server.core.ports`, mapping statuses to the cores' errors. A request on
the channel is the RPC's own message and its answer carries the RPC's status, so one
mapping serves both; the Offer is one-way (protocol 8: prefill answers only what decode
must act on, in an OFFER_ANSWER). BeginWrite and Offer go over the channel only (the
daemons serve no such RPC): a handshake whose decode names no channel, or whose channel
cannot be opened, fails; a connection whose channel closed (a BYE: the link was
replaced) sends nothing (prefill's core handshakes again, decode makes no offer). Only
the daemons' own Abort still falls back to the RPC (the scheduler's Abort method), since
an abort must reach its peer. Every call blocks; the cores make them on the driver's
executor only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc

from kvbeam.errors import (
    AlreadyLanded,
    DialRefused,
    NoEngineAttached,
    NotReserved,
    PeerChannelError,
    PeerUnavailableError,
    SendFailed,
    UnknownRequest,
)
from kvbeam.logs import fields
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.side import SideInfo
from kvbeam.proto.transfer_codec import (
    grant_indices_from_proto,
    indices_to_proto,
)
from kvbeam.proto.version import PROTOCOL_VERSION
from kvbeam.rpc_errors import peer_error
from kvbeam.server.core.ports import Offered, WriteGrant
from kvbeam.server.handshake import VerifiedPeer
from kvbeam.server.metrics import DaemonMetrics
from kvbeam.server.peer_channel import (
    ABORT,
    BEGIN_WRITE,
    CHANNEL_ADDRESS_KEY,
    CHANNEL_TOKEN_KEY,
    OFFER,
    STATUS_CODES,
    Hello,
    PeerChannels,
    Reply,
    notice,
)
from kvbeam.server.peer_client import ControlClient
from kvbeam.server.peers import PeerConn, peer_buffer_addrs
from kvbeam.server.settings import ControlOptions
from kvbeam.states import FailureReason
from kvbeam.transport import Transport

log = logging.getLogger(__name__)

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


#: A Connect's deadline in RPC deadlines: prefill's handshake with us and the opening of
#: its peer channel (each bounded by one), and the answer.
CONNECT_DEADLINE_RPCS = 3
#: The most of a refusal's text a Connect's answer carries (a status's details).
MAX_CONNECT_DETAIL = 4000


def connect_refusal(exc: grpc.RpcError, address: str, timeout: float) -> DialRefused:
    """The :class:`DialRefused` for prefill's failed answer to Connect."""
    code = exc.code()
    details = exc.details() or ""
    where = f"prefill daemon at {address}"
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        if details.startswith(NoEngineAttached.__name__):
            return DialRefused(FailureReason.PEER_FAILED, f"{where}: {details}")
        # Its handshake with us was refused: the text names every difference.
        return DialRefused(FailureReason.INCOMPATIBLE, f"{where} could not pair with this "
                                                       f"decode: {details}")
    if code is grpc.StatusCode.UNAVAILABLE and details.startswith("Peer"):
        # Prefill answered, but could not reach us (its handshake's error).
        return DialRefused(FailureReason.PEER_UNREACHABLE,
                           f"{where} could not reach this decode: {details}")
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return DialRefused(FailureReason.PEER_UNREACHABLE, f"{where} refused to dial this "
                                                           f"decode: {details}")
    if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return DialRefused(FailureReason.PEER_UNREACHABLE, f"{where} cannot connect now "
                           f"({code.name}: {details})", retry=True)
    err = peer_error(exc, address=address, method="Connect", timeout=timeout)
    return DialRefused(FailureReason.PEER_UNREACHABLE, str(err))


class Dialer:
    """Opens control channels with the daemon's options (a :data:`~kvbeam.server.peers.Dial`)."""

    def __init__(self, options: ControlOptions) -> None:
        self.options = options

    def __call__(self, address: str) -> ControlClient:
        return ControlClient(address, options=self.options)


def _channel_of(conn: PeerConn) -> Any:
    """The connection's live peer channel, or None."""
    channel = conn.channel
    return channel if channel is not None and not channel.closed else None


def no_channel(conn: PeerConn, role: str) -> str:
    """Why ``conn`` has no open peer channel (for a refusal's details), "" when it has."""
    channel = conn.channel
    if channel is None:
        return (f"no peer channel to {role} {conn.instance_id} at {conn.control_address}: "
                "the connection never opened one")
    if channel.closed:
        return (f"no peer channel to {role} {conn.instance_id} at {conn.control_address}: "
                f"it closed ({channel.close_reason or 'no reason given'}); the next "
                "handshake opens a new one")
    return ""


def _require_channel(conn: PeerConn, method: str) -> Any:
    """Decode's open peer channel on ``conn``, for ``method`` (BeginWrite).

    Raises:
        PeerUnavailableError: none is open; the message names the peer and why (no RPC
            is tried: the daemons serve BeginWrite on the channel only).
    """
    channel = _channel_of(conn)
    if channel is None:
        raise PeerUnavailableError(f"{method} to {conn.control_address}: "
                                   f"{no_channel(conn, 'decode')}",
                                   address=conn.control_address, code="UNAVAILABLE")
    return channel


def _rpc_client(conn: PeerConn | None, client: ControlClient | None) -> ControlClient:
    """Where an Abort goes without a channel: ``client`` (a one-off), else the
    connection's own control channel."""
    if client is not None:
        return client
    assert conn is not None, "an Abort needs a connection or a one-off client"
    own: ControlClient = conn.client()
    return own


def offer_answer(reply: pb.OfferResponse, address: str) -> Offered:
    """What prefill's OFFER_ANSWER says (protocol 8; never raises): a status is its
    refusal (sure, as the statuses a check gives; else it may have been kept), else
    whether it kept the offer and writes digests."""
    rid = reply.request_id
    if reply.code:
        code = STATUS_CODES.get(reply.code, grpc.StatusCode.UNKNOWN)
        sure = code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.FAILED_PRECONDITION,
                        grpc.StatusCode.PERMISSION_DENIED)
        log.info("offer of %s to %s not made: %s: %s", rid, address, code.name, reply.detail,
                 extra=fields(rid, address))
        return Offered.REFUSED if sure else Offered.UNKNOWN
    if not reply.accepted:
        return Offered.REFUSED
    return Offered.DIGESTS_FOLLOW if reply.digests_follow else Offered.NO_DIGESTS


def _abort(request: pb.AbortRequest, timeout: float, address: str, *,
           conn: PeerConn | None = None, client: ControlClient | None = None) -> bool:
    """Abort on a peer (over ``conn``'s open channel, else the RPC on ``client`` or the
    connection's); True when it confirmed none of the request's writes is in flight.

    A channel that closed before or under the call (a BYE: the peer released that
    link; the connection stays ours) sends the Abort over the RPC instead. This is the
    one daemon-to-daemon call that keeps an RPC fallback, on purpose: ``Abort`` is a
    scheduler API method every daemon serves anyway, an Abort is idempotent, and an
    abort must never be lost (the peer would hold the request's slot, or keep writing
    into it, until a deadline); BeginWrite and Offer have no fallback."""
    channel = _channel_of(conn) if conn is not None else None
    try:
        left = _channel_abort(channel, request, timeout) if channel is not None else None
        if left is None:
            _reply, call = _rpc_client(conn, client).stub.Abort.with_call(
                request, timeout=timeout)
            left = writes_in_flight(call.trailing_metadata())
    except (grpc.RpcError, PeerChannelError) as exc:
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
    if left:
        log.info("%s: %d write(s) of %s still in flight when it answered the Abort; it says "
                 "so once they drained", address, left, request.request_id,
                 extra=fields(request.request_id, address))
    return not left


def _channel_abort(channel: Any, request: pb.AbortRequest, timeout: float) -> int | None:
    """An Abort over the channel: the writes in flight it answered, None when the
    channel closed before answering (the caller says it over the RPC)."""
    try:
        return int(channel.call(ABORT, request.SerializeToString(), timeout).in_flight)
    except PeerChannelError:
        if channel.closed:
            return None
        raise


def _start_abort(request: pb.AbortRequest, timeout: float, *, conn: PeerConn | None = None,
                 client: ControlClient | None = None) -> Any:
    """Start one Abort without waiting: a channel call's future, or the RPC's (on
    ``client`` or the connection's, as :func:`_abort` chooses)."""
    channel = _channel_of(conn) if conn is not None else None
    if channel is not None:
        return channel.start_call(ABORT, request.SerializeToString(), timeout)
    return _rpc_client(conn, client).stub.Abort.future(request, timeout=timeout)


def _await_aborts(pending: Sequence[Any], total: int, timeout: float, peer: str) -> int:
    """Wait for Aborts started at once (each bounded by its own deadline); how many the
    peer confirmed (answered with nothing in flight, or never heard of the request)."""
    confirmed = unanswered = 0
    for future in pending:
        try:
            result = future.result()
            if isinstance(result, Reply):
                confirmed += not result.in_flight
            else:
                # A call's future is its Call too: the answer's trailing metadata.
                confirmed += not writes_in_flight(future.trailing_metadata())
        except (grpc.RpcError, PeerChannelError) as exc:
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
                 metrics: DaemonMetrics, channels: PeerChannels | None = None) -> None:
        self._local = local
        self.transport = transport
        self.dial = dial
        self.metrics = metrics
        self.channels = channels

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
            channel = self._open_channel(verified, address)
        except Exception:
            link.release()
            client.close()
            raise
        client.close()
        conn = PeerConn(verified, link, self.dial, addrs)
        conn.channel, channel.bound = channel, conn
        log.info("decode %s at %s verified and connected (%s, peer channel)",
                 verified.instance_id, address, self.transport.kind,
                 extra=fields(peer=address))
        return conn

    def _open_channel(self, verified: VerifiedPeer, address: str) -> Any:
        """Open the pair's peer channel where decode's handshake reply says.

        The pair never runs without one: BeginWrite goes over it only.

        Raises:
            PeerUnavailableError: decode named no channel (not a protocol 4 daemon's
                reply), or named one we could not open (the message names its address).
        """
        extra = verified.endpoint.extra
        where, token = extra.get(CHANNEL_ADDRESS_KEY, ""), extra.get(CHANNEL_TOKEN_KEY, "")
        peer = f"decode {verified.instance_id} at {address}"
        if self.channels is None or not where:
            raise PeerUnavailableError(
                f"handshake with {peer} succeeded, but "
                + ("its reply names no peer channel (every kvbeam protocol 4 decode daemon "
                   "names one): BeginWrite goes over it only"
                   if not where else "this side has no peer channels to open it with"),
                address=address)
        hello = Hello(PROTOCOL_VERSION, self.local.instance_id, verified.instance_id, token)
        try:
            return self.channels.connect(where, hello, peer, self.rpc_timeout_s)
        except (OSError, ValueError) as exc:
            raise PeerUnavailableError(
                f"handshake with {peer} succeeded, but its peer channel at {where} could "
                f"not be opened: {exc}", address=address) from None

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
        channel = _require_channel(conn, "BeginWrite")
        try:
            reply = pb.BeginWriteResponse.FromString(channel.call(
                BEGIN_WRITE, request.SerializeToString(), timeout).payload)
        except PeerChannelError as exc:
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
        target, draft = grant_indices_from_proto(reply.indices, "indices")
        return WriteGrant(reply.transfer_id, target, draft, kv_skip=reply.kv_skip,
                          mailbox_slot=reply.mailbox_slot)

    def abort(self, conn: PeerConn | None, address: str, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        """Abort the request on decode so it fails now, not at its lease (best effort)."""
        request = pb.AbortRequest(request_id=request_id, detail=detail, from_peer=True,
                                  instance_id=self.local.instance_id)
        timeout = timeout or self.rpc_timeout_s
        if conn is not None and not conn.closed:
            confirmed = _abort(request, timeout, address, conn=conn)
            if confirmed or not conn.closed:
                return confirmed
            # The connection closed under the call (its link failed meanwhile, which
            # now keeps decode's reservation): say it again on a one-off channel.
        with self.dial(address) as client:  # never connected: a one-off channel
            return _abort(request, timeout, address, client=client)

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
                live = conn is not None and not conn.closed
                try:
                    if live:
                        pending.append(_start_abort(request, timeout, conn=conn))
                    else:
                        client = one_off.get(address) or one_off.setdefault(
                            address, self.dial(address))
                        pending.append(_start_abort(request, timeout, client=client))
                except (grpc.RpcError, PeerChannelError, ValueError) as exc:  # closed meanwhile
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
              slot: int, lease_s: float) -> bool:
        """Offer on prefill: the reservation ahead of Send, one frame, no answer awaited
        (never raises; see ports). True when it was sent: prefill keeps it without a
        word, or says otherwise in an OFFER_ANSWER (protocol 8).

        Without an open peer channel no offer is made (False: the Send asks with
        BeginWrite), as for a peer that misses heartbeats."""
        channel = _channel_of(conn)
        if channel is None:
            why = no_channel(conn, "prefill")
            log.debug("request %s not offered: %s", request_id, why,
                      extra=fields(request_id, conn.control_address))
            return False
        request = pb.OfferRequest(
            request_id=request_id, instance_id=self.local.instance_id, seq_len=seq_len,
            transfer_id=grant.transfer_id, slot=slot,
            indices=indices_to_proto(grant.indices, grant.draft, packed=True),
            lease_ms=max(1, int(lease_s * 1000)), kv_skip=grant.kv_skip,
            mailbox_slot=grant.mailbox_slot)
        channel.send(notice(OFFER, request.SerializeToString()))
        return not channel.closed

    def connect_back(self, address: str) -> str:
        """Ask the prefill daemon at ``address`` to handshake with us (Connect); its
        instance id once it did. Its deadline covers prefill's handshake and the opening
        of its peer channel, each bounded by the RPC deadline.

        Raises:
            DialRefused: prefill's answer, or why it could not be asked; ``retry`` when
                it says nothing about the pair (no Connect there: an older kvbeam;
                busy; we advertise no control address).
        """
        local = self.local
        if not local.control_address:
            raise DialRefused(FailureReason.PEER_UNREACHABLE, "this decode daemon advertises "
                              "no control address, so prefill cannot dial it", retry=True)
        request = pb.ConnectRequest(control_address=local.control_address,
                                    instance_id=local.instance_id)
        timeout = CONNECT_DEADLINE_RPCS * self.options.rpc_timeout_s
        with ControlClient(address, options=self.options) as client:
            try:
                reply = client.stub.Connect(request, timeout=timeout)
            except grpc.RpcError as exc:
                raise connect_refusal(exc, address, timeout) from None
        return str(reply.instance_id)

    def abort_at(self, address: str, request_ids: Sequence[str], detail: str) -> None:
        """Abort requests on the prefill daemon at ``address`` on a one-off channel
        (no connection to it), best effort: prefill's Send of each ends now."""
        with ControlClient(address, options=self.options) as client:
            for request_id in request_ids:
                request = pb.AbortRequest(request_id=request_id, detail=detail,
                                          from_peer=True, instance_id=self.local.instance_id)
                _abort(request, self.options.rpc_timeout_s, address, client=client)

    def abort(self, conn: PeerConn, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        """Abort the request on prefill (it drains first); True when prefill confirmed."""
        request = pb.AbortRequest(request_id=request_id, detail=detail, from_peer=True,
                                  instance_id=self.local.instance_id)
        return _abort(request, timeout or self.options.rpc_timeout_s,
                      conn.control_address, conn=conn)

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
                pending.append(_start_abort(request, timeout, conn=conn))
            except (grpc.RpcError, PeerChannelError, ValueError) as exc:  # closed meanwhile
                log.info("could not tell %s that %s failed: %s", conn.control_address,
                         request_id, exc, extra=fields(request_id, conn.control_address))
        return _await_aborts(pending, len(calls), timeout, "prefill")
