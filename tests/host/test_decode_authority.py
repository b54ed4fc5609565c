"""Who may free a slot prefill may still write into, through decode's real servicer.

Only the prefill a request was granted to, over its own peer channel (bound to it by
the HELLO's token), is believed when it says the request failed there: decode frees
the slot at once. Anyone else's Abort is a scheduler's: the Abort RPC (whatever an
older daemon puts in its removed from_peer and instance_id fields) and an Abort over
another prefill's channel alike, so decode asks the granted prefill to drain first.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import cast

import grpc
import pytest

from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.peer_frames import ABORT, Hello, decode_request
from kvbeam.proto.version import PROTOCOL_VERSION
from kvbeam.server.api.decode import DecodeServicer
from kvbeam.server.peers.channel import PeerChannel, PeerChannels
from kvbeam.server.runtime import Runtime
from kvbeam.server.settings import resolve
from kvbeam.server.state.handshake import VerifiedPeer
from kvbeam.server.state.peers import PeerConn
from kvbeam.transport import Link
from tests.core_fakes import FakeLink, wait_for
from tests.fixtures import shipped_config

SERVICE = "kvbeam.v1.KvbeamControl"
PREFILL_INSTANCE = "prefill-real"


class Prefill:
    """A prefill's end of its peer channel to decode: it answers decode's Abort only once
    released (it "drains"), and sends Aborts of its own."""

    def __init__(self, servicer: DecodeServicer, instance_id: str, address: str) -> None:
        self.aborts: list[str] = []
        self.release = threading.Event()
        self.hub = PeerChannels("prefill", self._request, lambda _c, _why: None,
                                heartbeat_s=0.5)
        self.hub.start()
        # Verified and connected as a handshake leaves it (its link a fake: no bytes move).
        peer = SimpleNamespace(instance_id=instance_id, control_address=address,
                               layout=servicer.rt.layout, endpoint=SimpleNamespace(regions=[]))
        self.conn = PeerConn(cast(VerifiedPeer, peer), cast(Link, FakeLink()))
        self.conn.channel_token = f"token-of-{instance_id}"
        servicer.rt.peers.add(self.conn)
        hello = Hello(PROTOCOL_VERSION, instance_id, servicer.local.instance_id,
                      self.conn.channel_token)
        self.channel = self.hub.connect(servicer.channels.address, hello, "decode", 5.0)
        self.channel.bound = object()
        assert wait_for(lambda: self.conn.channel is not None)

    def _request(self, channel: PeerChannel, kind: int, correlation: int,
                 payload: bytes) -> None:
        assert kind == ABORT
        request = pb.AbortRequest.FromString(decode_request(payload)[1])
        self.aborts.append(request.request_id)

        def answer() -> None:
            self.release.wait(30)
            channel.reply(correlation, grpc.StatusCode.OK, message=pb.TransferStatus(
                request_id=request.request_id).SerializeToString())
        threading.Thread(target=answer, daemon=True).start()

    def abort(self, request_id: str) -> pb.TransferStatus:
        """This prefill's own Abort over its channel (its writes of the request drained)."""
        reply = self.channel.call(ABORT, pb.AbortRequest(
            request_id=request_id, detail="prefill failed: drained").SerializeToString(), 10)
        return pb.TransferStatus.FromString(reply.payload)

    def stop(self) -> None:
        self.release.set()
        self.hub.stop()


@contextmanager
def _decode() -> Iterator[tuple[DecodeServicer, grpc.Channel, Prefill]]:
    """Decode's real servicer, a gRPC channel to it, and one prefill instance as a
    verified, connected peer with its peer channel bound."""
    env = {"KVBEAM_CONFIG": shipped_config("decode"), "KVBEAM_LISTEN": "127.0.0.1:0",
           "KVBEAM_TRANSPORT": "tcp", "KVBEAM_RPC_TIMEOUT_S": "20"}
    runtime = Runtime(resolve("decode", None, env))
    servicer = DecodeServicer(runtime)
    address = runtime.start(servicer)
    prefill = Prefill(servicer, PREFILL_INSTANCE, "127.0.0.1:7001")
    channel = grpc.insecure_channel(address)
    try:
        yield servicer, channel, prefill
    finally:
        channel.close()
        prefill.stop()
        runtime.stop(grace=0.5)


@pytest.fixture
def decode() -> Iterator[tuple[DecodeServicer, grpc.Channel, Prefill]]:
    with _decode() as parts:
        yield parts


def _reserve_and_grant(servicer: DecodeServicer, channel: grpc.Channel, rid: str,
                       prefill: Prefill) -> int:
    """Reserve ``rid`` for ``prefill`` and grant it (prefill may write now): its slot."""
    reserve = channel.unary_unary(f"/{SERVICE}/Reserve",
                                  request_serializer=pb.ReserveRequest.SerializeToString,
                                  response_deserializer=pb.ReserveResponse.FromString)
    reserve(pb.ReserveRequest(request_id=rid, seq_len=100,
                              prefill_address=prefill.conn.control_address), timeout=10)
    # Prefill's BeginWrite (a peer channel request), straight to the core.
    servicer.decode.begin_write(rid, prefill.conn.instance_id, 100, False)
    slot = servicer.decode.slot_of(rid)
    assert slot != -1
    return slot


def _rpc_abort(channel: grpc.Channel, rid: str, *, as_protocol_8: bool) -> pb.TransferStatus:
    """The Abort RPC; ``as_protocol_8``: with the removed from_peer (3) and instance_id
    (4) fields set, as a protocol 8 daemon sent it to claim it spoke for prefill."""
    raw = pb.AbortRequest(request_id=rid, detail="prefill failed (not really)")
    data = raw.SerializeToString()
    if as_protocol_8:
        data += b"\x18\x01" + b"\x22" + bytes([len(PREFILL_INSTANCE)]) + PREFILL_INSTANCE.encode()
    abort = channel.unary_unary(f"/{SERVICE}/Abort", request_serializer=lambda b: b,
                                response_deserializer=pb.TransferStatus.FromString)
    return cast(pb.TransferStatus, abort(data, timeout=10))


@pytest.mark.parametrize("as_protocol_8", [False, True], ids=["scheduler", "claims-prefill"])
def test_an_abort_rpc_never_frees_a_slot_prefill_may_write(
        decode: tuple[DecodeServicer, grpc.Channel, Prefill], as_protocol_8: bool) -> None:
    servicer, channel, prefill = decode
    slot = _reserve_and_grant(servicer, channel, "victim", prefill)
    st = _rpc_abort(channel, "victim", as_protocol_8=as_protocol_8)
    assert st.state == pb.TRANSFER_STATE_FAILED
    assert st.failure_reason == pb.FAILURE_REASON_ABORTED  # a scheduler's abort
    # Held until the granted prefill confirms, over its channel, that its writes drained.
    assert wait_for(lambda: prefill.aborts == ["victim"], 10), "prefill was not asked to drain"
    assert servicer.decode.slot_of("victim") == slot, "slot freed before prefill drained"
    prefill.release.set()
    assert wait_for(lambda: servicer.decode.slot_of("victim") == -1, 10)


def test_the_granted_prefills_own_abort_over_its_channel_frees_at_once(
        decode: tuple[DecodeServicer, grpc.Channel, Prefill]) -> None:
    servicer, channel, prefill = decode
    _reserve_and_grant(servicer, channel, "own", prefill)
    st = prefill.abort("own")
    assert st.failure_reason == pb.FAILURE_REASON_PEER_FAILED
    assert servicer.decode.slot_of("own") == -1 and prefill.aborts == []


def test_another_prefills_channel_cannot_free_a_slot_granted_to_the_first(
        decode: tuple[DecodeServicer, grpc.Channel, Prefill]) -> None:
    """A second verified prefill (another instance, another address) says over its own
    channel that the first's request failed: a scheduler's abort, the first drains."""
    servicer, channel, prefill = decode
    other = Prefill(servicer, "prefill-other", "127.0.0.1:7002")
    try:
        slot = _reserve_and_grant(servicer, channel, "victim", prefill)
        st = other.abort("victim")
        assert st.failure_reason == pb.FAILURE_REASON_ABORTED
        assert wait_for(lambda: prefill.aborts == ["victim"], 10)
        assert servicer.decode.slot_of("victim") == slot, "slot freed before prefill drained"
        prefill.release.set()
        assert wait_for(lambda: servicer.decode.slot_of("victim") == -1, 10)
    finally:
        other.stop()
