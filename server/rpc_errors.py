"""Turn a failed gRPC call to a peer into a typed kvbeam error with an actionable message."""

from __future__ import annotations

import grpc

from kvbeam.errors import KvbeamError
from kvbeam.server.errors import (
    AuthenticationError,
    NotKvbeamPeerError,
    PeerError,
    PeerTimeoutError,
    PeerUnavailableError,
)


def peer_error(exc: grpc.RpcError, *, address: str, method: str, timeout: float) -> KvbeamError:
    """The kvbeam error for a gRPC failure that is not a structured kvbeam rejection.

    Args:
        exc: the error the stub raised.
        address: the peer's control address.
        method: the RPC name, e.g. ``Handshake``.
        timeout: the deadline the call had, seconds.
    """
    code = exc.code()
    details = exc.details() or ""
    name = code.name if code is not None else "UNKNOWN"
    where = f"{method} to {address}"
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return PeerTimeoutError(
            f"{where}: no answer within {timeout:g} s (deadline exceeded): the peer is silent, "
            "overloaded or not a gRPC server; check that the address is the peer's kvbeam "
            "control port", address=address, code=name)
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return NotKvbeamPeerError(
            f"{where}: the peer does not serve kvbeam.v1.KvbeamControl/{method} ({details}): it "
            "is not a kvbeam daemon, or a kvbeam of another major protocol version",
            address=address, code=name)
    lowered = details.lower()
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(
            f"{where}: the peer refused our credentials (UNAUTHENTICATED: {details}); give "
            "this side the token the peer requires (--auth-token, --auth-token-file or "
            "KVBEAM_AUTH_TOKEN)", address=address, code=name)
    if code is grpc.StatusCode.UNAVAILABLE and any(
            w in lowered for w in ("tls handshake", "ssl", "certificate", "verification check")):
        return AuthenticationError(
            f"{where}: TLS handshake failed ({details}); both sides need --tls-cert/--tls-key "
            "signed by the CA the other side trusts (--tls-ca), with the dialled host (or "
            "--tls-server-name) in the server certificate", address=address, code=name)
    if code is grpc.StatusCode.UNAVAILABLE and ("http1" in lowered.replace(".", "")
                                                or "failed parsing http/2" in lowered):
        return NotKvbeamPeerError(
            f"{where}: the peer does not speak gRPC (HTTP/2): {details}; it is not a kvbeam "
            "control server (wrong port?)", address=address, code=name)
    if code is grpc.StatusCode.UNAVAILABLE:
        # A server requiring mTLS closes the connection of a client without a valid certificate.
        hint = ("; if it requires mTLS, give this side --tls-cert/--tls-key/--tls-ca from its CA"
                if "socket closed" in lowered else "")
        return PeerUnavailableError(
            f"{where}: peer unavailable ({details}); check that its daemon runs and listens "
            f"on that address{hint}", address=address, code=name)
    if code is grpc.StatusCode.INTERNAL and "deserializ" in lowered:
        return NotKvbeamPeerError(
            f"{where}: the peer's reply is not a kvbeam.v1 message ({details}): it is not a "
            "kvbeam daemon", address=address, code=name)
    return PeerError(f"{where} failed: {name}: {details}", address=address, code=name)
