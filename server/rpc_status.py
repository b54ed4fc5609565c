"""Map kvbeam errors raised inside an RPC handler to gRPC status codes, with clear details.

Every transfer RPC runs under :func:`handled`: a bad request becomes a clear
INVALID_ARGUMENT / NOT_FOUND / ALREADY_EXISTS / RESOURCE_EXHAUSTED answer and the
daemon stays up; an unexpected exception is logged with its traceback and
answered INTERNAL.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import grpc

from kvbeam.errors import ConfigError, KvbeamError, PlanError
from kvbeam.proto.errors import ProtocolError
from kvbeam.server.errors import NotHandshakenError, PeerError
from kvbeam.server.lifecycle import DuplicateRequest, IllegalTransition, TooManyTransfers
from kvbeam.server.logs import fields
from kvbeam.server.slots import NoFreeSlot

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class UnknownRequest(KvbeamError):
    """A request id this side does not know (never created, or forgotten long ago)."""


class BadRequest(KvbeamError):
    """A request message that is well-formed protobuf but asks for something invalid."""


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (DuplicateRequest, grpc.StatusCode.ALREADY_EXISTS),
    (TooManyTransfers, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoFreeSlot, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnknownRequest, grpc.StatusCode.NOT_FOUND),
    (NotHandshakenError, grpc.StatusCode.FAILED_PRECONDITION),
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


def abort(context: grpc.ServicerContext, exc: BaseException, method: str,
          request: Any = None) -> NoReturn:
    """Abort the RPC with the status for ``exc``; the log line names the request and peer."""
    code = code_for(exc)
    extra = _log_fields(request, context)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed unexpectedly", method, extra=extra)
    else:
        log.info("%s refused: %s: %s", method, code.name, exc, extra=extra)
    context.abort(code, f"{type(exc).__name__}: {exc}")


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
