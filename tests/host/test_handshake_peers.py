"""The handshake against unreachable, silent and foreign peers, and the control server itself."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvbeam.errors import (
    ListenError,
    NotKvbeamPeerError,
    PeerTimeoutError,
    PeerUnavailableError,
)
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.service import control_stub
from kvbeam.proto.side import SideInfo
from kvbeam.proto.version import SERVICE_NAME
from kvbeam.server.api.control import ControlServer
from kvbeam.server.peers.client import ControlClient, handshake
from kvbeam.server.settings import ControlOptions
from tests.control_helpers import (
    free_port,
    running,
)
from tests.waiting import wait_until

FAST = ControlOptions(rpc_timeout_s=0.5)

FAST = ControlOptions(rpc_timeout_s=0.5)


# ---- unreachable, silent and foreign peers --------------------------------------
#: What an HTTP/2 client (gRPC's) sends first on a connection (RFC 9113, 3.4).
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@dataclass
class SilentPeer:
    """A TCP listener that accepts connections and never says a word."""

    address: str
    accepted: list[socket.socket]

    def heard(self, want: int, timeout: float = 5.0) -> bytes:
        """Up to ``want`` bytes sent to the first connection it accepted (what came
        within ``timeout`` of waiting for it and them)."""
        assert wait_until(lambda: self.accepted, timeout), "no connection came"
        conn, got = self.accepted[0], b""
        conn.settimeout(timeout)
        with suppress(OSError):  # a timeout, or the client's reset
            while len(got) < want:
                chunk = conn.recv(want - len(got))
                if not chunk:
                    break
                got += chunk
        return got


@pytest.fixture
def silent_peer() -> Iterator[SilentPeer]:
    """A TCP listener that accepts connections and never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield SilentPeer(f"127.0.0.1:{listener.getsockname()[1]}", accepted)
    stop.set()
    thread.join(2)
    for conn in accepted:
        conn.close()
    listener.close()


def test_silent_peer_hits_the_deadline(prefill: SideInfo, silent_peer: SilentPeer) -> None:
    with pytest.raises(PeerTimeoutError) as info:
        handshake(prefill, silent_peer.address, options=FAST)
    # The deadline that ended the call is the one it was given (FAST's 0.5 s), not
    # another, ...
    assert "no answer within 0.5 s (deadline exceeded)" in str(info.value), info.value
    assert info.value.code == "DEADLINE_EXCEEDED"
    # ... and this peer's silence ran it out: the call connected to it and spoke
    # (HTTP/2), and heard nothing back; not a timeout raised without reaching the peer.
    assert silent_peer.heard(len(H2_PREFACE)) == H2_PREFACE


def test_nobody_listening(prefill: SideInfo) -> None:
    with pytest.raises(PeerUnavailableError) as info:
        handshake(prefill, f"127.0.0.1:{free_port()}", options=FAST)
    assert info.value.code == "UNAVAILABLE"


@contextmanager
def foreign_grpc(*handlers: grpc.GenericRpcHandler[Any, Any],
                 with_health: bool = False) -> Iterator[str]:
    """A plain gRPC server (not kvbeam's) on loopback; its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=list(handlers))
    if with_health:
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_non_kvbeam_grpc_server(prefill: SideInfo) -> None:
    with foreign_grpc(with_health=True) as address, \
            pytest.raises(NotKvbeamPeerError, match="not a kvbeam daemon"):
        handshake(prefill, address, options=FAST)


def test_grpc_server_answering_garbage(prefill: SideInfo) -> None:
    def garbage(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b"\x0a\xff\x01"  # a length prefix that runs past the end

    handler = grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Handshake": grpc.unary_unary_rpc_method_handler(garbage)})
    with foreign_grpc(handler) as address, pytest.raises(NotKvbeamPeerError, match="not a kvbeam"):
        handshake(prefill, address, options=FAST)


def test_http1_server(prefill: SideInfo) -> None:
    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    web = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=web.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises((NotKvbeamPeerError, PeerTimeoutError)):
            handshake(prefill, f"127.0.0.1:{web.server_address[1]}", options=FAST)
    finally:
        web.shutdown()
        web.server_close()


# ---- the server itself ------------------------------------------------------------
def test_health_and_unimplemented_rpcs(decode: SideInfo) -> None:
    server = ControlServer(decode)
    check = health_pb2.HealthCheckRequest
    server.start()
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            status = stub.Check(check(service=name), timeout=2).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        control = control_stub(channel)
        calls: list[Callable[[], object]] = [
            lambda: control.Reserve(pb.ReserveRequest(request_id="r"), timeout=2),
            lambda: control.Send(pb.SendRequest(request_id="r"), timeout=2),
            lambda: control.Status(pb.StatusRequest(request_id="r"), timeout=2),
            lambda: list(control.WatchStatus(pb.StatusRequest(request_id="r"), timeout=2)),
            lambda: control.Abort(pb.AbortRequest(request_id="r"), timeout=2),
            lambda: control.Heartbeat(pb.HeartbeatRequest(), timeout=2),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
    server.stop(grace=0)
    response = server.health.Check(check(service=SERVICE_NAME), None)  # type: ignore[arg-type]
    assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING
    server.stop()  # idempotent


def test_port_in_use_is_a_listen_error(decode: SideInfo) -> None:
    with running(decode) as first:
        second = ControlServer(decode)
        with pytest.raises(ListenError, match="cannot listen"):
            second.start(first.address)


def test_start_twice_is_a_bug(decode: SideInfo) -> None:
    with running(decode) as server, pytest.raises(RuntimeError):
        server.start()


def test_client_reuses_its_channel(prefill: SideInfo, decode: SideInfo) -> None:
    with running(decode) as server, ControlClient(server.address) as client:
        first = client.handshake(prefill)
        second = client.handshake(prefill)
        assert first.instance_id == second.instance_id == decode.instance_id
        assert client.timeout == ControlOptions().rpc_timeout_s


def test_options_are_validated() -> None:
    with pytest.raises(ValueError):
        ControlOptions(rpc_timeout_s=0)
    with pytest.raises(ValueError):
        ControlOptions(max_workers=0)
