"""Control-plane errors: why a handshake or an RPC to a peer failed.

Pool differences raise :class:`kvbeam.errors.PoolCompatibilityError`, a malformed
message :class:`kvbeam.proto.errors.ProtocolError` and a version mismatch
:class:`kvbeam.proto.errors.ProtocolVersionError`; everything else about reaching
and talking to a peer is a :class:`PeerError`. Each message says what to check.
"""

from __future__ import annotations

from kvbeam.errors import KvbeamError


class PeerError(KvbeamError):
    """Talking to a peer's control server failed.

    ``address`` is the peer's control address; ``code`` the gRPC status name
    (e.g. ``DEADLINE_EXCEEDED``) when the failure came from gRPC.
    """

    def __init__(self, message: str, *, address: str = "", code: str | None = None) -> None:
        super().__init__(message)
        self.address = address
        self.code = code


class PeerTimeoutError(PeerError):
    """The peer did not answer within the deadline (silent, overloaded or not a gRPC server)."""


class PeerUnavailableError(PeerError):
    """The peer cannot be reached (connection refused, reset, DNS failure)."""


class NotKvbeamPeerError(PeerError):
    """Something answers at the address, but it is not a kvbeam v1 control server."""


class AuthenticationError(PeerError):
    """The peer refused our credentials (UNAUTHENTICATED), or the TLS handshake failed.

    Neither side learned anything from the other: the refusal comes before any
    servicer code runs (token) or before any RPC exists (mTLS).
    """


class HandshakeRejectedError(PeerError):
    """The peer refused the handshake for a reason other than pool differences or version,
    e.g. it found our metadata malformed. ``field`` names the field it objected to."""

    def __init__(self, message: str, *, address: str = "", code: str | None = None,
                 field: str = "") -> None:
        super().__init__(message, address=address, code=code)
        self.field = field


class RoleConflictError(PeerError):
    """Both sides of a handshake have the same role (two prefills or two decodes)."""


class NotHandshakenError(KvbeamError):
    """A transfer names a peer instance that has no successful handshake with this side."""


class ListenError(KvbeamError):
    """The control server cannot listen on the requested address."""
