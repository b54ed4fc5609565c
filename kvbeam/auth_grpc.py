"""The gRPC half of :mod:`kvbeam.auth`: server credentials, the token interceptors, channels.

Only processes that serve or dial gRPC import this (the daemons, the scheduler API's
clients), through :class:`kvbeam.auth.Security`'s ``server_credentials()``,
``server_interceptors()`` and ``channel()``, which are the way to use it. Engines attached
over the engine channel read their credentials with :mod:`kvbeam.auth` and never import
gRPC (tests/host/test_sglang_auth.py checks sglang's process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from kvbeam.auth import EXEMPT_PREFIX, TOKEN_KEY, TOKEN_SCHEME, Security, same_token

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # grpc's runtime classes are not generic; grpc-stubs' are
    Handler = grpc.RpcMethodHandler[Any, Any]
    ServerInterceptor = grpc.ServerInterceptor[Any, Any]
    _UU = grpc.UnaryUnaryClientInterceptor[Any, Any]
    _US = grpc.UnaryStreamClientInterceptor[Any, Any]
    _SU = grpc.StreamUnaryClientInterceptor[Any, Any]
    _SS = grpc.StreamStreamClientInterceptor[Any, Any]
else:
    Handler = grpc.RpcMethodHandler
    ServerInterceptor = grpc.ServerInterceptor
    _UU = grpc.UnaryUnaryClientInterceptor
    _US = grpc.UnaryStreamClientInterceptor
    _SU = grpc.StreamUnaryClientInterceptor
    _SS = grpc.StreamStreamClientInterceptor


def server_credentials(security: Security) -> grpc.ServerCredentials | None:
    """``security``'s mTLS server credentials that require a client certificate, or None
    (:meth:`Security.server_credentials`)."""
    if not security.tls:
        return None
    cert, key, ca = security.pem
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=True)


def server_interceptors(security: Security) -> list[ServerInterceptor]:
    """The token check, when ``security`` has a token (:meth:`Security.server_interceptors`)."""
    return [TokenInterceptor(security.token)] if security.token else []


def channel(security: Security, address: str,
            options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to ``address`` presenting ``security``'s credentials
    (:meth:`Security.channel`)."""
    opts = list(options)
    if security.tls_server_name:
        opts.append(("grpc.ssl_target_name_override", security.tls_server_name))
    if security.tls:
        cert, key, ca = security.pem
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                             certificate_chain=cert)
        dialled = grpc.secure_channel(address, creds, options=opts)
    else:
        dialled = grpc.insecure_channel(address, options=opts)
    if security.token:
        dialled = grpc.intercept_channel(dialled, _TokenClientInterceptor(security.token))
    return dialled


class TokenInterceptor(ServerInterceptor):
    """Answers UNAUTHENTICATED, before any servicer code runs, to calls without the token."""

    def __init__(self, token: str) -> None:
        self._expected = TOKEN_SCHEME + token

    def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
            handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        """Pass authenticated calls (and health checks) on; refuse the rest."""
        method = handler_call_details.method
        if method.startswith(EXEMPT_PREFIX):
            return continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        presented = [v for k, v in metadata if k == TOKEN_KEY]
        if len(presented) == 1 and same_token(presented[0], self._expected):
            return continuation(handler_call_details)
        why = "no auth token" if not presented else "a wrong auth token"
        return _deny(continuation(handler_call_details), method, why)


def _deny(real: Handler | None, method: str, why: str) -> Handler:
    """A handler of the same streaming shape as ``real`` that aborts UNAUTHENTICATED."""
    message = (f"kvbeam: {method} refused: {why}; this daemon requires the shared token "
               "(--auth-token / KVBEAM_AUTH_TOKEN)")

    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        log.warning("control RPC %s from %s refused: %s (UNAUTHENTICATED)", method,
                    context.peer(), why)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    streaming = (bool(real and real.request_streaming), bool(real and real.response_streaming))
    if streaming == (False, True):
        return grpc.unary_stream_rpc_method_handler(abort)
    if streaming == (True, False):
        return grpc.stream_unary_rpc_method_handler(abort)
    if streaming == (True, True):
        return grpc.stream_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: grpc.Metadata) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class _TokenClientInterceptor(_UU, _US, _SU, _SS):
    """Adds ``authorization: Bearer TOKEN`` to every call."""

    def __init__(self, token: str) -> None:
        self._header = (TOKEN_KEY, TOKEN_SCHEME + token)

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(details, (*(details.metadata or ()), self._header))

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                              request: Any) -> Any:
        """Add the token."""
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                               request: Any) -> Any:
        """Add the token."""
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                               request_iterator: Any) -> Any:
        """Add the token."""
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                request_iterator: Any) -> Any:
        """Add the token."""
        return continuation(self._details(client_call_details), request_iterator)
