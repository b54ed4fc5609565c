"""An Abort that claims to come from prefill, sent by someone else, through decode's
real gRPC servicer (issue 22, item 4): it is a scheduler's abort, so decode asks the
granted prefill to drain before the slot is freed, instead of freeing it at once
while prefill may still be writing into it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from kvbeam.auth import Security
from kvbeam.procs import wait_until
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.server.decode import DecodeServicer
from kvbeam.server.handshake import VerifiedPeer
from kvbeam.server.peer_rpc import Dialer
from kvbeam.server.peers import PeerConn
from kvbeam.server.runtime import Runtime
from kvbeam.server.settings import resolve
from kvbeam.transport import Link
from tests.core_fakes import FakeLink
from tests.fixtures import shipped_config

SERVICE = "kvbeam.v1.KvbeamControl"
PREFILL_INSTANCE = "prefill-real"


class Prefill:
    """A prefill's control server that answers decode's Abort only once released."""

    def __init__(self) -> None:
        self.aborts: list[pb.AbortRequest] = []
        self.release = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Abort": grpc.unary_unary_rpc_method_handler(
                self._abort, request_deserializer=pb.AbortRequest.FromString,
                response_serializer=pb.TransferStatus.SerializeToString)}),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> Any:
        self.aborts.append(request)
        self.release.wait(30)  # "draining"
        return pb.TransferStatus(request_id=request.request_id,
                                 state=pb.TRANSFER_STATE_FAILED)


@contextmanager
def _decode(env: dict[str, str] | None = None
            ) -> Iterator[tuple[DecodeServicer, str, Prefill]]:
    """Decode's real servicer (and its bound address), with one prefill instance as a
    verified, connected peer whose control server is ``Prefill``."""
    env = {"KVBEAM_CONFIG": shipped_config("decode"), "KVBEAM_LISTEN": "127.0.0.1:0",
           "KVBEAM_TRANSPORT": "tcp", "KVBEAM_RPC_TIMEOUT_S": "20",
           "KVBEAM_HEARTBEAT_S": "3600",  # the fake prefill answers no heartbeat
           **(env or {})}
    runtime = Runtime(resolve("decode", None, env))
    servicer = DecodeServicer(runtime)
    address = runtime.start(servicer)
    prefill = Prefill()
    # The prefill instance as a verified, connected peer (its link a fake: no bytes move).
    peer = SimpleNamespace(instance_id=PREFILL_INSTANCE, control_address=prefill.address,
                           layout=runtime.layout, endpoint=SimpleNamespace(regions=[]))
    runtime.peers.add(PeerConn(cast(VerifiedPeer, peer), cast(Link, FakeLink()),
                               Dialer(runtime.options)))
    try:
        yield servicer, address, prefill
    finally:
        prefill.release.set()
        prefill.server.stop(0)
        runtime.stop(grace=0.5)


@pytest.fixture
def decode() -> Iterator[tuple[DecodeServicer, grpc.Channel, Prefill]]:
    with _decode() as (servicer, address, prefill):
        channel = grpc.insecure_channel(address)
        try:
            yield servicer, channel, prefill
        finally:
            channel.close()


def _call(channel: grpc.Channel, method: str, reply: Any) -> Any:
    return channel.unary_unary(f"/{SERVICE}/{method}",
                               request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=reply.FromString)


def test_an_impersonated_prefill_abort_does_not_free_a_slot_prefill_may_write(
        decode: tuple[DecodeServicer, grpc.Channel, Prefill]) -> None:
    servicer, channel, prefill = decode
    _call(channel, "Reserve", pb.ReserveResponse)(
        pb.ReserveRequest(request_id="victim", seq_len=100, prefill_address=prefill.address),
        timeout=10)
    # Prefill's BeginWrite (a peer channel request: no such RPC), straight to the core.
    servicer.decode.begin_write("victim", PREFILL_INSTANCE, 100, True, False)  # may write now
    slot = servicer.decode.slot_of("victim")
    assert slot != -1
    st = _call(channel, "Abort", pb.TransferStatus)(
        pb.AbortRequest(request_id="victim", detail="prefill failed (not really)",
                        from_peer=True, instance_id="intruder"), timeout=10)
    assert st.state == pb.TRANSFER_STATE_FAILED
    assert st.failure_reason == pb.FAILURE_REASON_ABORTED  # a scheduler's abort
    # Held until the real prefill confirms its writes drained.
    assert wait_until(lambda: len(prefill.aborts) == 1, 10), "prefill was not asked to drain"
    assert servicer.decode.slot_of("victim") == slot, "slot freed before prefill drained"
    asked = prefill.aborts[0]
    assert asked.from_peer and asked.instance_id == servicer.local.instance_id
    prefill.release.set()
    assert wait_until(lambda: servicer.decode.slot_of("victim") == -1, 10)


def test_the_granted_prefills_own_abort_frees_at_once(
        decode: tuple[DecodeServicer, grpc.Channel, Prefill]) -> None:
    servicer, channel, prefill = decode
    _call(channel, "Reserve", pb.ReserveResponse)(
        pb.ReserveRequest(request_id="own", seq_len=100, prefill_address=prefill.address),
        timeout=10)
    # Prefill's BeginWrite (a peer channel request: no such RPC), straight to the core.
    servicer.decode.begin_write("own", PREFILL_INSTANCE, 100, True, False)
    st = _call(channel, "Abort", pb.TransferStatus)(
        pb.AbortRequest(request_id="own", detail="prefill failed: drained",
                        from_peer=True, instance_id=PREFILL_INSTANCE), timeout=10)
    assert st.failure_reason == pb.FAILURE_REASON_PEER_FAILED
    assert servicer.decode.slot_of("own") == -1 and prefill.aborts == []


def _reserve_and_grant(servicer: DecodeServicer, channel: grpc.Channel, rid: str,
                       prefill: Prefill) -> None:
    _call(channel, "Reserve", pb.ReserveResponse)(
        pb.ReserveRequest(request_id=rid, seq_len=100, prefill_address=prefill.address),
        timeout=10)
    # Prefill's BeginWrite (a peer channel request: no such RPC), straight to the core.
    servicer.decode.begin_write(rid, PREFILL_INSTANCE, 100, True, False)  # may write now


def test_a_token_holder_naming_the_granted_instance_from_another_host_does_not_free_it(
        tmp_path: Path) -> None:
    """Instance ids are not secrets (a Heartbeat answer carries one): a caller with the
    shared token names the real prefill's instance, but it calls from ::1 while that
    prefill is at 127.0.0.1, so its Abort is a scheduler's (prefill drains first).
    Everything on loopback: decode listens on [::] (dual-stack), the real prefill's
    calls come over 127.0.0.1, the rogue's over ::1 (as tests/host/test_peer_identity.py)."""
    token = tmp_path / "token"
    token.write_text("authority-token\n")
    sec = Security(token="authority-token")
    env = {"KVBEAM_AUTH_TOKEN_FILE": str(token), "KVBEAM_LISTEN": "[::]:0"}
    with _decode(env) as (servicer, address, prefill):
        port = address.rpartition(":")[2]
        real, rogue = sec.channel(f"127.0.0.1:{port}"), sec.channel(f"[::1]:{port}")
        try:
            _reserve_and_grant(servicer, real, "victim", prefill)
            slot = servicer.decode.slot_of("victim")
            st = _call(rogue, "Abort", pb.TransferStatus)(
                pb.AbortRequest(request_id="victim", detail="prefill failed (not really)",
                                from_peer=True, instance_id=PREFILL_INSTANCE), timeout=10)
            assert st.failure_reason == pb.FAILURE_REASON_ABORTED  # a scheduler's abort
            assert wait_until(lambda: len(prefill.aborts) == 1, 10), \
                "prefill was not asked to drain"
            assert servicer.decode.slot_of("victim") == slot, "slot freed before prefill drained"
            prefill.release.set()
            assert wait_until(lambda: servicer.decode.slot_of("victim") == -1, 10)

            # The real prefill, from where it is, is still believed at once.
            _reserve_and_grant(servicer, real, "own", prefill)
            st = _call(real, "Abort", pb.TransferStatus)(
                pb.AbortRequest(request_id="own", detail="prefill failed: drained",
                                from_peer=True, instance_id=PREFILL_INSTANCE), timeout=10)
            assert st.failure_reason == pb.FAILURE_REASON_PEER_FAILED
            assert servicer.decode.slot_of("own") == -1 and len(prefill.aborts) == 1
        finally:
            real.close()
            rogue.close()
