"""Fuzz every RPC handler of a running prefill/decode pair, in process, with hypothesis.

Two daemons (real runtimes, real gRPC servers on loopback, TCP data plane) take
random bytes and adversarial-but-well-formed messages on every method, and the peer
channel's handlers (BeginWrite, Digests, Offer: no RPCs; the Offer one-way since
protocol 8, answered only by an OFFER_ANSWER) the same messages as a channel bound to
the instance they name would deliver them. Each answer
must be a deliberate status (never INTERNAL or UNKNOWN, which mean an unhandled
exception, and never a hang); afterwards both daemons still serve, no slot leaked,
no byte of either side's pools changed, and a real request still succeeds.

``KVBEAM_FUZZ_EXAMPLES`` sets the examples per property (default 150: about 30 s).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbeam.client import KvbeamClient
from kvbeam.errors import FrameError
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.peer_frames import ABORT, BEGIN_WRITE, OFFER, OFFER_ANSWER, STATUS_CODES
from kvbeam.proto.peer_frames import HEADER as PEER_HEADER
from kvbeam.scheduler import run_request
from kvbeam.server.api.decode import DecodeServicer
from kvbeam.server.api.prefill import PrefillServicer
from kvbeam.server.runtime import Runtime
from kvbeam.server.settings import resolve
from tests.daemon_helpers import DECODE_SLOTS, free_slots
from tests.fixtures import shipped_config
from tests.waiting import wait_until

EXAMPLES = int(os.environ.get("KVBEAM_FUZZ_EXAMPLES", "150"))
SERVICE = "/kvbeam.v1.KvbeamControl/"
#: Answers that mean a handler lost control (an unhandled exception) or hung.
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
         grpc.StatusCode.DEADLINE_EXCEEDED}
CALL_TIMEOUT_S = 10.0
METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["KvbeamControl"].methods]
STREAMING = {"WatchStatus"}
#: The peer channel's requests and one-way frames: the frame kind of each (a daemon's
#: Abort, "ChannelAbort", beside the scheduler's Abort RPC).
CHANNEL_KINDS = {"BeginWrite": BEGIN_WRITE, "Offer": OFFER, "OfferAnswer": OFFER_ANSWER,
                 "ChannelAbort": ABORT}
#: Their messages.
CHANNEL_MESSAGES: dict[str, type[Message]] = {
    "BeginWrite": pb.BeginWriteRequest, "Offer": pb.OfferRequest,
    "OfferAnswer": pb.OfferResponse, "ChannelAbort": pb.AbortRequest}


class _Channel:
    """A peer channel bound to whichever instance the request names (the channel's
    HELLO check is tests/unit/test_peer_channel.py's): the handler's own checks decide."""

    def __init__(self, instance_id: str) -> None:
        self.bound = SimpleNamespace(instance_id=instance_id, control_address="127.0.0.1:1")
        self.peer = f"fuzz {instance_id!r}"
        self.closed = False
        self.answers: list[grpc.StatusCode] = []
        self.sent: list[bytes] = []  # one-way frames (an OFFER_ANSWER)

    def reply(self, correlation: int, code: grpc.StatusCode, details: str = "",
              message: bytes = b"", in_flight: int = 0) -> None:
        self.answers.append(code)

    def send(self, data: bytes) -> None:
        self.sent.append(data)


@dataclass
class Daemon:
    """One in-process daemon."""

    runtime: Runtime
    address: str
    channel: grpc.Channel
    servicer: Any

    def digest(self) -> list[str]:
        """sha256 of every pool allocation: equal before and after means nothing was written."""
        return [hashlib.sha256(a.tobytes()).hexdigest() for a in self.runtime.pools.arrays]

    def call(self, method: str, payload: bytes) -> grpc.StatusCode:
        """Send raw request bytes to a method; the status code of the answer."""
        if method in CHANNEL_KINDS:
            return self.channel_call(method, payload)
        try:
            if method in STREAMING:
                stream: Any = self.channel.unary_stream(SERVICE + method, None, None)(
                    payload, timeout=CALL_TIMEOUT_S)
                for _ in stream:  # a watch ends at a terminal state or the deadline
                    break
                stream.cancel()
            else:
                self.channel.unary_unary(SERVICE + method, None, None)(
                    payload, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            code: grpc.StatusCode = err.code()
            return code if code is not grpc.StatusCode.CANCELLED else grpc.StatusCode.OK
        return grpc.StatusCode.OK


    def channel_call(self, method: str, payload: bytes) -> grpc.StatusCode:
        """A request message to a peer channel handler, as a channel bound to the
        instance it names delivers it; the status of the REPLY. A kind this role does
        not take, or bytes that are not the message, close a real channel (FrameError;
        the hub refuses a wrong-way kind before any handler): INVALID_ARGUMENT here."""
        kind = CHANNEL_KINDS[method]
        if kind in self.servicer.channel_notices:
            return self.notice(method, kind, payload)
        frame = struct.pack("<I", int(CALL_TIMEOUT_S * 1000)) + payload
        if kind not in self.servicer.channel_handlers:
            return grpc.StatusCode.INVALID_ARGUMENT
        try:
            claimed = getattr(CHANNEL_MESSAGES[method].FromString(payload), "instance_id", "")
        except DecodeError:
            with pytest.raises(FrameError):
                self.servicer._channel_request(_Channel(""), kind, 1, frame)
            return grpc.StatusCode.INVALID_ARGUMENT
        channel = _Channel(claimed)
        self.servicer._channel_request(channel, kind, 1, frame)
        assert wait_until(lambda: len(channel.answers) == 1, CALL_TIMEOUT_S), method
        return channel.answers[0]


    def notice(self, method: str, kind: int, payload: bytes) -> grpc.StatusCode:
        """A one-way frame (the Offer): no REPLY; OK when nothing comes back (kept), else
        the status its OFFER_ANSWER carries (REFUSED as FAILED_PRECONDITION: not kept)."""
        try:
            message = CHANNEL_MESSAGES[method].FromString(payload)
        except DecodeError:
            with pytest.raises(FrameError):
                self.servicer._channel_request(_Channel(""), kind, 0, payload)
            return grpc.StatusCode.INVALID_ARGUMENT
        channel = _Channel(getattr(message, "instance_id", ""))
        self.servicer._channel_request(channel, kind, 0, payload)
        assert not channel.answers, (method, channel.answers)  # one-way: no REPLY
        if not channel.sent:
            return grpc.StatusCode.OK
        [data] = channel.sent  # at most one answer, inline
        kind_sent, correlation, length = PEER_HEADER.unpack_from(data)
        assert (kind_sent, correlation, length) == (OFFER_ANSWER, 0, len(data) - PEER_HEADER.size)
        answer = pb.OfferResponse.FromString(data[PEER_HEADER.size:])
        if answer.code:
            return STATUS_CODES.get(answer.code, grpc.StatusCode.UNKNOWN)
        return grpc.StatusCode.OK if answer.accepted else grpc.StatusCode.FAILED_PRECONDITION


def _start(role: str) -> Daemon:
    env = {"KVBEAM_CONFIG": shipped_config(role), "KVBEAM_LISTEN": "127.0.0.1:0",
           "KVBEAM_TRANSPORT": "tcp", "KVBEAM_FILL_SEED": "1" if role == "prefill" else "2",
           "KVBEAM_DEADLINE_BOOTSTRAP_S": "1", "KVBEAM_DEADLINE_WAITING_S": "1",
           "KVBEAM_DEADLINE_TRANSFER_S": "2", "KVBEAM_RPC_TIMEOUT_S": "1",
           "KVBEAM_HEARTBEAT_S": "0.5", "KVBEAM_HANDOFF_LEASE_S": "1"}
    runtime = Runtime(resolve(role, None, env))
    servicer: Any = DecodeServicer(runtime) if role == "decode" else PrefillServicer(runtime)
    address = runtime.start(servicer)
    return Daemon(runtime, address, grpc.insecure_channel(address), servicer)


@pytest.fixture(scope="module")
def daemons() -> Iterator[tuple[Daemon, Daemon]]:
    decode = _start("decode")
    prefill = _start("prefill")
    before = (prefill.digest(), decode.digest())
    try:
        yield prefill, decode
        # nothing the fuzz sent wrote a byte anywhere
        assert (prefill.digest(), decode.digest()) == before
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            assert p.healthy() and d.healthy()
            # every slot comes back once the fuzz's reservations lapse
            assert wait_until(lambda: free_slots(d) == DECODE_SLOTS, 20)
            assert run_request(p, d, "after-fuzz", 3000, 1, timeout=30).ok
    finally:
        for daemon in (prefill, decode):
            daemon.channel.close()
            daemon.runtime.stop(grace=0.5)


FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@FUZZ
@given(method=st.sampled_from(METHODS + sorted(CHANNEL_KINDS)), payload=st.binary(max_size=600),
       to_decode=st.booleans())
def test_random_bytes_on_every_method(daemons: tuple[Daemon, Daemon], method: str,
                                      payload: bytes, to_decode: bool) -> None:
    target = daemons[1] if to_decode else daemons[0]
    code = target.call(method, payload)
    assert code not in NEVER, (method, payload, code)


# ---- well-formed messages with adversarial fields ------------------------------------------
EDGE_INTS = st.one_of(st.sampled_from([0, 1, -1, 15, 16, 32768, 32769, 2**31, 2**63 - 1,
                                       -(2**63)]),
                      st.integers(-(2**63), 2**63 - 1))
IDS = st.one_of(st.sampled_from(["", "x", "a" * 300, "ünïcödé", "with space", "../etc",
                                 "\x00nul"]), st.text(max_size=40))


def _addresses(daemons: tuple[Daemon, Daemon]) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from([daemons[0].address, daemons[1].address, "127.0.0.1:1",
                                      "", "no-port", "host:99999", "[::1]:0"]),
                     st.text(max_size=30))


def _instance(daemons: tuple[Daemon, Daemon]) -> st.SearchStrategy[str]:
    real = [d.runtime.local.instance_id for d in daemons]
    return st.one_of(st.sampled_from(real), st.text(max_size=20))


def _messages(daemons: tuple[Daemon, Daemon]) -> st.SearchStrategy[tuple[str, Message]]:
    """(method, message) pairs; ids prefixed so a fuzzed Reserve never meets a fuzzed Send."""
    addr, inst = _addresses(daemons), _instance(daemons)
    rid = IDS.map(lambda s: "fz" + s)
    ranges = st.lists(st.builds(pb.TokenRange, start=EDGE_INTS, end=EDGE_INTS), max_size=4)
    return st.one_of(
        st.tuples(st.just("Reserve"), st.builds(
            pb.ReserveRequest, request_id=rid.map(lambda s: "R" + s), seq_len=EDGE_INTS,
            prefill_address=addr)),
        st.tuples(st.just("Send"), st.builds(
            pb.SendRequest, request_id=rid.map(lambda s: "S" + s), source_slot=EDGE_INTS,
            seq_len=EDGE_INTS, decode_address=addr, final_chunk=st.booleans(),
            chunks=ranges)),
        st.tuples(st.just("BeginWrite"), st.builds(
            pb.BeginWriteRequest, request_id=rid, instance_id=inst, seq_len=EDGE_INTS,
            digests_follow=st.booleans())),
        st.tuples(st.just("Offer"), st.builds(
            pb.OfferRequest, request_id=rid, instance_id=inst, seq_len=EDGE_INTS,
            transfer_id=st.integers(0, 2**32 - 1), lease_ms=EDGE_INTS,
            mailbox_slot=st.integers(0, 2**32 - 1),
            indices=st.lists(st.builds(pb.IndexList, kind=st.integers(0, 5),
                                       indices=st.lists(EDGE_INTS, max_size=8),
                                       pool=st.sampled_from(["", "target", "draft", "x"])),
                             max_size=6))),
        st.tuples(st.just("OfferAnswer"), st.builds(
            pb.OfferResponse, request_id=rid, transfer_id=st.integers(0, 2**32 - 1),
            accepted=st.booleans(), digests_follow=st.booleans(),
            code=st.integers(0, 2**32 - 1), detail=st.text(max_size=50))),
        st.tuples(st.sampled_from(["Status", "WatchStatus"]),
                  st.builds(pb.StatusRequest, request_id=rid)),
        st.tuples(st.sampled_from(["Abort", "ChannelAbort"]), st.builds(
            pb.AbortRequest, request_id=rid, detail=st.text(max_size=50))),
        st.tuples(st.just("Release"), st.builds(pb.ReleaseRequest, request_id=rid)),
        st.tuples(st.just("Heartbeat"), st.builds(pb.HeartbeatRequest)),
    )


@FUZZ
@given(data=st.data(), to_decode=st.booleans())
def test_adversarial_messages_on_every_method(daemons: tuple[Daemon, Daemon],
                                              data: st.DataObject, to_decode: bool) -> None:
    method, message = data.draw(_messages(daemons))
    target = daemons[1] if to_decode else daemons[0]
    code = target.call(method, message.SerializeToString())
    assert code not in NEVER, (method, message, code)


def test_the_peer_channels_requests_are_no_rpcs(daemons: tuple[Daemon, Daemon]) -> None:
    """BeginWrite and Offer are served on the peer channel only, and Digests nowhere (the
    digests go in band, into decode's mailbox): over gRPC both daemons answer
    UNIMPLEMENTED."""
    messages = {"BeginWrite": pb.BeginWriteRequest(request_id="r", instance_id="p", seq_len=10),
                "Offer": pb.OfferRequest(request_id="r", instance_id="d", seq_len=10),
                # An old DigestsRequest (request_id = 1): its bytes, no message type.
                "Digests": pb.ReleaseRequest(request_id="r")}
    for daemon in daemons:
        for method, message in messages.items():
            call: Callable[..., Any] = daemon.channel.unary_unary(SERVICE + method, None, None)
            with pytest.raises(grpc.RpcError) as err:
                call(message.SerializeToString(), timeout=CALL_TIMEOUT_S)
            assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED, (method, err.value)


def test_index_lists_of_a_response_are_never_taken_from_the_wire(
        daemons: tuple[Daemon, Daemon]) -> None:
    """BeginWrite from a stranger (not a verified peer) is refused: it learns no indices."""
    _, decode = daemons
    message = pb.BeginWriteRequest(request_id="stranger", instance_id="not-a-peer", seq_len=10)
    code = decode.channel_call("BeginWrite", message.SerializeToString())
    assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION), code
