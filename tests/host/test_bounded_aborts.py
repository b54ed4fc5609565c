"""Bounded aborts over real peer channels.

- Decode's shutdown and engine detach with 256 live requests, against a prefill whose
  channel answers no Abort, end well inside a 30 s Kubernetes grace period (the grace is
  the functional requirement; the time is printed); prefill's shutdown likewise.
- Prefill's answer to decode's Abort comes within the caller's deadline even when the
  request's writes never drain, and says how many are in flight; 40 at once are all
  answered in time while the channel's heartbeats keep flowing (its thread never waits
  on a drain).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.indices import request_indices
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.peer_frames import ABORT, Hello, decode_request
from kvbeam.proto.side import SideInfo
from kvbeam.proto.version import PROTOCOL_VERSION
from kvbeam.server.api.prefill import PrefillServicer
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.ports import SHUTDOWN_ABORT_S, WriteGrant
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.peers.calls import ChannelDecodePeers, ChannelPrefillPeers
from kvbeam.server.peers.channel import PeerChannel, PeerChannels
from kvbeam.server.runtime import Runtime
from kvbeam.server.settings import ControlOptions, resolve
from kvbeam.server.state.handshake import VerifiedPeer
from kvbeam.server.state.lifecycle import Deadlines, TransferTable
from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.states import FailureReason, TransferState
from kvbeam.transport import Link
from tests.core_fakes import FakeDecode, FakeLink, fake_conn, slot_lists, started_loop, wait_for
from tests.fixtures import UNIFIED_TARGET, layout, shipped_config

#: Kubernetes' default termination grace period, s: shutdown must end inside it.
GRACE_S = 30.0
LIVE = 256
OPTIONS = ControlOptions(rpc_timeout_s=5.0)

#: Opens a real peer channel to a listening hub and binds it to a connection.
Opener = Callable[[PeerConn], PeerChannel]


class FarEnd:
    """A listening hub at the far end of real peer channels: it records every Abort and
    answers none (``answer`` False) or passes them to ``on_abort``."""

    def __init__(self, role: str, *, answer: bool = False, heartbeat_s: float = 1.0) -> None:
        self.aborts: list[str] = []
        self.channels: list[PeerChannel] = []
        self.answer = answer
        self.hub = PeerChannels(role, self._request, lambda _c, _why: None,
                                on_hello=self._hello, heartbeat_s=heartbeat_s)
        self.hub.listen("127.0.0.1", 0, "127.0.0.1")
        self.hub.start()
        # The near end's hub: it only opens channels (its requests are the test's).
        self.near = PeerChannels("prefill", lambda *_a: None, lambda _c, _why: None,
                                 heartbeat_s=heartbeat_s)
        self.near.start()

    def _hello(self, channel: PeerChannel, _hello: Hello) -> object:
        self.channels.append(channel)
        return object()

    def _request(self, channel: PeerChannel, kind: int, correlation: int,
                 payload: bytes) -> None:
        if kind == ABORT:
            _timeout, raw = decode_request(payload)
            self.aborts.append(pb.AbortRequest.FromString(raw).request_id)

    def open(self, conn: PeerConn) -> PeerChannel:
        """A channel from the near end to this far end, as ``conn``'s."""
        hello = Hello(PROTOCOL_VERSION, "near", "far", "t")
        channel = self.near.connect(self.hub.address, hello, "far end", 5.0)
        conn.channel, channel.bound = channel, conn
        return channel

    def stop(self) -> None:
        self.near.stop()
        self.hub.stop()


@pytest.fixture
def silent_prefill() -> Iterator[FarEnd]:
    end = FarEnd("prefill")
    yield end
    end.stop()


@pytest.fixture
def silent_decode() -> Iterator[FarEnd]:
    end = FarEnd("decode")
    yield end
    end.stop()


def _decode_with_live_requests(far: FarEnd) -> DecodeDriver:
    """A decode core over real peer channel calls, LIVE requests granted to one prefill."""
    lay = layout(num_req_slots=LIVE)
    peers = Peers()
    core = DecodeDriver(table=TransferTable(Deadlines(), capacity=2 * LIVE), peers=peers,
                        prefill=ChannelPrefillPeers(lambda: cast(SideInfo, SimpleNamespace(
                            instance_id="decode-under-test")), OPTIONS, peers),
                        io=futures.ThreadPoolExecutor(8, thread_name_prefix="test-io"),
                        integrity=False, handoff_lease_s=30.0, clock=time.monotonic)
    core.use_pools(replace(UNIFIED_TARGET, num_req_slots=LIVE), lay, AllocatedSide(lay))
    core.loop = started_loop()  # threads: every call into the core on the loop
    peer = SimpleNamespace(instance_id="prefill-1", control_address="127.0.0.1:9", layout=lay,
                           endpoint=SimpleNamespace(regions=[]))
    conn = PeerConn(cast(VerifiedPeer, peer), cast(Link, FakeLink()))
    far.open(conn)
    core.peers.add(conn)
    for i in range(LIVE):
        core.reserve(f"live-{i}", 100, conn.control_address)
        core.begin_write(f"live-{i}", conn.instance_id, 100, False)
    return core


def _told_at_once(caplog: pytest.LogCaptureFixture, whom: str) -> None:
    """The shutdown told ``whom`` of every live request in one go, all its Aborts under
    one deadline (SHUTDOWN_ABORT_S), and went on with none answered: it waited for no
    answer past that deadline (one after another, each would have its own)."""
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if "Abort(s) not confirmed within" in m] == [
        f"{LIVE} of {LIVE} Abort(s) not confirmed within {SHUTDOWN_ABORT_S:.1f} s"], said
    told = [m for m in said if f": told {whom} of " in m]
    assert len(told) == 1 and told[0].endswith(" 0 confirmed"), said
    assert f"told {whom} of {LIVE} live request(s) in " in told[0], told


@pytest.mark.parametrize("how", ["shutdown", "detach"])
def test_decode_shutdown_with_256_live_requests_ends_inside_the_grace_period(
        silent_prefill: FarEnd, how: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvbeam.server")
    core = _decode_with_live_requests(silent_prefill)
    conn = core.peers.get("prefill-1")
    assert conn is not None
    began = time.monotonic()
    stop = core.shutdown if how == "shutdown" else (lambda: core.drop_pools("engine detached"))
    worker = threading.Thread(target=stop, daemon=True)
    worker.start()
    worker.join(GRACE_S)
    print(f"\ndecode {how} with {LIVE} live requests, prefill answering no Abort: "
          f"{time.monotonic() - began:.2f} s (grace {GRACE_S:.0f} s)")
    assert not worker.is_alive(), f"{how} still running after {GRACE_S:.0f} s"
    _told_at_once(caplog, "prefill")
    assert wait_for(lambda: silent_prefill.aborts), "prefill was never told"
    assert conn.closed and cast(FakeLink, conn.link).released
    for i in range(LIVE):
        st = core.status(f"live-{i}")
        assert st.state is TransferState.FAILED and st.reason is FailureReason.SHUTDOWN
        assert core.slot_of(f"live-{i}") == -1
    core.io.shutdown(wait=False, cancel_futures=True)


class SilentDecode(FakeDecode):
    """Prefill's view of a decode whose peer channel answers no Abort: the handshake and
    BeginWrite are faked (writes never complete), the Aborts go over a real channel."""

    def __init__(self, far: FarEnd, peers: Peers) -> None:
        super().__init__(AllocatedSide(layout()))
        self.far = far
        self.calls = ChannelDecodePeers(
            lambda: cast(SideInfo, SimpleNamespace(instance_id="prefill-under-test")),
            cast(Any, None), OPTIONS, cast(Any, None), peers)

    def connect(self, address: str) -> PeerConn:
        conn = fake_conn(address, self.side)
        self.far.open(conn)
        return conn

    def abort(self, conn: PeerConn | None, address: str, request_id: str, detail: str,
              timeout: float | None = None) -> bool:
        return self.calls.abort(conn, address, request_id, detail, timeout)

    def abort_all(self, calls: Sequence[tuple[PeerConn | None, str, str]], detail: str,
                  timeout: float) -> int:
        return self.calls.abort_all(calls, detail, timeout)


def test_prefill_shutdown_with_256_live_requests_ends_inside_the_grace_period(
        silent_decode: FarEnd, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvbeam.server")
    peers = Peers()
    core = PrefillDriver(table=TransferTable(Deadlines()), peers=peers,
                         decode=SilentDecode(silent_decode, peers),
                         io=futures.ThreadPoolExecutor(8, thread_name_prefix="test-io"),
                         integrity=False, drain_s=24.0, clock=time.monotonic)
    core.use_pools(UNIFIED_TARGET, layout(), AllocatedSide(layout()))
    core.loop = started_loop()  # threads: every call into the core on the loop
    address = "127.0.0.1:9"
    for i in range(LIVE):
        core.send(f"live-{i}", 100, address, [], True,
                  indices=slot_lists(core, i % UNIFIED_TARGET.num_req_slots, 100))
    assert wait_for(lambda: all(core.in_flight(f"live-{i}") == 1 for i in range(LIVE)), 30)
    began = time.monotonic()
    worker = threading.Thread(target=core.shutdown, daemon=True)
    worker.start()
    worker.join(GRACE_S)
    print(f"\nprefill shutdown with {LIVE} live requests, decode answering no Abort: "
          f"{time.monotonic() - began:.2f} s (grace {GRACE_S:.0f} s)")
    assert not worker.is_alive(), f"shutdown still running after {GRACE_S:.0f} s"
    _told_at_once(caplog, "decode")
    assert wait_for(lambda: silent_decode.aborts), "decode was never told"
    for i in range(LIVE):
        assert core.status(f"live-{i}").reason is FailureReason.SHUTDOWN
    core.io.shutdown(wait=False, cancel_futures=True)


# ---- prefill's Abort handler ------------------------------------------------------------
class StuckDecode(FakeDecode):
    """A decode whose grants use the prefill's own spec; writes never complete (FakeLink)."""

    def __init__(self, side: Any, spec: Any) -> None:
        super().__init__(side)
        self.spec = spec

    def begin_write(self, conn: PeerConn, request_id: str, seq_len: int,
                    digests_follow: bool) -> WriteGrant:
        grant = super().begin_write(conn, request_id, seq_len, digests_follow)
        return WriteGrant(grant.transfer_id, request_indices(self.spec, 1, seq_len))


class Decode:
    """The decode end of a real peer channel into a prefill daemon's servicer."""

    def __init__(self, servicer: PrefillServicer, conn: PeerConn) -> None:
        self.end = FarEnd("decode", heartbeat_s=0.1)
        hello = Hello(PROTOCOL_VERSION, "prefill", conn.instance_id, "t")
        ours = servicer.channels.connect(self.end.hub.address, hello, "decode", 5.0)
        conn.channel, ours.bound = ours, conn  # as prefill's connect binds it
        assert wait_for(lambda: self.end.channels)
        self.channel = self.end.channels[0]

    def abort(self, request_id: str, timeout: float) -> futures.Future[Any]:
        return self.channel.start_call(ABORT, pb.AbortRequest(
            request_id=request_id, detail="decode gave up").SerializeToString(), timeout)


@pytest.fixture
def stuck_prefill() -> Iterator[tuple[PrefillServicer, Decode]]:
    env = {"KVBEAM_CONFIG": shipped_config("prefill"), "KVBEAM_LISTEN": "127.0.0.1:0",
           "KVBEAM_TRANSPORT": "tcp", "KVBEAM_DEADLINE_TRANSFER_S": "30",
           "KVBEAM_RPC_TIMEOUT_S": "2", "KVBEAM_HEARTBEAT_S": "0.1"}
    runtime = Runtime(resolve("prefill", None, env))
    servicer = PrefillServicer(runtime)
    runtime.start(servicer)  # installs the own pools
    servicer.prefill.decode = StuckDecode(runtime.pools, servicer.prefill.spec)
    decode = None
    try:
        servicer.prefill.send("first", 100, "127.0.0.1:9", [], True,
                              indices=slot_lists(servicer.prefill, 0, 100))
        assert wait_for(lambda: runtime.peers.by_address("127.0.0.1:9") is not None, 20)
        conn = runtime.peers.by_address("127.0.0.1:9")
        assert conn is not None
        decode = Decode(servicer, conn)
        yield servicer, decode
    finally:
        if decode is not None:
            decode.end.stop()
        runtime.stop(grace=0.5)


def _stuck_requests(servicer: PrefillServicer, n: int) -> None:
    core = servicer.prefill
    for i in range(n):
        core.send(f"stuck-{i}", 100, "127.0.0.1:9", [], True,
                  indices=slot_lists(core, 0, 100))
    assert wait_for(lambda: all(core.in_flight(f"stuck-{i}") == 1 for i in range(n)), 20)


def test_prefills_abort_answers_within_the_callers_deadline_saying_writes_are_in_flight(
        stuck_prefill: tuple[PrefillServicer, Decode]) -> None:
    servicer, decode = stuck_prefill
    _stuck_requests(servicer, 1)
    reply = decode.abort("stuck-0", timeout=1.0).result(5.0)  # the drain would take 24 s
    assert pb.TransferStatus.FromString(reply.payload).state == pb.TRANSFER_STATE_FAILED
    assert reply.in_flight == 1
    assert servicer.prefill.status("stuck-0").reason is FailureReason.PEER_FAILED


def test_forty_aborts_at_once_are_answered_in_time_and_the_channel_keeps_beating(
        stuck_prefill: tuple[PrefillServicer, Decode]) -> None:
    servicer, decode = stuck_prefill
    n = 40
    _stuck_requests(servicer, n)
    pending = [decode.abort(f"stuck-{i}", timeout=5.0) for i in range(n)]
    replies = [f.result(10.0) for f in pending]  # a call past its deadline raises
    assert all(pb.TransferStatus.FromString(r.payload).state == pb.TRANSFER_STATE_FAILED
               for r in replies)
    # The daemon's loop answered every PING meanwhile: the drains wait elsewhere.
    assert decode.channel.missed_heartbeats() == 0
    assert not decode.channel.closed
