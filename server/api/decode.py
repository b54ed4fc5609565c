"""The decode daemon's adapter: the RPCs Reserve, Release and Abort, and the peer
channel's BeginWrite and Abort (``channel_handlers``) and prefill's answers to offers
(``channel_notices``).

Decodes each request, calls decode's driver (:class:`DecodeDriver`, which hands each
call to the core, :mod:`kvbeam.server.core.decode`, where the reservations live, and
does the core's actions) and encodes the answer. The handshake hooks create and connect
one link per verified prefill instance, before the handshake reply leaves.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import grpc

from kvbeam.auth import same_token
from kvbeam.errors import FrameError
from kvbeam.logs import fields
from kvbeam.pools.mailbox import MAILBOX_KEY
from kvbeam.pools.sub_batches import SUB_BATCH_KEY
from kvbeam.proto.fields import host_port
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.peer_frames import ABORT, BEGIN_WRITE, OFFER_ANSWER, Hello
from kvbeam.proto.transfer_codec import index_lists_from_proto, indices_to_proto
from kvbeam.proto.version import PROTOCOL_VERSION
from kvbeam.rpc_errors import handled
from kvbeam.server.api.daemon import IO_WORKERS, DaemonServicer
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.incoming import Incoming
from kvbeam.server.core.validation import request_id_of, seq_len_of
from kvbeam.server.peers.calls import ChannelPrefillPeers, offer_answer
from kvbeam.server.peers.channel import (
    CHANNEL_ADDRESS_KEY,
    CHANNEL_TOKEN_KEY,
    PeerChannel,
    new_token,
)
from kvbeam.server.runtime import Runtime
from kvbeam.server.state.handshake import VerifiedPeer
from kvbeam.server.state.peers import PeerConn
from kvbeam.transport import Endpoint, Link

log = logging.getLogger(__name__)


class DecodeServicer(DaemonServicer):
    """Reserve (and its Offer), BeginWrite, Release, Abort and arrivals."""

    def __init__(self, runtime: Runtime, workers: int = IO_WORKERS) -> None:
        super().__init__(runtime, workers)
        self.core = self.decode = DecodeDriver(
            table=runtime.table, peers=runtime.peers,
            prefill=ChannelPrefillPeers(lambda: self.local, runtime.options, runtime.peers),
            io=self.io,
            integrity=runtime.settings.integrity,
            handoff_lease_s=runtime.settings.handoff_lease_s,
            transfer_budget=runtime.settings.transfer_budget_s,
            on_offer=runtime.metrics.count_offer,
            wire_s=lambda n: n / (runtime.settings.transfer_floor_mbps * 1e6),
            digest_pool=self.digest_pool,
            sub_batch_bytes=int(runtime.settings.verify_sub_batch_mib * (1 << 20)),
            clock=runtime.clock)
        self.decode.on_decline = runtime.metrics.declines.inc
        self.decode.on_connect = runtime.metrics.count_connect
        self._links_lock = threading.Lock()  # leaf: guards _pending_links only
        self._pending_links: dict[str, tuple[Link, str]] = {}  # link, channel token
        self.channel_handlers = {BEGIN_WRITE: (self.begin_write, pb.BeginWriteRequest, True),
                                 ABORT: (self.peer_abort, pb.AbortRequest, False)}
        self.channel_notices = {OFFER_ANSWER: (self.offer_answer_notice, pb.OfferResponse)}

    def offer_answer_notice(self, channel: PeerChannel, answer: pb.OfferResponse) -> None:
        """Prefill's OFFER_ANSWER: an offer it did not keep, kept without
        digests, or refused with a status; counted, and acted on by the reservation it
        names (its request id and transfer id) when that is still offered to the prefill
        this channel is bound to. On the daemon's loop."""
        self.decode.offer_answer(answer.request_id, answer.transfer_id,
                                 channel.bound.instance_id,
                                 offer_answer(answer, channel.bound.control_address))

    # ---- handshake hooks: one link per verified prefill -------------------------
    def endpoint_for(self, peer: VerifiedPeer) -> Endpoint:
        """Create this peer's link; its endpoint (QPN, rkeys) goes into our reply, with
        our digest mailbox, where our peer channel listens and the token
        its HELLO must carry."""
        link = self.rt.transport.create_link()  # may register memory: no lock held
        token = new_token()
        with self._links_lock:
            old = self._pending_links.pop(peer.instance_id, None)
            self._pending_links[peer.instance_id] = (link, token)
        if old is not None:
            old[0].release()
        endpoint = link.endpoint
        extra = dict(endpoint.extra)
        mailbox = self.decode.mailbox
        if mailbox is not None:  # registered before the link: its regions include it
            extra[MAILBOX_KEY] = mailbox.advert().text()
        if self.decode.sub_batch_bytes:
            extra[SUB_BATCH_KEY] = str(self.decode.sub_batch_bytes)
        if self.channels.address:
            extra.update({CHANNEL_ADDRESS_KEY: self.channels.address, CHANNEL_TOKEN_KEY: token})
        return dataclasses.replace(endpoint, extra=extra)

    def on_verified(self, peer: VerifiedPeer) -> None:
        """Connect the peer's link (before our reply leaves, so before any write)."""
        with self._links_lock:
            link, token = self._pending_links.pop(peer.instance_id)
        previous = self.rt.peers.get(peer.instance_id)
        try:
            link.connect(peer.endpoint)
            conn = PeerConn(peer, link)
            conn.channel_token = token
        except Exception:
            link.release()
            self.peers.forget(peer.instance_id)
            raise
        if previous is not None:  # the same instance handshook again (e.g. after a link error)
            self.peer_lost(previous, "peer handshook again; the old link is replaced",
                           gone=False)
        self.rt.peers.add(conn)
        log.info("prefill %s at %s verified and connected (%s)", peer.instance_id,
                 peer.control_address, self.rt.transport.kind,
                 extra=fields(peer=peer.control_address))

    def channel_hello(self, channel: PeerChannel, hello: Hello) -> PeerConn:
        """Bind an inbound peer channel to the verified prefill its HELLO names: the
        token must be the one our latest handshake reply gave that instance. A channel
        it had is replaced at once (closed with a BYE, no waiting on it).

        Raises:
            FrameError: refused (the reason is logged with the caller's address).
        """
        if hello.version != PROTOCOL_VERSION:
            raise FrameError("hello.version", f"protocol version {hello.version}, ours "
                                              f"{PROTOCOL_VERSION}")
        if hello.decode_instance != self.local.instance_id:
            raise FrameError("hello.decode_instance",
                             f"names decode instance {hello.decode_instance!r}, we are "
                             f"{self.local.instance_id} (we restarted: handshake again)")
        conn = self.rt.peers.get(hello.prefill_instance)
        if conn is None or conn.closed:
            raise FrameError("hello.prefill_instance",
                             f"no connected prefill instance {hello.prefill_instance!r}: "
                             "handshake first")
        if not conn.channel_token or not same_token(hello.token, conn.channel_token):
            raise FrameError("hello.token", f"not the token our handshake gave prefill "
                                            f"{hello.prefill_instance}")
        channel.peer = f"prefill {conn.instance_id} at {conn.control_address}"
        old, conn.channel = conn.channel, channel
        if old is not None:
            old.close("replaced by a new channel from the same prefill", bye=True)
        return conn

    # ---- RPCs ----------------------------------------------------------------------
    @handled
    def Reserve(self, request: pb.ReserveRequest,
                context: grpc.ServicerContext) -> pb.ReserveResponse:
        """Hold a slot for a request; compute its destination indices or check the engine's."""
        rid = request_id_of(request.request_id)
        seq_len = seq_len_of(request.seq_len, self.rt.config.target.max_context_len)
        host_port(request.prefill_address, "prefill_address")
        target, draft = index_lists_from_proto(request.indices, "indices")
        def reserve() -> Incoming:
            res = self.decode.reserve(rid, seq_len, request.prefill_address, indices=target,
                                      draft=draft, kv_skip=request.kv_skip)
            # A connected prefill gets the reservation now, so its Send writes at once
            # (one frame on the peer channel, not waited for; docs/protocol.md).
            self.decode.offer(res)
            return res

        res = self.decode.on_loop(reserve)  # both in one call handed to the loop
        return pb.ReserveResponse(
            request_id=rid, slot=res.slot, indices=indices_to_proto(res.indices, res.draft),
            lease_ms=int(self.rt.settings.deadline_bootstrap_s * 1000),
            instance_id=self.local.instance_id)

    def begin_write(self, channel: PeerChannel, request: pb.BeginWriteRequest,
                    _timeout_s: float) -> tuple[pb.BeginWriteResponse, int]:
        """Prefill is about to write (a chunk of) a request: check it may, say where (the
        peer channel's request, answered on its thread)."""
        rid = request_id_of(request.request_id)
        res = self.decode.begin_write(rid, channel.bound.instance_id, request.seq_len,
                                      request.digests_follow)
        return pb.BeginWriteResponse(request_id=rid, transfer_id=res.transfer_id, slot=res.slot,
                                     indices=indices_to_proto(res.indices, res.draft,
                                                              packed=True),
                                     instance_id=self.local.instance_id, kv_skip=res.kv_skip,
                                     mailbox_slot=res.mailbox_slot), 0

    @handled
    def Release(self, request: pb.ReleaseRequest,
                context: grpc.ServicerContext) -> pb.TransferStatus:
        """The engine took over a request that reached Success: free its slot."""
        rid = request_id_of(request.request_id)
        # The Release and its reply in one call handed to the loop, not two.
        return self.decode.on_loop(lambda: self._status(self.decode.release(rid)))

    @handled
    def Abort(self, request: pb.AbortRequest,
              context: grpc.ServicerContext) -> pb.TransferStatus:
        """A scheduler's Abort: fail the request, make sure prefill stops writing, free
        the slot."""
        return self._status(self.decode.abort(request_id_of(request.request_id),
                                              from_peer=False, detail=request.detail))

    def peer_abort(self, channel: PeerChannel, request: pb.AbortRequest,
                   _timeout_s: float) -> tuple[pb.TransferStatus, int]:
        """Prefill's Abort over the peer channel. Prefill's own word (its writes have
        drained) only from the prefill the request was granted to: the one the channel
        is bound to (its HELLO proved it); anyone else's is a scheduler's abort."""
        bound = channel.bound.control_address

        def caller(address: str) -> str | None:
            return None if address == bound else (
                f"Abort over the peer channel of prefill {bound} claims prefill {address}")
        return self._status(self.decode.abort(request_id_of(request.request_id),
                                              from_peer=True, detail=request.detail,
                                              instance_id=channel.bound.instance_id,
                                              caller_refusal=caller)), 0
