"""The ``kvbeam.v1.KvbeamControl`` servicer: the server side of the handshake.

:class:`ControlServicer` implements Handshake; the other RPCs (Reserve, Send,
Status, WatchStatus, Abort, Heartbeat) keep the generated base class's
UNIMPLEMENTED answer until the daemons subclass it. Hooks for the daemons:
:meth:`ControlServicer.endpoint_for` (create the per-peer link),
:meth:`ControlServicer.on_verified` and :meth:`ControlServicer.on_peer_restarted`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2

from kvbeam.auth import Security
from kvbeam.errors import (
    Difference,
    PoolCompatibilityError,
    ProtocolError,
    ProtocolVersionError,
    RoleConflictError,
)
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2_grpc as pb_grpc
from kvbeam.proto.rejection_codec import (
    REJECTION_KEY,
    Reason,
    encode_rejection,
    requested_budget,
    status_details,
)
from kvbeam.proto.side import SideEncoder, SideInfo, side_from_proto
from kvbeam.server.peers.identity import claim_refusal
from kvbeam.server.state.handshake import VerifiedPeer, verify_peer
from kvbeam.server.state.peers import Peers
from kvbeam.transport.endpoint import Endpoint

log = logging.getLogger(__name__)


class ControlServicer(pb_grpc.KvbeamControlServicer):
    """Serves Handshake for one local side; verified peers land in :attr:`peers`.

    Args:
        local: our side (role, layout, default endpoint, instance id, control address).
        peers: the registry to fill (a fresh one by default).

    Attributes:
        security: how the server authenticates callers; a caller's claimed control
            address must match it (:func:`~kvbeam.server.peers.identity.claim_refusal`).
            :class:`~kvbeam.server.api.control.ControlServer` sets it from its options.
    """

    def __init__(self, local: SideInfo, *, peers: Peers | None = None) -> None:
        self._local = local
        self._encoder: SideEncoder | None = None
        self.peers = peers if peers is not None else Peers()
        self.security = Security()

    @property
    def local(self) -> SideInfo:
        """Our side as we send it."""
        return self._local

    @local.setter
    def local(self, side: SideInfo) -> None:
        self._local = side
        self._encoder = None

    def prepare(self) -> None:
        """Encode and validate our side now, so the first handshake does not pay for it."""
        self._encode(self._local.endpoint)

    def _encode(self, endpoint: Endpoint) -> pb.SideInfo:
        # Our metadata is constant: encode and validate it once, not per handshake.
        encoder = self._encoder
        if encoder is None or encoder.side is not self._local:
            encoder = self._encoder = SideEncoder(self._local)
        return encoder.encode(endpoint)

    # ---- hooks for the daemons ------------------------------------------------
    def endpoint_for(self, peer: VerifiedPeer) -> Endpoint:
        """The data-plane endpoint to give a peer that passed verification.

        The default returns ``local.endpoint``; a daemon creates a link (RDMA QP)
        per peer here. Called only after verification succeeded.
        """
        return self.local.endpoint

    def on_verified(self, peer: VerifiedPeer) -> None:
        """Called after a peer was verified and registered (default: nothing)."""

    def on_peer_restarted(self, old: VerifiedPeer, new: VerifiedPeer) -> None:
        """Called when ``new`` replaced ``old`` from the same control address (default: nothing)."""

    # ---- RPCs -----------------------------------------------------------------
    def Handshake(self, request: pb.HandshakeRequest,
                  context: grpc.ServicerContext) -> pb.HandshakeResponse:
        """Decode the peer's side, verify the pair, register the peer and answer with ours."""
        address = context.peer()
        try:
            peer = side_from_proto(request.side, "side")
        except ProtocolVersionError as exc:
            log.error("handshake from %s refused: %s", address, exc)
            self._reject(context, grpc.StatusCode.FAILED_PRECONDITION,
                         Reason.REJECT_REASON_PROTOCOL_VERSION, str(exc), field=exc.field,
                         include_metadata=False)
        except ProtocolError as exc:
            log.warning("handshake from %s refused: malformed metadata: %s", address, exc)
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                         Reason.REJECT_REASON_INVALID_METADATA, str(exc), field=exc.field,
                         include_metadata=False)
        # Before anything is registered or created: a caller claiming another peer's
        # address would otherwise replace it (a "restart" that fails its requests).
        refusal = claim_refusal(peer.control_address, security=self.security, peer=address,
                                auth=context.auth_context())
        if refusal is not None:
            log.warning("%s", refusal)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        try:
            verified = verify_peer(self.local, peer, address=address)
        except ProtocolVersionError as exc:
            self._reject(context, grpc.StatusCode.FAILED_PRECONDITION,
                         Reason.REJECT_REASON_PROTOCOL_VERSION, str(exc), field=exc.field,
                         include_metadata=False)
        except RoleConflictError as exc:
            self._reject(context, grpc.StatusCode.FAILED_PRECONDITION,
                         Reason.REJECT_REASON_ROLE_CONFLICT, str(exc))
        except PoolCompatibilityError as exc:
            self._reject(context, grpc.StatusCode.FAILED_PRECONDITION,
                         Reason.REJECT_REASON_INCOMPATIBLE_POOLS, str(exc),
                         differences=exc.differences)
        verified = verified.with_local_endpoint(self.endpoint_for(verified))
        try:
            reply = pb.HandshakeResponse(side=self._encode(verified.local_endpoint))
        except ProtocolError as exc:
            # Our own bug (e.g. endpoint_for built a bad endpoint), not the peer's.
            log.error("handshake from %s failed: our own side cannot be sent: %s", address, exc)
            context.abort(grpc.StatusCode.INTERNAL, f"server side cannot be encoded: {exc}")
        for old in self.peers.add_verified(verified):
            self.on_peer_restarted(old, verified)
        self.on_verified(verified)
        return reply

    def _reject(self, context: grpc.ServicerContext, code: grpc.StatusCode,
                reason: pb.RejectReason,
                message: str, *, differences: Sequence[Difference] = (), field: str = "",
                include_metadata: bool = True) -> NoReturn:
        trailer = encode_rejection(reason, message, local=self.local, differences=differences,
                                   field=field, include_metadata=include_metadata,
                                   budget=requested_budget(context.invocation_metadata()))
        context.set_trailing_metadata(((REJECTION_KEY, trailer),))
        context.abort(code, status_details(message))


_SERVING = health_pb2.HealthCheckResponse.ServingStatus.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.ServingStatus.NOT_SERVING


class GatedHealth(health.HealthServicer):
    """The health service of a daemon that may have no pools (``--pools engine``).

    Reports SERVING only while ``ready()`` (pools attached) and the server asked for
    SERVING; :meth:`refresh` re-evaluates after an attach or a detach.

    Args:
        ready: whether the daemon has pools now.
        services: the service names to start NOT_SERVING.
    """

    def __init__(self, ready: Callable[[], bool], services: Sequence[str]) -> None:
        super().__init__()
        self._ready = ready
        self._wanted: dict[str, Any] = {}
        self._gate = threading.Lock()  # leaf: orders set() and refresh()
        for name in services:
            self.set(name, _NOT_SERVING)

    def set(self, service: str, status: Any) -> None:
        """Record the server's wish; publish it, gated by ``ready()``."""
        with self._gate:
            self._wanted[service] = status
            gated = status if status != _SERVING or self._ready() else _NOT_SERVING
            super().set(service, gated)

    def refresh(self) -> None:
        """Publish every service's status again (the pools came or went)."""
        with self._gate:
            wanted = dict(self._wanted)
        for service, status in wanted.items():
            self.set(service, status)
