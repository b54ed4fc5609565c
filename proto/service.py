"""Typed access to the generated gRPC stub and servicer registration.

``kvbeam_pb2_grpc.py`` is generated without annotations; these wrappers give
the rest of the code (and ``mypy --strict``) a typed view of the same objects.
"""

from __future__ import annotations

from typing import Protocol, cast

import grpc

from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2_grpc as pb_grpc


class ControlStub(Protocol):
    """The client stub of ``kvbeam.v1.KvbeamControl``, typed."""

    Handshake: grpc.UnaryUnaryMultiCallable[pb.HandshakeRequest, pb.HandshakeResponse]
    Reserve: grpc.UnaryUnaryMultiCallable[pb.ReserveRequest, pb.ReserveResponse]
    Send: grpc.UnaryUnaryMultiCallable[pb.SendRequest, pb.TransferStatus]
    Status: grpc.UnaryUnaryMultiCallable[pb.StatusRequest, pb.TransferStatus]
    WatchStatus: grpc.UnaryStreamMultiCallable[pb.StatusRequest, pb.TransferStatus]
    Abort: grpc.UnaryUnaryMultiCallable[pb.AbortRequest, pb.TransferStatus]
    Heartbeat: grpc.UnaryUnaryMultiCallable[pb.HeartbeatRequest, pb.HeartbeatResponse]
    BeginWrite: grpc.UnaryUnaryMultiCallable[pb.BeginWriteRequest, pb.BeginWriteResponse]
    Release: grpc.UnaryUnaryMultiCallable[pb.ReleaseRequest, pb.TransferStatus]


def control_stub(channel: grpc.Channel) -> ControlStub:
    """A typed ``KvbeamControlStub`` on ``channel``."""
    return cast(ControlStub, pb_grpc.KvbeamControlStub(channel))  # type: ignore[no-untyped-call]


def add_control_servicer(servicer: pb_grpc.KvbeamControlServicer, server: grpc.Server) -> None:
    """Register a KvbeamControl servicer on ``server``."""
    pb_grpc.add_KvbeamControlServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
