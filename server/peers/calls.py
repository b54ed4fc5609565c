"""The cores' peer calls: the handshake and decode's ask to connect over gRPC, every
per-request message over the pair's peer channel (:mod:`kvbeam.server.peers.channel`).

:class:`ChannelDecodePeers` (prefill's view of decode daemons) and
:class:`ChannelPrefillPeers` (decode's view of prefill daemons) implement the protocols
of :mod:`kvbeam.server.core.ports`, mapping the channel's statuses to the cores' errors.
BeginWrite, Offer and the daemons' Aborts go over the channel only: a handshake whose
decode names no channel, or whose channel cannot be opened, fails; a request whose
connection has no open channel is not offered (decode), asks nothing (prefill's core
handshakes again) and is told by Abort on the pair's newer connection when there is one,
else not at all (its deadline on the other side ends it). gRPC stays for what comes
before a channel exists: the handshake, and ``Connect`` (decode asks prefill to dial
it: prefill opens the channel, so decode cannot reach it on one). Every call but the
Offer blocks; the cores make them on the driver's executor only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import grpc

from kvbeam.errors import (
    AlreadyLanded,
    DialRefused,
    NoEngineAttached,
    NotReserved,
    PeerChannelError,
    PeerUnavailableError,
    SendFailed,
    TransportError,
    UnknownRequest,
)
from kvbeam.logs import fields
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.peer_frames import (
    ABORT,
    BEGIN_WRITE,
    OFFER,
    STATUS_CODES,
    Hello,
    Reply,
    notice,
)
from kvbeam.proto.side import SideInfo
from kvbeam.proto.transfer_codec import grant_indices_from_proto, indices_to_proto
from kvbeam.proto.version import PROTOCOL_VERSION
from kvbeam.rpc_errors import peer_error
from kvbeam.server.core.ports import Offered, WriteGrant
from kvbeam.server.metrics import DaemonMetrics
from kvbeam.server.peers.channel import (
    CHANNEL_ADDRESS_KEY,
    CHANNEL_TOKEN_KEY,
    PeerChannel,
    PeerChannels,
)
from kvbeam.server.peers.client import ControlClient
from kvbeam.server.settings import ControlOptions
from kvbeam.server.state.handshake import VerifiedPeer
from kvbeam.server.state.peers import PeerConn, Peers, peer_buffer_addrs
from kvbeam.states import FailureReason
from kvbeam.transport import Transport

log = logging.getLogger(__name__)

#: A Connect's deadline in RPC deadlines: prefill's handshake with us and the opening of
#: its peer channel (each bounded by one), and the answer.
CONNECT_DEADLINE_RPCS = 3
#: The most of a refusal's text a Connect's answer carries (a status's details).
MAX_CONNECT_DETAIL = 4000
#: The most request ids one Connect names (what prefill ends if the pair is refused).
MAX_CONNECT_IDS = 1024


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
    if code is grpc.StatusCode.UNAVAILABLE and details.startswith(TransportError.__name__):
        # The handshake passed but the data link could not be connected (a partition of
        # the data path, a port down): nothing about the pair, so the reservations wait
        # for the Send's handshake or their deadline.
        return DialRefused(FailureReason.PEER_UNREACHABLE,
                           f"{where} could not connect its data link to this decode: "
                           f"{details}", retry=True)
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return DialRefused(FailureReason.PEER_UNREACHABLE, f"{where} refused to dial this "
                                                           f"decode: {details}")
    if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return DialRefused(FailureReason.PEER_UNREACHABLE, f"{where} cannot connect now "
                           f"({code.name}: {details})", retry=True)
    err = peer_error(exc, address=address, method="Connect", timeout=timeout)
    return DialRefused(FailureReason.PEER_UNREACHABLE, str(err))


def open_channel(conn: PeerConn | None) -> PeerChannel | None:
    """The connection's peer channel while it is open, else None."""
    channel = conn.channel if conn is not None else None
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


def offer_answer(reply: pb.OfferResponse, address: str) -> Offered:
    """What prefill's OFFER_ANSWER says (never raises): a status is its refusal (sure,
    as the statuses a check gives; else it may have been kept), else whether it kept
    the offer and writes digests."""
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


class _Aborts:
    """The daemons' Aborts to their peers, over the pair's peer channel only."""

    def __init__(self, peers: Peers, timeout_s: Callable[[], float]) -> None:
        self.peers = peers
        self._timeout_s = timeout_s

    def channel_for(self, conn: PeerConn | None, address: str) -> PeerChannel | None:
        """The open channel to tell ``address`` on: ``conn``'s, else the pair's newer
        connection's (its link was replaced meanwhile), else one kept after a link
        failure (:meth:`~kvbeam.server.state.peers.Peers.keep`); None: none is open."""
        return (open_channel(conn) or open_channel(self.peers.by_address(address))
                or self.peers.kept_channel(address))

    def abort(self, conn: PeerConn | None, address: str, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        """Abort the request on the peer at ``address``; True when it confirmed none of
        the request's writes is in flight (or never heard of it). Not told without an
        open channel to it (logged: its own deadline ends the request there)."""
        channel = self.channel_for(conn, address)
        if channel is None:
            log.info("could not tell %s that %s failed: no open peer channel to it (its "
                     "deadline ends it there)", address, request_id,
                     extra=fields(request_id, address))
            return False
        try:
            left = self._call(channel, request_id, detail, timeout).result().in_flight
        except PeerChannelError as exc:
            if exc.code() is grpc.StatusCode.NOT_FOUND:
                return True  # the peer never heard of it: nothing of it is in flight
            log.info("could not tell %s that %s failed: %s", address, request_id,
                     exc.details(), extra=fields(request_id, address))
            return False
        if left:
            log.info("%s: %d write(s) of %s still in flight when it answered the Abort; it "
                     "says so once they drained", address, left, request_id,
                     extra=fields(request_id, address))
        return not left

    def _call(self, channel: PeerChannel, request_id: str, detail: str,
              timeout: float | None) -> Future[Reply]:
        request = pb.AbortRequest(request_id=request_id, detail=detail)
        return channel.start_call(ABORT, request.SerializeToString(),
                                  timeout or self._timeout_s())

    def abort_all(self, calls: Sequence[tuple[PeerConn | None, str, str]], detail: str,
                  timeout: float) -> int:
        """Abort many requests (connection or None, address, request id) at once: every
        call is started before any answer is awaited, so all end within ``timeout``;
        returns how many the peers confirmed."""
        pending = []
        for conn, address, request_id in calls:
            channel = self.channel_for(conn, address)
            if channel is not None:
                pending.append(self._call(channel, request_id, detail, timeout))
        confirmed = 0
        for future in pending:
            try:
                confirmed += not future.result().in_flight
            except PeerChannelError as exc:
                confirmed += exc.code() is grpc.StatusCode.NOT_FOUND
        if confirmed < len(calls):
            log.info("%d of %d Abort(s) not confirmed within %.1f s", len(calls) - confirmed,
                     len(calls), timeout)
        return confirmed


class ChannelDecodePeers:
    """Prefill's calls to decode daemons."""

    def __init__(self, local: Callable[[], SideInfo], transport: Transport,
                 options: ControlOptions, metrics: DaemonMetrics, peers: Peers,
                 channels: PeerChannels | None = None) -> None:
        self._local = local
        self.transport = transport
        self.options = options
        self.metrics = metrics
        self.channels = channels
        self._aborts = _Aborts(peers, lambda: self.rpc_timeout_s)

    @property
    def local(self) -> SideInfo:
        """Our side as the servicer sends it."""
        return self._local()

    @property
    def rpc_timeout_s(self) -> float:
        """The deadline of every call."""
        return self.options.rpc_timeout_s

    def connect(self, address: str) -> PeerConn:
        """Handshake with the decode daemon at ``address``; connect a new link to it and
        open the pair's peer channel."""
        link = self.transport.create_link()
        try:
            with ControlClient(address, options=self.options) as client, \
                    self.metrics.handshake("client"):
                verified = client.handshake(self.local, endpoint=link.endpoint)
            addrs = peer_buffer_addrs(verified.layout, verified)
            link.connect(verified.endpoint)
            channel = self._open_channel(verified, address)
        except Exception:
            link.release()
            raise
        conn = PeerConn(verified, link, addrs)
        conn.channel, channel.bound = channel, conn
        log.info("decode %s at %s verified and connected (%s, peer channel)",
                 verified.instance_id, address, self.transport.kind,
                 extra=fields(peer=address))
        return conn

    def _open_channel(self, verified: VerifiedPeer, address: str) -> PeerChannel:
        """Open the pair's peer channel where decode's handshake reply says.

        Raises:
            PeerUnavailableError: decode named no channel, or named one we could not
                open (the message names its address).
        """
        extra = verified.endpoint.extra
        where, token = extra.get(CHANNEL_ADDRESS_KEY, ""), extra.get(CHANNEL_TOKEN_KEY, "")
        peer = f"decode {verified.instance_id} at {address}"
        if self.channels is None or not where:
            raise PeerUnavailableError(
                f"handshake with {peer} succeeded, but "
                + ("its reply names no peer channel (every kvbeam decode daemon names "
                   "one): every per-request message goes over it"
                   if not where else "this side has no peer channels to open it with"),
                address=address)
        hello = Hello(PROTOCOL_VERSION, self.local.instance_id, verified.instance_id, token)
        try:
            return self.channels.connect(where, hello, peer, self.rpc_timeout_s)
        except (OSError, ValueError) as exc:
            raise PeerUnavailableError(
                f"handshake with {peer} succeeded, but its peer channel at {where} could "
                f"not be opened: {exc}", address=address) from None

    def begin_write(self, conn: PeerConn, request_id: str, seq_len: int,
                    digests_follow: bool) -> WriteGrant:
        """BeginWrite on decode; refusals become :class:`SendFailed` with their reason.

        Raises :class:`AlreadyLanded` when a resend finds the request landed on decode.
        """
        request = pb.BeginWriteRequest(
            request_id=request_id, instance_id=self.local.instance_id, seq_len=seq_len,
            digests_follow=digests_follow)
        self.metrics.begin_writes.inc()
        timeout = self.rpc_timeout_s
        channel = open_channel(conn)
        if channel is None:
            raise PeerUnavailableError(f"BeginWrite to {conn.control_address}: "
                                       f"{no_channel(conn, 'decode')}",
                                       address=conn.control_address, code="UNAVAILABLE")
        try:
            reply = pb.BeginWriteResponse.FromString(channel.call(
                BEGIN_WRITE, request.SerializeToString(), timeout).payload)
        except PeerChannelError as exc:
            raise _begin_write_refusal(exc, conn, timeout) from None
        target, draft = grant_indices_from_proto(reply.indices, "indices")
        return WriteGrant(reply.transfer_id, target, draft, kv_skip=reply.kv_skip,
                          mailbox_slot=reply.mailbox_slot)

    def reaches(self, conn: PeerConn | None, address: str) -> bool:
        """Whether an Abort to ``address`` has an open peer channel to go on."""
        return self._aborts.channel_for(conn, address) is not None

    def abort(self, conn: PeerConn | None, address: str, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        """Abort the request on decode so it fails now, not at its lease (best effort)."""
        return self._aborts.abort(conn, address, request_id, detail, timeout)

    def abort_all(self, calls: Sequence[tuple[PeerConn | None, str, str]], detail: str,
                  timeout: float) -> int:
        """Abort many requests on decode at once, all within ``timeout``; returns how
        many decode confirmed."""
        return self._aborts.abort_all(calls, detail, timeout)


def _begin_write_refusal(exc: PeerChannelError, conn: PeerConn, timeout: float) -> Exception:
    """The cores' error for decode's refusal of a BeginWrite."""
    code = exc.code()
    details = exc.details() or ""
    if code is grpc.StatusCode.FAILED_PRECONDITION and "NotHandshaken" in details:
        # Decode restarted or dropped our link: that instance's reservation is gone.
        return SendFailed(FailureReason.PEER_FAILED, f"decode at {conn.control_address} "
                          f"restarted or dropped the connection: {details}", peer_lost=True)
    if code is grpc.StatusCode.FAILED_PRECONDITION and details.startswith(
            AlreadyLanded.__name__):
        return AlreadyLanded(details)  # a resend found it landed
    if code is grpc.StatusCode.NOT_FOUND and details.startswith(UnknownRequest.__name__):
        return NotReserved(FailureReason.INVALID_REQUEST, f"decode refused BeginWrite: {details}")
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
        return SendFailed(FailureReason.INVALID_REQUEST, f"decode refused BeginWrite: {details}")
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return SendFailed(FailureReason.PEER_FAILED, f"decode refused BeginWrite: {details}")
    return peer_error(exc, address=conn.control_address, method="BeginWrite", timeout=timeout)


class ChannelPrefillPeers:
    """Decode's calls to prefill daemons."""

    def __init__(self, local: Callable[[], SideInfo], options: ControlOptions,
                 peers: Peers) -> None:
        self._local = local
        self.options = options
        self._aborts = _Aborts(peers, lambda: self.options.rpc_timeout_s)

    @property
    def local(self) -> SideInfo:
        """Our side as the servicer sends it."""
        return self._local()

    def offer(self, conn: PeerConn, request_id: str, seq_len: int, grant: WriteGrant,
              lease_s: float) -> bool:
        """Offer on prefill: the reservation ahead of Send, one frame, no answer awaited
        (never raises; see ports). True when it was sent: prefill keeps it without a
        word, or says otherwise in an OFFER_ANSWER. Without an open peer channel no
        offer is made (False: the Send asks with BeginWrite)."""
        channel = open_channel(conn)
        if channel is None:
            log.debug("request %s not offered: %s", request_id, no_channel(conn, "prefill"),
                      extra=fields(request_id, conn.control_address))
            return False
        request = pb.OfferRequest(
            request_id=request_id, instance_id=self.local.instance_id, seq_len=seq_len,
            transfer_id=grant.transfer_id,
            indices=indices_to_proto(grant.indices, grant.draft, packed=True),
            lease_ms=max(1, int(lease_s * 1000)), kv_skip=grant.kv_skip,
            mailbox_slot=grant.mailbox_slot)
        channel.send(notice(OFFER, request.SerializeToString()))
        return not channel.closed

    def connect_back(self, address: str, request_ids: Sequence[str] = ()) -> str:
        """Ask the prefill daemon at ``address`` to handshake with us (Connect); its
        instance id once it did. ``request_ids``: the requests waiting for the pair,
        which prefill ends itself if its handshake with us is refused. The deadline
        covers prefill's handshake and the opening of its peer channel, each bounded
        by the RPC deadline.

        Raises:
            DialRefused: prefill's answer, or why it could not be asked; ``retry`` when
                it says nothing about the pair (busy; we advertise no control address).
        """
        local = self.local
        if not local.control_address:
            raise DialRefused(FailureReason.PEER_UNREACHABLE, "this decode daemon advertises "
                              "no control address, so prefill cannot dial it", retry=True)
        request = pb.ConnectRequest(control_address=local.control_address,
                                    instance_id=local.instance_id,
                                    request_ids=list(request_ids)[:MAX_CONNECT_IDS])
        timeout = CONNECT_DEADLINE_RPCS * self.options.rpc_timeout_s
        with ControlClient(address, options=self.options) as client:
            try:
                reply = client.stub.Connect(request, timeout=timeout)
            except grpc.RpcError as exc:
                raise connect_refusal(exc, address, timeout) from None
        return str(reply.instance_id)

    def abort(self, conn: PeerConn, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        """Abort the request on prefill (it drains first); True when prefill confirmed."""
        return self._aborts.abort(conn, conn.control_address, request_id, detail, timeout)

    def abort_all(self, calls: Sequence[tuple[PeerConn, str]], detail: str,
                  timeout: float) -> int:
        """Abort many requests on their prefills at once, all within ``timeout``;
        returns how many prefill confirmed."""
        return self._aborts.abort_all([(conn, conn.control_address, rid)
                                       for conn, rid in calls], detail, timeout)

