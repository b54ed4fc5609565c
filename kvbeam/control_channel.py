"""A channel to one daemon's control server: what every client of ``kvbeam.v1`` shares.

Two clients call ``KvbeamControl``: the scheduler's :class:`kvbeam.client.KvbeamClient`
(Reserve, Send, Status, Abort, Release, Heartbeat) and a daemon's client of its peer,
:class:`kvbeam.server.peers.client.ControlClient` (Handshake, and decode's Connect in
:mod:`kvbeam.server.peers.calls`; everything else between daemons goes over the peer
channel). Both are a :class:`ControlChannel`: the channel opened
with the caller's credentials (:meth:`kvbeam.auth.Security.channel`, the one place
that builds them) and channel options, the typed stub, the deadline every call gets,
``close``/``with``, and the gRPC health service. What a failed call means is
:mod:`kvbeam.rpc_errors`' (``request_error`` for a request's RPCs, ``peer_error`` for
the rest); what the messages hold is :mod:`kvbeam.proto.transfer_codec`'s.

Never imports ``kvbeam.server``: a scheduler process imports the client only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbeam.auth import Security
from kvbeam.proto.service import control_stub


def serving(channel: grpc.Channel, timeout: float) -> bool:
    """True when the gRPC health service on ``channel`` answers SERVING within ``timeout``."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.ServingStatus.SERVING)


class ControlChannel:
    """A channel to one daemon's control server. Close it (or use ``with``) when done.

    Args:
        address: the daemon's control address, ``host:port``.
        timeout: the deadline of each call, seconds.
        security: credentials (mTLS and/or token) the daemon requires; default none.
        channel_options: gRPC channel arguments (message and metadata size limits).
    """

    def __init__(self, address: str, *, timeout: float,
                 security: Security | None = None,
                 channel_options: Sequence[tuple[str, Any]] = ()) -> None:
        self.address = address
        self.timeout = timeout
        self.security = security or Security()
        self.channel = self.security.channel(address, channel_options)
        self.stub = control_stub(self.channel)

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def healthy(self, timeout: float | None = None) -> bool:
        """True when the daemon's gRPC health service answers SERVING."""
        return serving(self.channel, timeout or self.timeout)

    def wait_healthy(self, timeout: float) -> bool:
        """Poll :meth:`healthy` until it is or ``timeout`` passes."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.healthy(timeout=1.0):
                return True
            time.sleep(0.1)
        return False
