"""The decode daemon's gRPC adapter: Reserve, BeginWrite, Digests, Release, Abort.

The core is :class:`DecodeCore`.

Decodes each request, calls the core (:mod:`kvbeam.server.core.decode`, where the
reservations live) and encodes the answer. The handshake hooks create and connect
one link per verified prefill instance, before the handshake reply leaves.
"""

from __future__ import annotations

import functools
import logging
import threading

import grpc

from kvbeam.errors import BadRequest
from kvbeam.logs import fields
from kvbeam.pools.digest import digests_from_wire
from kvbeam.proto.fields import host_port
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.transfer_codec import index_lists_from_proto, indices_to_proto
from kvbeam.rpc_errors import handled
from kvbeam.server.core.decode import DecodeCore
from kvbeam.server.daemon_servicer import IO_WORKERS, DaemonServicer
from kvbeam.server.handshake import VerifiedPeer
from kvbeam.server.identity import claim_refusal
from kvbeam.server.peer_rpc import Dialer, GrpcPrefillPeers
from kvbeam.server.peers import PeerConn
from kvbeam.server.runtime import Runtime
from kvbeam.server.validation import request_id_of, seq_len_of
from kvbeam.transport import Endpoint, Link

log = logging.getLogger(__name__)


class DecodeServicer(DaemonServicer):
    """Reserve (and its Offer), BeginWrite, Digests, Release, Abort and arrivals."""

    def __init__(self, runtime: Runtime, workers: int = IO_WORKERS) -> None:
        super().__init__(runtime, workers)
        spec, layout, pools = runtime.initial_pools()  # none yet with --pools engine
        self._dial = Dialer(runtime.options)
        self.core = self.decode = DecodeCore(
            table=runtime.table, peers=runtime.peers,
            prefill=GrpcPrefillPeers(lambda: self.local, runtime.options), io=self.io,
            spec=spec, layout=layout, pools=pools,
            integrity=runtime.settings.integrity, faults=runtime.faults,
            handoff_lease_s=runtime.settings.handoff_lease_s,
            transfer_budget=runtime.settings.transfer_budget_s,
            on_offer=lambda event: runtime.metrics.offers.labels(event).inc(),
            wire_s=lambda n: n / (runtime.settings.transfer_floor_mbps * 1e6),
            digest_pool=self.digest_pool)
        self.decode.on_decline = runtime.metrics.declines.inc
        self.slots = self.decode.slots
        self._links_lock = threading.Lock()  # leaf: guards _pending_links only
        self._pending_links: dict[str, Link] = {}

    # ---- handshake hooks: one link per verified prefill -------------------------
    def endpoint_for(self, peer: VerifiedPeer) -> Endpoint:
        """Create this peer's link; its endpoint (QPN, rkeys) goes into our reply."""
        link = self.rt.transport.create_link()  # may register memory: no lock held
        with self._links_lock:
            old = self._pending_links.pop(peer.instance_id, None)
            self._pending_links[peer.instance_id] = link
        if old is not None:
            old.release()
        return link.endpoint

    def on_verified(self, peer: VerifiedPeer) -> None:
        """Connect the peer's link (before our reply leaves, so before any write)."""
        with self._links_lock:
            link = self._pending_links.pop(peer.instance_id)
        previous = self.rt.peers.get(peer.instance_id)
        try:
            link.connect(peer.endpoint)
            conn = PeerConn(peer, link, self._dial)
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

    # ---- RPCs ----------------------------------------------------------------------
    @handled
    def Reserve(self, request: pb.ReserveRequest,
                context: grpc.ServicerContext) -> pb.ReserveResponse:
        """Hold a slot for a request; compute its destination indices or check the engine's."""
        rid = request_id_of(request.request_id)
        seq_len = seq_len_of(request.seq_len, self.rt.config.target.max_context_len)
        host_port(request.prefill_address, "prefill_address")
        target, draft = index_lists_from_proto(request.indices, "indices")
        res = self.decode.reserve(rid, seq_len, request.prefill_address, indices=target,
                                  draft=draft, kv_skip=request.kv_skip)
        # A connected prefill gets the reservation now, so its Send writes at once
        # (one RPC, bounded by the RPC timeout, no lock held; docs/protocol.md).
        self.decode.offer(res)
        return pb.ReserveResponse(
            request_id=rid, slot=res.slot, indices=indices_to_proto(res.indices, res.draft),
            lease_ms=int(self.rt.settings.deadline_bootstrap_s * 1000),
            instance_id=self.local.instance_id)

    @handled
    def BeginWrite(self, request: pb.BeginWriteRequest,
                   context: grpc.ServicerContext) -> pb.BeginWriteResponse:
        """Prefill is about to write (a chunk of) a request: check it may, say where."""
        rid = request_id_of(request.request_id)
        res = self.decode.begin_write(rid, request.instance_id, request.seq_len,
                                      request.final_chunk, request.digests_follow)
        return pb.BeginWriteResponse(request_id=rid, transfer_id=res.transfer_id, slot=res.slot,
                                     indices=indices_to_proto(res.indices, res.draft),
                                     instance_id=self.local.instance_id, kv_skip=res.kv_skip)

    @handled
    def Digests(self, request: pb.DigestsRequest,
                context: grpc.ServicerContext) -> pb.DigestsResponse:
        """Prefill's digests of a request whose writes it posted: verify once it landed."""
        rid = request_id_of(request.request_id)
        try:
            digests = digests_from_wire(list(request.digests))
        except ValueError as exc:
            raise BadRequest(f"request {rid}: Digests from instance {request.instance_id!r}: "
                             f"{exc}") from None
        self.decode.digests(rid, request.instance_id, request.transfer_id, digests)
        return pb.DigestsResponse()

    @handled
    def Release(self, request: pb.ReleaseRequest,
                context: grpc.ServicerContext) -> pb.TransferStatus:
        """The engine took over a request that reached Success: free its slot."""
        return self._status(self.decode.release(request_id_of(request.request_id)))

    @handled
    def Abort(self, request: pb.AbortRequest,
              context: grpc.ServicerContext) -> pb.TransferStatus:
        """Abort a request: fail it, make sure prefill stops writing, free the slot."""
        rid = request_id_of(request.request_id)
        # An Abort that says it is prefill's must come from where that prefill's handshake
        # was admitted from: the same rule, bound to this call's credentials.
        caller = functools.partial(claim_refusal, security=self.security, peer=context.peer(),
                                   auth=context.auth_context(), call="Abort")
        return self._status(self.decode.abort(rid, from_peer=request.from_peer,
                                              detail=request.detail,
                                              instance_id=request.instance_id,
                                              caller_refusal=caller))
