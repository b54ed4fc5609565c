"""The one mapping between kvbeam errors and gRPC status codes, both directions.

Server side: every RPC handler runs under :func:`handled`, which answers a kvbeam
error with the status :func:`code_for` gives it (a bad request becomes a clear
INVALID_ARGUMENT / NOT_FOUND / ALREADY_EXISTS / RESOURCE_EXHAUSTED answer and the
daemon stays up); an unexpected exception is logged with its traceback and
answered INTERNAL.

Client side: :func:`peer_error` turns a failed call to a peer's control server
(a handshake, a daemon-to-daemon RPC) into a typed :class:`~kvbeam.errors.PeerError`
with an actionable message; :func:`request_error` does the same for the public
client's transfer RPCs, mapping the statuses :func:`handled` produces back to
:class:`~kvbeam.errors.Busy`, :class:`~kvbeam.errors.UnknownRequest`, ...

The error classes themselves live in :mod:`kvbeam.errors`, which imports no gRPC;
docs/errors.md tabulates both directions.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import grpc

from kvbeam.errors import (
    AuthenticationError,
    BadRequest,
    Busy,
    ConfigError,
    DuplicateRequest,
    IllegalTransition,
    KvbeamError,
    NoEngineAttached,
    NoFreeSlot,
    NotHandshakenError,
    NotKvbeamPeerError,
    PeerChannelError,
    PeerError,
    PeerTimeoutError,
    PeerUnavailableError,
    PlanError,
    ProtocolError,
    TooManyTransfers,
    UnknownRequest,
)
from kvbeam.logs import fields

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


# --- server side: a kvbeam error -> a status ---

#: First match wins: subclasses before their bases.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (DuplicateRequest, grpc.StatusCode.ALREADY_EXISTS),
    (TooManyTransfers, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoFreeSlot, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnknownRequest, grpc.StatusCode.NOT_FOUND),
    (NotHandshakenError, grpc.StatusCode.FAILED_PRECONDITION),
    # --pools engine: no engine memory attached (kvbeam.server.engines.attach)
    (NoEngineAttached, grpc.StatusCode.FAILED_PRECONDITION),
    (IllegalTransition, grpc.StatusCode.FAILED_PRECONDITION),
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (PlanError, grpc.StatusCode.INVALID_ARGUMENT),
    (ProtocolError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (PeerError, grpc.StatusCode.UNAVAILABLE),
)


def code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code for a kvbeam error (INTERNAL for anything unexpected)."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def refusal(exc: BaseException, method: str, extra: dict[str, str]) -> tuple[grpc.StatusCode, str]:
    """The status and details that answer ``exc`` (an RPC's or a peer channel request's),
    logged once: an unexpected exception with its traceback, a refusal as one line."""
    code = code_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed unexpectedly", method, extra=extra)
    else:
        log.info("%s refused: %s: %s", method, code.name, exc, extra=extra)
    return code, f"{type(exc).__name__}: {exc}"


def abort(context: grpc.ServicerContext, exc: BaseException, method: str,
          request: Any = None) -> NoReturn:
    """Abort the RPC with the status for ``exc``; the log line names the request and peer."""
    context.abort(*refusal(exc, method, _log_fields(request, context)))


def _log_fields(request: Any, context: grpc.ServicerContext) -> dict[str, str]:
    """Request id and peer of a refused RPC: the peer daemon the request names, else the caller."""
    rid = getattr(request, "request_id", None)
    peer = getattr(request, "prefill_address", "") or getattr(request, "decode_address", "")
    if not peer:
        try:
            peer = context.peer()
        except Exception:  # a test double without peer(): the line still gets logged
            peer = ""
    return fields(rid if isinstance(rid, str) and rid else None,
                  peer if isinstance(peer, str) and peer else None)


def handled(method: F) -> F:
    """Decorator for servicer methods: kvbeam errors -> status codes; the daemon stays up."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:  # every failure becomes a status; nothing kills the server
            # Handlers never call context.abort themselves (they raise kvbeam errors),
            # so every exception here is one to translate exactly once.
            refused = getattr(self, "on_refused", None)
            if refused is not None:
                refused(method.__name__, code_for(exc))
            abort(context, exc, method.__name__, request)

    return wrapper  # type: ignore[return-value]


# --- client side: a failed call -> a kvbeam error ---

def request_error(exc: grpc.RpcError, *, address: str, method: str,
                  timeout: float) -> KvbeamError:
    """The kvbeam error for a failed transfer RPC (Reserve, Send, Status, ...) to a daemon.

    The inverse of :func:`code_for` for the statuses a request can earn; anything
    else (deadline, unreachable, not a kvbeam daemon) is :func:`peer_error`'s.
    """
    code, details = exc.code(), exc.details() or ""
    where = f"{method} on {address}"
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Busy(f"{where}: {details}")
    if code is grpc.StatusCode.NOT_FOUND:
        return UnknownRequest(f"{where}: {details}")
    if code is grpc.StatusCode.ALREADY_EXISTS:
        return DuplicateRequest(f"{where}: {details}")
    if code is grpc.StatusCode.FAILED_PRECONDITION and "NoEngineAttached" in details:
        return NoEngineAttached(f"{where}: {details}")
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
        return BadRequest(f"{where}: {details}")
    return peer_error(exc, address=address, method=method, timeout=timeout)


def peer_error(exc: grpc.RpcError | PeerChannelError, *, address: str, method: str,
               timeout: float) -> KvbeamError:
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
