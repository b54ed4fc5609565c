"""Typed access to the generated gRPC stub and servicer registration.

``kvbeam_pb2_grpc.py`` is generated without annotations; these wrappers give
the rest of the code (and ``mypy --strict``) a typed view of the same objects.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, cast

import grpc
from google.protobuf.message import DecodeError, Message

from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2_grpc as pb_grpc
from kvbeam.proto.version import SERVICE_NAME

log = logging.getLogger(__name__)


class ControlStub(Protocol):
    """The client stub of ``kvbeam.v1.KvbeamControl``, typed."""

    Handshake: grpc.UnaryUnaryMultiCallable[pb.HandshakeRequest, pb.HandshakeResponse]
    Reserve: grpc.UnaryUnaryMultiCallable[pb.ReserveRequest, pb.ReserveResponse]
    Send: grpc.UnaryUnaryMultiCallable[pb.SendRequest, pb.TransferStatus]
    Status: grpc.UnaryUnaryMultiCallable[pb.StatusRequest, pb.TransferStatus]
    WatchStatus: grpc.UnaryStreamMultiCallable[pb.StatusRequest, pb.TransferStatus]
    Abort: grpc.UnaryUnaryMultiCallable[pb.AbortRequest, pb.TransferStatus]
    Heartbeat: grpc.UnaryUnaryMultiCallable[pb.HeartbeatRequest, pb.HeartbeatResponse]
    Release: grpc.UnaryUnaryMultiCallable[pb.ReleaseRequest, pb.TransferStatus]
    Connect: grpc.UnaryUnaryMultiCallable[pb.ConnectRequest, pb.ConnectResponse]


def control_stub(channel: grpc.Channel) -> ControlStub:
    """A typed ``KvbeamControlStub`` on ``channel``."""
    return cast(ControlStub, pb_grpc.KvbeamControlStub(channel))  # type: ignore[no-untyped-call]


def add_control_servicer(servicer: pb_grpc.KvbeamControlServicer, server: grpc.Server) -> None:
    """Register a KvbeamControl servicer on ``server``.

    Requests arrive as raw bytes and are parsed here, not by gRPC: gRPC answers a
    request it cannot deserialize with INTERNAL ("Exception deserializing request!"),
    which reads like our bug. Malformed bytes are the caller's, so they get
    INVALID_ARGUMENT naming the method and the expected message type.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in pb.DESCRIPTOR.services_by_name["KvbeamControl"].methods:
        request_type: type[Message] = getattr(pb, method.input_type.name)
        response_type: type[Message] = getattr(pb, method.output_type.name)
        behaviour = _parsing(method.name, request_type, getattr(servicer, method.name))
        make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(behaviour, request_deserializer=None,
                                     response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _parsing(name: str, request_type: type[Message],
             behaviour: Callable[[Any, grpc.ServicerContext], Any]
             ) -> Callable[[bytes, grpc.ServicerContext], Any]:
    """Wrap a servicer method so it receives the parsed request, or the caller gets
    INVALID_ARGUMENT for bytes that are not a ``request_type``."""

    def handle(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = request_type.FromString(raw)
        except DecodeError as exc:
            log.info("%s refused: INVALID_ARGUMENT: malformed request (%d bytes): %s",
                     name, len(raw), exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"malformed {name} request: not a valid "
                          f"{request_type.DESCRIPTOR.full_name} ({exc})")
        return behaviour(request, context)

    return handle
