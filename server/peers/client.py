"""The client side of the control protocol: handshake with a peer's control server.

:meth:`ControlClient.handshake` sends our SideInfo, and verifies whatever comes
back itself: the server's side on success, or the server's metadata carried by
its rejection, so both ends run the same checks and log the same differences.
Every call has a deadline (:attr:`ControlOptions.rpc_timeout_s`): a silent peer
costs at most that long.
"""

from __future__ import annotations

import dataclasses
import logging

import grpc

from kvbeam.control_channel import ControlChannel
from kvbeam.errors import (
    Difference,
    HandshakeRejectedError,
    KvbeamError,
    PeerError,
    ProtocolError,
    ProtocolVersionError,
    RoleConflictError,
)
from kvbeam.pools.checks import compare_sides
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.rejection_codec import (
    BUDGET_KEY,
    MAX_REJECTION_BYTES,
    Reason,
    Rejection,
    decode_rejection,
    find_rejection,
)
from kvbeam.proto.side import Role, SideEncoder, SideInfo, side_from_proto
from kvbeam.proto.version import PROTOCOL_VERSION
from kvbeam.rpc_errors import peer_error
from kvbeam.server.settings import ControlOptions
from kvbeam.server.state.handshake import (
    VerifiedPeer,
    incompatibility_error,
    log_differences,
    verify_peer,
)
from kvbeam.transport.endpoint import Endpoint

log = logging.getLogger(__name__)


class ControlClient(ControlChannel):
    """A channel to one peer's control server. Close it (or use ``with``) when done.

    Args:
        address: the peer's control address, ``host:port``.
        options: deadlines, size limits and credentials (``options.security``).
    """

    def __init__(self, address: str, *, options: ControlOptions | None = None) -> None:
        self.options = options or ControlOptions()
        super().__init__(address, timeout=self.options.rpc_timeout_s,
                         security=self.options.security,
                         channel_options=self.options.grpc_options())
        # Base64 inflates a "-bin" trailer by 4/3; leave room for the other headers.
        self._budget = min(MAX_REJECTION_BYTES, self.options.max_metadata_bytes // 2)
        self._encoder: SideEncoder | None = None

    def handshake(self, local: SideInfo, *, endpoint: Endpoint | None = None) -> VerifiedPeer:
        """Exchange sides with the peer and verify the pair on this side too.

        Args:
            local: our side.
            endpoint: the endpoint to send this peer, when it differs from
                ``local.endpoint`` (a per-peer RDMA link).

        Returns:
            The verified peer, required by every transfer API.

        Raises:
            PoolCompatibilityError: the pools differ (``differences`` lists all).
            ProtocolVersionError: the peer speaks another protocol version.
            ProtocolError: the peer's answer is malformed (field named).
            RoleConflictError: both sides have the same role.
            HandshakeRejectedError: the peer refused our metadata as malformed.
            PeerTimeoutError, PeerUnavailableError, NotKvbeamPeerError, PeerError:
                the peer could not be reached or is not a kvbeam daemon.
        """
        sent = local if endpoint is None else dataclasses.replace(local, endpoint=endpoint)
        if self._encoder is None or self._encoder.side is not local:
            self._encoder = SideEncoder(local)  # validates our metadata once per side
        request = pb.HandshakeRequest(side=self._encoder.encode(endpoint))
        try:
            reply = self.stub.Handshake(request, timeout=self.timeout,
                                        metadata=((BUDGET_KEY, str(self._budget)),))
        except grpc.RpcError as exc:
            raise self._refusal(exc, sent) from None
        try:
            peer = side_from_proto(reply.side, "side")
        except ProtocolVersionError as exc:
            log.error("handshake with %s refused: %s", self.address, exc)
            raise exc.from_origin(f"handshake reply from {self.address}") from None
        except ProtocolError as exc:
            log.error("handshake with %s refused: malformed reply: %s", self.address, exc)
            raise exc.from_origin(f"handshake reply from {self.address}") from None
        return verify_peer(sent, peer, address=self.address)

    # ---- refusals -------------------------------------------------------------
    def _refusal(self, exc: grpc.RpcError, sent: SideInfo) -> KvbeamError:
        """The typed error for a failed Handshake call."""
        raw = find_rejection(exc.trailing_metadata())
        if raw is None:
            err = peer_error(exc, address=self.address, method="Handshake",
                             timeout=self.timeout)
            log.error("handshake with %s failed: %s", self.address, err)
            return err
        try:
            rejection = decode_rejection(raw)
        except ProtocolError as perr:
            log.error("handshake with %s refused with a malformed rejection: %s",
                      self.address, perr)
            return perr.from_origin(f"handshake rejection from {self.address}")
        code = exc.code().name if exc.code() is not None else "UNKNOWN"
        return self._typed_rejection(rejection, sent, code)

    def _typed_rejection(self, r: Rejection, sent: SideInfo, code: str) -> KvbeamError:
        who = f"{r.role.value if r.role else 'peer'} {r.instance_id or '?'} at {self.address}"
        if r.reason == Reason.REJECT_REASON_INCOMPATIBLE_POOLS:
            diffs = self._both_verdicts(r, sent)
            if diffs:
                log_differences(log, f"handshake with {who} refused", diffs)
                return incompatibility_error(diffs, who)
            # Nothing to show: neither its list nor our own comparison has a difference.
        if r.reason == Reason.REJECT_REASON_PROTOCOL_VERSION:
            log.error("handshake with %s refused: %s", who, r.message)
            return ProtocolVersionError(PROTOCOL_VERSION, r.protocol_version,
                                        origin=f"handshake with {who}")
        if r.reason == Reason.REJECT_REASON_ROLE_CONFLICT:
            log.error("handshake with %s refused: %s", who, r.message)
            return RoleConflictError(
                f"handshake with {who} refused: both sides are {sent.role.value}; a handshake "
                "pairs a prefill daemon with a decode daemon", address=self.address, code=code)
        if r.reason == Reason.REJECT_REASON_INVALID_METADATA:
            log.error("handshake with %s refused our metadata: %s", who, r.message)
            return HandshakeRejectedError(
                f"handshake with {who} refused: the peer finds our metadata malformed: "
                f"{r.message}", address=self.address, code=code, field=r.field)
        log.error("handshake with %s refused (reason %d): %s", who, r.reason, r.message)
        return PeerError(f"handshake with {who} refused: {code}: {r.message}",
                         address=self.address, code=code)

    def _both_verdicts(self, r: Rejection, sent: SideInfo) -> list[Difference]:
        """Our own differences against the server's metadata, plus any it found that we did not.

        Both sides run the same checks on the same layouts, so the lists normally
        coincide; the union keeps a difference that only one build detects.
        """
        ours: list[Difference] = []
        if r.layout is not None:
            ours = (compare_sides(sent.layout, r.layout) if sent.role is Role.PREFILL
                    else compare_sides(r.layout, sent.layout))
        seen = {(d.field, d.side, d.message) for d in ours}
        return ours + [d for d in r.differences if (d.field, d.side, d.message) not in seen]


def handshake(local: SideInfo, address: str, *, endpoint: Endpoint | None = None,
              options: ControlOptions | None = None) -> VerifiedPeer:
    """One-shot :meth:`ControlClient.handshake` on a fresh channel (closed afterwards)."""
    with ControlClient(address, options=options) as client:
        return client.handshake(local, endpoint=endpoint)
