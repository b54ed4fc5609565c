"""Bounded aborts over real gRPC (issue 22, item 7).

- Decode's shutdown and engine detach with 256 live requests, against a prefill that
  never answers an Abort, end well inside a 30 s Kubernetes grace period (the grace is
  the functional requirement; the time is printed); prefill's shutdown likewise.
- Prefill's Abort answers within its caller's deadline even when the request's writes
  never drain, says in the trailing metadata that they are in flight, and 40 at once
  leave its heartbeats answered (a daemon has 16 handler threads).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.indices import request_indices
from kvbeam.procs import wait_until
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.side import SideInfo
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.ports import WriteGrant
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.faults import FaultHooks
from kvbeam.server.handshake import VerifiedPeer
from kvbeam.server.lifecycle import Deadlines, TransferTable
from kvbeam.server.peer_rpc import (
    WRITES_IN_FLIGHT_KEY,
    Dialer,
    GrpcDecodePeers,
    GrpcPrefillPeers,
)
from kvbeam.server.peers import PeerConn, Peers
from kvbeam.server.prefill import PrefillServicer
from kvbeam.server.runtime import Runtime
from kvbeam.server.settings import ControlOptions, resolve
from kvbeam.states import FailureReason, TransferState
from kvbeam.transport import Link
from tests.core_fakes import FakeDecode, FakeLink, fake_conn, wait_for
from tests.fixtures import UNIFIED_TARGET, layout, shipped_config

#: Kubernetes' default termination grace period, s: shutdown must end inside it.
GRACE_S = 30.0
LIVE = 256
SERVICE = "kvbeam.v1.KvbeamControl"


@pytest.fixture
def silent_prefill() -> Iterator[tuple[str, list[str]]]:
    """A gRPC server answering no Abort (each handler blocks until the test ends)."""
    release = threading.Event()
    calls: list[str] = []

    def abort(request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.TransferStatus:
        calls.append(request.request_id)
        release.wait(60)
        return pb.TransferStatus(request_id=request.request_id)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Abort": grpc.unary_unary_rpc_method_handler(
            abort, request_deserializer=pb.AbortRequest.FromString,
            response_serializer=pb.TransferStatus.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", calls
    finally:
        release.set()
        server.stop(0)


def _decode_with_live_requests(address: str) -> DecodeDriver:
    """A decode core over real gRPC peer calls, LIVE requests granted to one prefill."""
    lay = layout(num_req_slots=LIVE)
    options = ControlOptions(rpc_timeout_s=5.0)
    core = DecodeDriver(table=TransferTable(Deadlines(), capacity=2 * LIVE), peers=Peers(),
                      prefill=GrpcPrefillPeers(lambda: cast(SideInfo, SimpleNamespace(
                          instance_id="decode-under-test")), options),
                      io=futures.ThreadPoolExecutor(8, thread_name_prefix="test-io"),
                      spec=replace(UNIFIED_TARGET, num_req_slots=LIVE), layout=lay,
                      pools=AllocatedSide(lay), integrity=False,
                      faults=FaultHooks(), handoff_lease_s=30.0)
    peer = SimpleNamespace(instance_id="prefill-1", control_address=address, layout=lay,
                           endpoint=SimpleNamespace(regions=[]))
    conn = PeerConn(cast(VerifiedPeer, peer), cast(Link, FakeLink()), Dialer(options))
    core.peers.add(conn)
    for i in range(LIVE):
        core.reserve(f"live-{i}", 100, address)
        core.begin_write(f"live-{i}", conn.instance_id, 100, True, False)
    return core


@pytest.mark.parametrize("how", ["shutdown", "detach"])
def test_decode_shutdown_with_256_live_requests_ends_inside_the_grace_period(
        silent_prefill: tuple[str, list[str]], how: str) -> None:
    address, calls = silent_prefill
    core = _decode_with_live_requests(address)
    conn = core.peers.get("prefill-1")
    assert conn is not None
    began = time.monotonic()
    stop = core.shutdown if how == "shutdown" else (lambda: core.drop_pools("engine detached"))
    worker = threading.Thread(target=stop, daemon=True)
    worker.start()
    worker.join(GRACE_S)
    took = time.monotonic() - began
    print(f"\ndecode {how} with {LIVE} live requests, prefill answering no Abort: "
          f"{took:.2f} s (grace {GRACE_S:.0f} s)")
    assert not worker.is_alive(), f"{how} still running after {GRACE_S:.0f} s"
    assert took < GRACE_S
    assert calls, "prefill was never told"
    assert conn.closed and cast(FakeLink, conn.link).released
    for i in range(LIVE):
        st = core.status(f"live-{i}")
        assert st.state is TransferState.FAILED and st.reason is FailureReason.SHUTDOWN
        assert core.slot_of(f"live-{i}") == -1
    core.io.shutdown(wait=False, cancel_futures=True)


class SilentDecode(FakeDecode):
    """Prefill's view of a decode whose control server answers no Abort: the handshake and
    BeginWrite are faked (writes never complete), Abort goes over real gRPC."""

    def __init__(self, address: str) -> None:
        super().__init__(AllocatedSide(layout()))
        self.options = ControlOptions(rpc_timeout_s=5.0)
        self.grpc = GrpcDecodePeers(
            lambda: cast(SideInfo, SimpleNamespace(instance_id="prefill-under-test")),
            cast(Any, None), Dialer(self.options), cast(Any, None))
        self.address = address

    def connect(self, address: str) -> PeerConn:
        conn = fake_conn(address, self.side)
        return PeerConn(conn.peer, conn.link, Dialer(self.options), conn.addrs)

    def abort(self, conn: PeerConn | None, address: str, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        return self.grpc.abort(conn, address, request_id, detail, timeout)

    def abort_all(self, calls: Sequence[tuple[PeerConn | None, str, str]], detail: str,
                  timeout: float) -> int:
        return self.grpc.abort_all(calls, detail, timeout)


def test_prefill_shutdown_with_256_live_requests_ends_inside_the_grace_period(
        silent_prefill: tuple[str, list[str]]) -> None:
    address, calls = silent_prefill  # the same silent server, as decode this time
    core = PrefillDriver(table=TransferTable(Deadlines()), peers=Peers(),
                       decode=SilentDecode(address),
                       io=futures.ThreadPoolExecutor(8, thread_name_prefix="test-io"),
                       spec=UNIFIED_TARGET, layout=layout(), pools=AllocatedSide(layout()),
                       integrity=False, faults=FaultHooks(), drain_s=24.0)
    for i in range(LIVE):
        core.send(f"live-{i}", i % UNIFIED_TARGET.num_req_slots, 100, address, [], True)
    assert wait_for(lambda: all(core.in_flight(f"live-{i}") == 1 for i in range(LIVE)), 30)
    began = time.monotonic()
    worker = threading.Thread(target=core.shutdown, daemon=True)
    worker.start()
    worker.join(GRACE_S)
    took = time.monotonic() - began
    print(f"\nprefill shutdown with {LIVE} live requests, decode answering no Abort: "
          f"{took:.2f} s (grace {GRACE_S:.0f} s)")
    assert not worker.is_alive(), f"shutdown still running after {GRACE_S:.0f} s"
    assert took < GRACE_S
    assert calls, "decode was never told"
    for i in range(LIVE):
        assert core.status(f"live-{i}").reason is FailureReason.SHUTDOWN
    core.io.shutdown(wait=False, cancel_futures=True)


# ---- prefill's Abort handler ------------------------------------------------------------
class StuckDecode(FakeDecode):
    """A decode whose grants use the prefill's own spec; writes never complete (FakeLink)."""

    def __init__(self, side: Any, spec: Any) -> None:
        super().__init__(side)
        self.spec = spec

    def begin_write(self, conn: PeerConn, request_id: str, seq_len: int, final: bool,
                    digests_follow: bool) -> WriteGrant:
        grant = super().begin_write(conn, request_id, seq_len, final, digests_follow)
        return WriteGrant(grant.transfer_id, request_indices(self.spec, 1, seq_len))


@pytest.fixture
def stuck_prefill() -> Iterator[tuple[Runtime, PrefillServicer, grpc.Channel]]:
    env = {"KVBEAM_CONFIG": shipped_config("prefill"), "KVBEAM_LISTEN": "127.0.0.1:0",
           "KVBEAM_TRANSPORT": "tcp", "KVBEAM_DEADLINE_TRANSFER_S": "30",
           "KVBEAM_RPC_TIMEOUT_S": "2",
           "KVBEAM_HEARTBEAT_S": "3600"}  # the fake decode answers no heartbeat
    runtime = Runtime(resolve("prefill", None, env))
    servicer = PrefillServicer(runtime)
    servicer.prefill.decode = StuckDecode(runtime.pools, servicer.prefill.spec)
    address = runtime.start(servicer)
    channel = grpc.insecure_channel(address)
    try:
        yield runtime, servicer, channel
    finally:
        channel.close()
        runtime.stop(grace=0.5)


def _stuck_requests(servicer: PrefillServicer, n: int) -> None:
    core = servicer.prefill
    for i in range(n):
        core.send(f"stuck-{i}", 0, 100, "127.0.0.1:9", [], True)
    assert wait_for(lambda: all(core.in_flight(f"stuck-{i}") == 1 for i in range(n)), 20)


def _abort_call(channel: grpc.Channel) -> Any:
    return channel.unary_unary(f"/{SERVICE}/Abort",
                               request_serializer=pb.AbortRequest.SerializeToString,
                               response_deserializer=pb.TransferStatus.FromString)


def test_prefills_abort_answers_within_the_callers_deadline_saying_writes_are_in_flight(
        stuck_prefill: tuple[Runtime, PrefillServicer, grpc.Channel]) -> None:
    _runtime, servicer, channel = stuck_prefill
    _stuck_requests(servicer, 1)
    reply, call = _abort_call(channel).with_call(
        pb.AbortRequest(request_id="stuck-0", detail="decode gave up", from_peer=True,
                        instance_id="decode-1"), timeout=1.0)  # the drain would take 24 s
    assert reply.state == pb.TRANSFER_STATE_FAILED
    assert dict(call.trailing_metadata())[WRITES_IN_FLIGHT_KEY] == "1"


def test_forty_aborts_at_once_leave_prefills_heartbeats_answered(
        stuck_prefill: tuple[Runtime, PrefillServicer, grpc.Channel]) -> None:
    _runtime, servicer, channel = stuck_prefill
    n = 40
    _stuck_requests(servicer, n)
    abort = _abort_call(channel)
    pending = [abort.future(pb.AbortRequest(request_id=f"stuck-{i}", from_peer=True,
                                            instance_id="decode-1"), timeout=20.0)
               for i in range(n)]
    heartbeat = channel.unary_unary(f"/{SERVICE}/Heartbeat",
                                    request_serializer=pb.HeartbeatRequest.SerializeToString,
                                    response_deserializer=pb.HeartbeatResponse.FromString)
    time.sleep(0.2)  # the aborts are in the handlers now
    beat = heartbeat(pb.HeartbeatRequest(), timeout=5.0)  # a peer's heartbeat deadline
    assert beat.instance_id == servicer.local.instance_id
    assert wait_until(lambda: all(f.done() for f in pending), 20)
    assert all(f.result().state == pb.TRANSFER_STATE_FAILED for f in pending)
