"""The prefill daemon's adapter: the RPCs Send and Abort, and the peer channel's Offer and
Abort, over :class:`PrefillDriver`.

Decodes each request, validates what only the wire can get wrong, calls the core
(:mod:`kvbeam.server.core.prefill`, where the send path lives) and encodes the
status. :meth:`PrefillServicer.Offer` is a handler of the peer channel only (no such RPC
is served: ``channel_notices``, one-way since protocol 8). Peer calls go over the peer channel
(:class:`~kvbeam.server.peer_rpc.GrpcDecodePeers`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import grpc

from kvbeam.errors import (
    Busy,
    HandshakeRejectedError,
    NoEngineAttached,
    PeerChannelError,
    PeerError,
    PoolCompatibilityError,
    ProtocolError,
    ProtocolVersionError,
    RoleConflictError,
)
from kvbeam.logs import fields
from kvbeam.proto.fields import host_port
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.transfer_codec import (
    grant_indices_from_proto,
    index_lists_from_proto,
)
from kvbeam.rpc_errors import handled
from kvbeam.server.core.ports import WriteGrant
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.daemon_servicer import IO_WORKERS, ChannelContext, DaemonServicer
from kvbeam.server.identity import claim_refusal
from kvbeam.server.peer_channel import ABORT, OFFER, OFFER_ANSWER, PeerChannel, notice
from kvbeam.server.peer_rpc import (
    MAX_CONNECT_DETAIL,
    WRITES_IN_FLIGHT_KEY,
    Dialer,
    GrpcDecodePeers,
)
from kvbeam.server.runtime import Runtime
from kvbeam.server.validation import request_id_of, seq_len_of

log = logging.getLogger(__name__)

#: What an Abort keeps of its caller's deadline for the answer's way back, s.
ABORT_ANSWER_S = 0.25
#: The deadline an Offer's handler sees (it does no I/O and waits for nothing), s.
OFFER_HANDLING_S = 1.0
#: What an OFFER_ANSWER carries back at most of a request id and of a refusal's details.
MAX_ANSWER_ID = 1024
MAX_ANSWER_DETAIL = 4096


def connect_code(exc: BaseException) -> grpc.StatusCode:
    """The status of a Connect whose handshake (or admission) failed: FAILED_PRECONDITION
    for a refused pair (its text names every difference) or no engine attached,
    RESOURCE_EXHAUSTED when busy, UNAVAILABLE when decode could not be reached."""
    if isinstance(exc, PoolCompatibilityError | ProtocolVersionError | RoleConflictError
                  | HandshakeRejectedError | NoEngineAttached):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, Busy):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, PeerError | ProtocolError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class PrefillServicer(DaemonServicer):
    """Send, Offer, Abort and the completion of writes."""

    def __init__(self, runtime: Runtime, workers: int = IO_WORKERS) -> None:
        super().__init__(runtime, workers)
        spec, layout, pools = runtime.initial_pools()  # none yet with --pools engine
        decode = GrpcDecodePeers(lambda: self.local, runtime.transport,
                                 Dialer(runtime.options), runtime.metrics, self.channels)
        self.core = self.prefill = PrefillDriver(
            table=runtime.table, peers=runtime.peers, decode=decode, io=self.io,
            spec=spec, layout=layout, pools=pools,
            integrity=runtime.settings.integrity, faults=runtime.faults,
            drain_s=runtime.transport_timeout(),
            transfer_budget=runtime.settings.transfer_budget_s,
            resend_retries=runtime.settings.resend_retries, on_resend=runtime.metrics.resends.inc,
            max_offers=runtime.settings.max_inflight,
            on_offer=runtime.metrics.count_offer,
            send_wait_s=runtime.settings.send_wait_s, digest_pool=self.digest_pool,
            staging=runtime.records, staging_slots=runtime.settings.max_inflight)
        self.channel_handlers = {ABORT: (self.Abort, pb.AbortRequest, False)}
        self.channel_notices = {OFFER: (self.offer_notice, pb.OfferRequest)}

    def offer_notice(self, channel: PeerChannel, request: pb.OfferRequest) -> None:
        """Decode's Offer over the peer channel, one-way (protocol 8): kept without a word
        when prefill's digests will follow (the usual case); anything else decode must act
        on (not kept, kept without digests, refused with a status) goes back to it as one
        OFFER_ANSWER frame. The peer channel's thread."""
        code, detail = grpc.StatusCode.OK, ""
        answer = pb.OfferResponse()
        bound = channel.bound
        if request.instance_id and request.instance_id != bound.instance_id:
            code = grpc.StatusCode.PERMISSION_DENIED
            detail = (f"PermissionDenied: the peer channel is bound to instance "
                      f"{bound.instance_id}, the Offer names {request.instance_id!r}")
        else:
            # The channel's stand-in for grpc.ServicerContext (one handler serves both).
            context: Any = ChannelContext(channel, OFFER_HANDLING_S)
            try:
                answer = self.Offer(request, context)
            except PeerChannelError as refused:
                code, detail = refused.code(), refused.details()
        if code is grpc.StatusCode.OK and answer.accepted and answer.digests_follow:
            return
        answer.request_id = request.request_id[:MAX_ANSWER_ID]
        answer.transfer_id = request.transfer_id
        answer.code = code.value[0]
        answer.detail = detail[:MAX_ANSWER_DETAIL]
        channel.send(notice(OFFER_ANSWER, answer.SerializeToString()))

    def Connect(self, request: pb.ConnectRequest,
                context: grpc.ServicerContext) -> pb.ConnectResponse:
        """A decode daemon holds a reservation naming us and the pair has no connection:
        handshake with it now (decode-initiated pairing). Prefill dials the address the
        caller claims, once the caller's credentials cover it (the handshake's rule);
        the answer is the handshake's outcome, a refusal's text included."""
        address = request.control_address
        code: grpc.StatusCode | None = None
        detail = ""
        try:
            host_port(address, "control_address")
        except ProtocolError as exc:
            code, detail = grpc.StatusCode.INVALID_ARGUMENT, f"{type(exc).__name__}: {exc}"
        else:
            refusal = claim_refusal(address, security=self.security, peer=context.peer(),
                                    auth=context.auth_context(), call="Connect")
            if refusal is not None:
                log.warning("%s", refusal, extra=fields(peer=address))
                code, detail = grpc.StatusCode.PERMISSION_DENIED, refusal
        conn = None
        if code is None:
            try:
                conn = self.prefill.connect_back(address, request.instance_id)
            except Exception as exc:
                code = connect_code(exc)
                detail = f"{type(exc).__name__}: {exc}"
                if code is grpc.StatusCode.INTERNAL:
                    log.exception("Connect from decode %s failed unexpectedly", address)
        self.rt.metrics.count_connect("ok" if code is None else "failed")
        if code is not None or conn is None:
            log.info("Connect from decode %s refused: %s: %s", address,
                     (code or grpc.StatusCode.INTERNAL).name, detail,
                     extra=fields(peer=address))
            context.abort(code or grpc.StatusCode.INTERNAL, detail[:MAX_CONNECT_DETAIL])
        log.info("decode %s at %s asked to connect: connected", conn.instance_id, address,
                 extra=fields(peer=address))
        return pb.ConnectResponse(instance_id=self.local.instance_id,
                                  decode_instance_id=conn.instance_id)

    @handled
    def Send(self, request: pb.SendRequest, context: grpc.ServicerContext) -> pb.TransferStatus:
        """Queue (a chunk of) a request for decode; returns at once (poll Status)."""
        rid = request_id_of(request.request_id)
        seq_len = seq_len_of(request.seq_len, self.rt.config.target.max_context_len)
        if request.decode_address:  # empty: the decode whose reservation names it
            host_port(request.decode_address, "decode_address")
        target, draft = index_lists_from_proto(request.indices, "indices")
        snap = self.prefill.send(rid, request.source_slot, seq_len, request.decode_address,
                                 [(r.start, r.end) for r in request.chunks],
                                 request.final_chunk, indices=target, draft=draft)
        return self._status(snap)

    @handled
    def Offer(self, request: pb.OfferRequest,
              context: grpc.ServicerContext) -> pb.OfferResponse:
        """Decode's reservation ahead of Send: keep it, so the Send writes at once (the
        peer channel's handler; ``context`` is its :class:`ChannelContext`)."""
        rid = request_id_of(request.request_id)
        # Checked as BeginWrite's answer is: each kind once, no negative index.
        target, draft = grant_indices_from_proto(request.indices, "indices")
        grant = WriteGrant(request.transfer_id, target, draft,
                           kv_skip=request.kv_skip,  # checked against the Send's lists
                           mailbox_slot=request.mailbox_slot)  # checked against the mailbox
        kept = self.prefill.offer(rid, request.instance_id, request.seq_len, grant,
                                  request.lease_ms / 1000)
        return pb.OfferResponse(accepted=kept, digests_follow=self.prefill.integrity)

    def _caller_refusal(self, context: grpc.ServicerContext) -> Callable[[str], str | None]:
        """Why the caller of an Abort saying it is decode's may not speak for the decode
        at an address (None: it may). Over the peer channel the channel's HELLO proved
        the caller: it speaks for the decode it is bound to; over the RPC the
        handshake's rule, bound to the call's credentials."""
        if isinstance(context, ChannelContext):
            bound = context.bound.control_address

            def channel_refusal(address: str) -> str | None:
                return None if address == bound else (
                    f"Abort over the peer channel of decode {bound} claims decode {address}")
            return channel_refusal
        return functools.partial(claim_refusal, security=self.security, peer=context.peer(),
                                 auth=context.auth_context(), call="Abort")

    @handled
    def Abort(self, request: pb.AbortRequest,
              context: grpc.ServicerContext) -> pb.TransferStatus:
        """Fail the request; answer within the caller's deadline, saying in the trailing
        metadata (``kvbeam-writes-in-flight``) how many of its writes had not drained."""
        rid = request_id_of(request.request_id)
        remaining = context.time_remaining()
        wait_s = None if remaining is None else max(0.0, remaining - ABORT_ANSWER_S)
        snap = self.prefill.abort(rid, from_peer=request.from_peer, detail=request.detail,
                                  wait_s=wait_s, instance_id=request.instance_id,
                                  caller_refusal=self._caller_refusal(context))
        left = self.prefill.in_flight(rid)
        if left:
            context.set_trailing_metadata(((WRITES_IN_FLIGHT_KEY, str(left)),))
        return self._status(snap)
