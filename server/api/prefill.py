"""The prefill daemon's adapter: the RPCs Send, Abort and Connect, and the peer
channel's Offer and Abort, over :class:`PrefillDriver`.

Decodes each request, validates what only the wire can get wrong, calls the core
(:mod:`kvbeam.server.core.prefill`, where the send path lives) and encodes the
status. Decode's Offer (one-way) and Abort arrive on the peer channel only
(``channel_notices``, ``channel_handlers``); the Abort RPC is a scheduler's. Peer calls
go over the peer channel (:class:`~kvbeam.server.peers.calls.ChannelDecodePeers`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc

from kvbeam.errors import (
    Busy,
    HandshakeRejectedError,
    NoEngineAttached,
    PeerError,
    PoolCompatibilityError,
    ProtocolError,
    ProtocolVersionError,
    RoleConflictError,
    TransportError,
)
from kvbeam.logs import fields
from kvbeam.pools.engine_indices import slot_lists
from kvbeam.proto.fields import host_port
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.peer_frames import ABORT, OFFER, OFFER_ANSWER, notice
from kvbeam.proto.transfer_codec import (
    grant_indices_from_proto,
    index_lists_from_proto,
)
from kvbeam.rpc_errors import handled
from kvbeam.server.api.daemon import IO_WORKERS, DaemonServicer
from kvbeam.server.core.ports import WriteGrant
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.core.validation import request_id_of, seq_len_of
from kvbeam.server.peers.calls import MAX_CONNECT_DETAIL, ChannelDecodePeers
from kvbeam.server.peers.channel import PeerChannel
from kvbeam.server.peers.identity import claim_refusal
from kvbeam.server.runtime import Runtime
from kvbeam.states import FailureReason

log = logging.getLogger(__name__)

#: What an Abort keeps of its caller's deadline for the answer's way back, s.
ABORT_ANSWER_S = 0.25
#: What an OFFER_ANSWER carries back at most of a request id and of a refusal's details.
MAX_ANSWER_ID = 1024
MAX_ANSWER_DETAIL = 4096


def connect_code(exc: BaseException) -> grpc.StatusCode:
    """The status of a Connect whose handshake (or admission) failed: FAILED_PRECONDITION
    for a refused pair (its text names every difference) or no engine attached,
    RESOURCE_EXHAUSTED when busy, UNAVAILABLE when decode could not be reached or the
    pair's data link could not be connected (a partition: the details start with the
    error's class name, which decode reads)."""
    if isinstance(exc, PoolCompatibilityError | ProtocolVersionError | RoleConflictError
                  | HandshakeRejectedError | NoEngineAttached):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, Busy):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, PeerError | ProtocolError | TransportError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class PrefillServicer(DaemonServicer):
    """Send, Offer, Abort and the completion of writes."""

    def __init__(self, runtime: Runtime, workers: int = IO_WORKERS) -> None:
        super().__init__(runtime, workers)
        decode = ChannelDecodePeers(lambda: self.local, runtime.transport, runtime.options,
                                    runtime.metrics, runtime.peers, self.channels)
        self.core = self.prefill = PrefillDriver(
            table=runtime.table, peers=runtime.peers, decode=decode, io=self.io,
            integrity=runtime.settings.integrity,
            drain_s=runtime.transport_timeout(),
            transfer_budget=runtime.settings.transfer_budget_s,
            resend_retries=runtime.settings.resend_retries, on_resend=runtime.metrics.resends.inc,
            max_offers=runtime.settings.max_inflight,
            on_offer=runtime.metrics.count_offer,
            send_wait_s=runtime.settings.send_wait_s, digest_pool=self.digest_pool,
            staging_slots=runtime.settings.max_inflight,
            clock=runtime.clock)
        self.channel_handlers = {ABORT: (self.peer_abort, pb.AbortRequest, False)}
        self.channel_notices = {OFFER: (self.offer_notice, pb.OfferRequest)}

    def offer_notice(self, channel: PeerChannel, request: pb.OfferRequest) -> None:
        """Decode's Offer over the peer channel, one-way: kept without a word when
        prefill's digests will follow (the usual case); anything else decode must act on
        (not kept, kept without digests, refused with a status) goes back to it as one
        OFFER_ANSWER frame. On the daemon's loop."""
        code, detail = grpc.StatusCode.OK, ""
        answer = pb.OfferResponse()
        bound = channel.bound
        if request.instance_id and request.instance_id != bound.instance_id:
            code = grpc.StatusCode.PERMISSION_DENIED
            detail = (f"PermissionDenied: the peer channel is bound to instance "
                      f"{bound.instance_id}, the Offer names {request.instance_id!r}")
        else:
            try:
                answer = self._offer(request, bound.instance_id)
            except Exception as exc:
                code, detail = self.channel_refusal(exc, "Offer", channel, request.request_id)
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
                elif code is grpc.StatusCode.FAILED_PRECONDITION:
                    self._pair_refused(request.request_ids, address, request.instance_id,
                                       detail)
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
        """Queue (a chunk of) a request for decode; returns at once (poll Status).

        Without index lists, a ``source_slot`` other than -1 names the slot's lists
        (:func:`~kvbeam.pools.engine_indices.slot_lists`): the scheduler's slot
        addressing ends here, the core knows lists only (a further chunk naming another
        slot is refused as one naming other lists). -1 without lists: none (a further
        chunk of a request whose first gave them)."""
        rid = request_id_of(request.request_id)
        seq_len = seq_len_of(request.seq_len, self.rt.config.target.max_context_len)
        if request.decode_address:  # empty: the decode whose reservation names it
            host_port(request.decode_address, "decode_address")
        target, draft = index_lists_from_proto(request.indices, "indices")
        chunks = [(r.start, r.end) for r in request.chunks]
        slot = request.source_slot

        def send() -> pb.TransferStatus:
            # On the loop: the slot's lists are of the pools the Send then goes to.
            indices = target if target or draft or slot == -1 else slot_lists(
                self.prefill.spec, self.prefill.layout, slot, seq_len)
            return self._status(self.prefill.send(rid, seq_len, request.decode_address,
                                                  chunks, request.final_chunk,
                                                  indices=indices, draft=draft))

        # The Send and its reply in one call handed to the loop, not two.
        return self.prefill.on_loop(send)

    def _offer(self, request: pb.OfferRequest, instance_id: str) -> pb.OfferResponse:
        """Decode's reservation ahead of Send: keep it, so the Send writes at once."""
        rid = request_id_of(request.request_id)
        # Checked as BeginWrite's answer is: each kind once, no negative index.
        target, draft = grant_indices_from_proto(request.indices, "indices")
        grant = WriteGrant(request.transfer_id, target, draft,
                           kv_skip=request.kv_skip,  # checked against the Send's lists
                           mailbox_slot=request.mailbox_slot)  # checked against the mailbox
        kept = self.prefill.offer(rid, instance_id, request.seq_len, grant,
                                  request.lease_ms / 1000)
        return pb.OfferResponse(accepted=kept, digests_follow=self.prefill.integrity)

    def _pair_refused(self, request_ids: Sequence[str], address: str, instance_id: str,
                      detail: str) -> None:
        """A Connect's handshake was refused: the requests the decode at ``address`` named
        as waiting for the pair fail here now, ``incompatible`` as a Send's own refused
        handshake would fail them (their Sends end with the refusal, whichever came
        first)."""
        detail = f"decode's reservation failed: the pair could not connect: {detail}"
        for rid in request_ids:
            try:
                self.prefill.abort(request_id_of(rid), from_peer=True, detail=detail,
                                   wait_s=0.0, instance_id=instance_id,
                                   caller_refusal=_speaks_for(address, "Connect"),
                                   reason=FailureReason.INCOMPATIBLE)
            except Exception as exc:  # an unknown id: nothing to end here
                log.debug("Connect from decode %s names %r: %s", address, rid, exc,
                          extra=fields(rid, address))

    def peer_abort(self, channel: PeerChannel, request: pb.AbortRequest,
                   timeout_s: float) -> tuple[pb.TransferStatus, int]:
        """Decode's Abort over the peer channel: fail the request, answering within the
        caller's deadline with how many of its writes had not drained (decode is told
        by Abort once they did). Decode's verdict only from the request's own decode:
        the one the channel is bound to."""
        rid = request_id_of(request.request_id)
        bound = channel.bound
        snap = self.prefill.abort(rid, from_peer=True, detail=request.detail,
                                  wait_s=max(0.0, timeout_s - ABORT_ANSWER_S),
                                  instance_id=bound.instance_id,
                                  caller_refusal=_speaks_for(bound.control_address,
                                                             "Abort over the peer channel"))
        return self._status(snap), self.prefill.in_flight(rid)

    @handled
    def Abort(self, request: pb.AbortRequest,
              context: grpc.ServicerContext) -> pb.TransferStatus:
        """A scheduler's Abort: fail the request (decode is told once its writes
        drained); answers within the caller's deadline."""
        rid = request_id_of(request.request_id)
        remaining = context.time_remaining()
        wait_s = None if remaining is None else max(0.0, remaining - ABORT_ANSWER_S)
        return self._status(self.prefill.abort(rid, from_peer=False, detail=request.detail,
                                               wait_s=wait_s))


def _speaks_for(address: str, how: str) -> Callable[[str], str | None]:
    """Why a caller bound to the decode at ``address`` (by its peer channel, or by a
    Connect's checked claim) may not speak for the decode at another address."""
    def refusal(claimed: str) -> str | None:
        return None if claimed == address else (
            f"{how} of decode {address} claims decode {claimed}")
    return refusal
