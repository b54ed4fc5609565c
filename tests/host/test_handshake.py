"""The handshake over real gRPC on loopback: success, refusals, deadlines, non-kvbeam peers."""

from __future__ import annotations

import logging
from dataclasses import replace

import grpc
import pytest

from kvbeam.errors import (
    HandshakeRejectedError,
    KvbeamError,
    NotHandshakenError,
    PeerError,
    PoolCompatibilityError,
    ProtocolError,
    ProtocolVersionError,
    RoleConflictError,
)
from kvbeam.pools.spec import PoolSpec, SideConfig
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.rejection_codec import DEFAULT_REJECTION_BYTES, Reason, find_rejection
from kvbeam.proto.service import control_stub
from kvbeam.proto.side import Role, SideInfo, side_to_proto
from kvbeam.proto.version import PROTOCOL_VERSION
from kvbeam.server.api.control import ControlServer
from kvbeam.server.api.servicer import ControlServicer
from kvbeam.server.peers.client import handshake
from kvbeam.server.settings import ControlOptions
from kvbeam.server.state.handshake import VerifiedPeer, check_local_side
from kvbeam.transport.endpoint import Endpoint
from tests.control_helpers import (
    DECODE_SLOTS,
    config,
    draft_changed,
    raw_handshake,
    running,
    side,
    tcp_endpoint,
    with_slots,
)

FAST = ControlOptions(rpc_timeout_s=0.5)


# ---- success -------------------------------------------------------------------
def test_compatible_pair_succeeds_on_both_sides(prefill: SideInfo, decode: SideInfo) -> None:
    with running(decode, startup_check=True) as server:
        peer = handshake(prefill, server.address)
        assert isinstance(peer, VerifiedPeer)
        assert peer.role is Role.DECODE
        assert peer.instance_id == decode.instance_id
        assert peer.layout == decode.layout
        assert peer.endpoint == decode.endpoint
        assert peer.local_endpoint == prefill.endpoint
        assert peer.control_address == server.address  # advertised after binding
        # The server registered the client as verified, with the same layouts.
        theirs = server.peers.require(prefill.instance_id)
        assert theirs.role is Role.PREFILL
        assert theirs.layout == prefill.layout
        assert theirs.local_endpoint == decode.endpoint


def test_prefill_may_be_the_server(prefill: SideInfo, decode: SideInfo) -> None:
    with running(prefill, startup_check=True) as server:
        peer = handshake(decode, server.address)
        assert peer.role is Role.PREFILL
        assert prefill.instance_id == peer.instance_id
        assert decode.instance_id in server.peers


def test_per_peer_endpoints(prefill: SideInfo, decode: SideInfo) -> None:
    made: list[VerifiedPeer] = []

    class Daemon(ControlServicer):
        def endpoint_for(self, peer: VerifiedPeer) -> Endpoint:
            return tcp_endpoint(9100 + len(made))

        def on_verified(self, peer: VerifiedPeer) -> None:
            made.append(peer)

    with running(decode, servicer=Daemon(decode)) as server:
        link = tcp_endpoint(9500)
        peer = handshake(prefill, server.address, endpoint=link)
        assert peer.endpoint == tcp_endpoint(9100)
        assert peer.local_endpoint == link
        assert made[0].endpoint == link
        assert made[0].local_endpoint == tcp_endpoint(9100)


def test_verified_peer_cannot_be_forged(prefill: SideInfo, decode: SideInfo) -> None:
    with pytest.raises(TypeError, match="only by a successful handshake"):
        VerifiedPeer(object(), decode, prefill, "x", 0.0)


def test_transfers_need_a_handshake(prefill: SideInfo, decode: SideInfo) -> None:
    with running(decode) as server:
        with pytest.raises(NotHandshakenError, match="handshake first"):
            server.peers.require(prefill.instance_id)
        handshake(prefill, server.address)
        assert server.peers.require(prefill.instance_id).instance_id == prefill.instance_id


def test_peer_restart_replaces_the_old_instance(prefill: SideInfo, decode: SideInfo) -> None:
    restarted: list[tuple[str, str]] = []

    class Daemon(ControlServicer):
        def on_peer_restarted(self, old: VerifiedPeer, new: VerifiedPeer) -> None:
            restarted.append((old.instance_id, new.instance_id))

    first = replace(prefill, control_address="127.0.0.1:7001")
    second = replace(first, instance_id="restarted-1")
    with running(decode, servicer=Daemon(decode)) as server:
        handshake(first, server.address)
        handshake(second, server.address)
        assert restarted == [(first.instance_id, "restarted-1")]
        assert first.instance_id not in server.peers
        assert len(server.peers) == 1


# ---- pool refusals --------------------------------------------------------------
def test_incompatible_pair_is_refused_on_both_sides(
        prefill: SideInfo, caplog: pytest.LogCaptureFixture) -> None:
    paged = side(Role.DECODE, with_slots(config(paged=True), DECODE_SLOTS))
    caplog.set_level(logging.WARNING)
    with running(paged) as server:
        code, _, rejection, details = raw_handshake(server.address,
                                                    pb.HandshakeRequest(side=side_to_proto(prefill)))
        assert code is grpc.StatusCode.FAILED_PRECONDITION
        assert rejection is not None
        assert rejection.reason == Reason.REJECT_REASON_INCOMPATIBLE_POOLS
        assert rejection.layout == paged.layout  # the server's metadata, to verify with
        assert rejection.role is Role.DECODE
        assert "pool difference(s)" in details
        with pytest.raises(PoolCompatibilityError) as info:
            handshake(prefill, server.address)
    err = info.value
    assert isinstance(err, KvbeamError)
    assert [d.field for d in err.differences] == [d.field for d in rejection.differences]
    assert err.differences == rejection.differences
    assert "unified_kv" in [d.field for d in err.differences]
    assert prefill.instance_id not in server.peers
    server_logs = [r for r in caplog.records if r.name == "kvbeam.server.state.handshake"]
    client_logs = [r for r in caplog.records if r.name == "kvbeam.server.peers.client"]
    for logs in (server_logs, client_logs):
        assert any(r.levelno == logging.ERROR and "refused" in r.getMessage() for r in logs)
        assert any("field=unified_kv" in r.getMessage() for r in logs)


def test_within_side_problem_of_the_server_is_reported(prefill: SideInfo) -> None:
    bad = side(Role.DECODE, draft_changed(with_slots(config(), DECODE_SLOTS), num_req_slots=2))
    with pytest.raises(PoolCompatibilityError) as info:
        check_local_side(bad)  # it would refuse to start...
    assert str(info.value).startswith("DSV4 target and draft pools must share SWA ring geometry")
    # ...so we bypass its start-up check.
    with running(bad, startup_check=False) as server, \
            pytest.raises(PoolCompatibilityError) as info:
        handshake(prefill, server.address)
    d = info.value.differences[0]
    assert (d.field, d.side) == ("swa_ring_geometry", "decode")
    assert d.message.startswith("DSV4 target and draft pools must share SWA ring geometry")


def test_server_refuses_to_start_with_broken_pools() -> None:
    bad = side(Role.PREFILL, draft_changed(config(), unified_kv=False))
    server = ControlServer(bad)
    with pytest.raises(PoolCompatibilityError) as info:
        server.start()
    assert str(info.value).startswith(
        "DSV4 target and draft pools must use the same unified-KV mode")
    assert server.address == ""


def test_large_rejection_fits_default_clients_and_is_complete_for_ours() -> None:
    big = PoolSpec(compression_ratios=(0, 4, 128) * 20 + (0,), unified_kv=True,
                   num_draft_tokens=4, head_dim=64, indexer_head_dim=32, num_req_slots=2,
                   max_context_len=1024)
    p = side(Role.PREFILL, SideConfig("m", big, replace(big, compression_ratios=(0,))))
    other = replace(big, head_dim=128, dtype="float32")
    d = side(Role.DECODE, SideConfig("m2", other, replace(other, compression_ratios=(0,))))
    with running(d) as server:
        # A client that announces nothing (grpcurl, another language) still gets the
        # status code and a bounded trailer within gRPC's default 8 KiB limits.
        with grpc.insecure_channel(server.address) as channel, \
                pytest.raises(grpc.RpcError) as raw:
            control_stub(channel).Handshake(pb.HandshakeRequest(side=side_to_proto(p)),
                                            timeout=5)
        assert raw.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        trailer = find_rejection(raw.value.trailing_metadata())
        assert trailer is not None
        assert len(trailer) <= DEFAULT_REJECTION_BYTES
        with pytest.raises(PoolCompatibilityError) as info:
            handshake(p, server.address)
    assert len(info.value.differences) > 100
    assert {"model", "head_dim", "dtype"} <= {x.field for x in info.value.differences}


# ---- version, role, malformed -----------------------------------------------------
def test_protocol_version_mismatch_client_newer(prefill: SideInfo, decode: SideInfo) -> None:
    request = pb.HandshakeRequest(side=side_to_proto(prefill))
    request.side.protocol_version = PROTOCOL_VERSION + 1
    with running(decode) as server:
        code, _, rejection, details = raw_handshake(server.address, request)
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert rejection is not None
    assert rejection.reason == Reason.REJECT_REASON_PROTOCOL_VERSION
    assert rejection.protocol_version == PROTOCOL_VERSION
    assert "protocol version mismatch" in details


def test_protocol_version_mismatch_server_newer(prefill: SideInfo, decode: SideInfo) -> None:
    future = replace(decode, protocol_version=PROTOCOL_VERSION + 1)
    with running(future) as server, pytest.raises(ProtocolVersionError) as info:
        handshake(prefill, server.address)
    assert (info.value.local, info.value.remote) == (PROTOCOL_VERSION, PROTOCOL_VERSION + 1)


@pytest.mark.parametrize("old", range(1, PROTOCOL_VERSION))
def test_an_older_protocol_peer_is_refused_naming_both_versions(prefill: SideInfo,
                                                                decode: SideInfo,
                                                                old: int) -> None:
    """Protocol 9 (after the handshake, the peer channel only) against every older build,
    refused before any transfer: a protocol 8 build (it sends Aborts and heartbeats over
    gRPC, which this build does not serve between daemons), a protocol 7 build (its decode
    would wait for an answer to every offer that never comes), a protocol 6 build (it
    would read a grant's packed lists as empty and refuse them), a protocol 5 build (its
    digest record reads as version 1, and its decode's transfer ids leave no room for
    marks), a protocol 4 build (a Digests message, no mailbox), a protocol 3 build
    (per-request gRPC calls), a protocol 2 build (CRC32C digests) or a protocol 1 build
    (no Offer, no Digests)."""
    assert PROTOCOL_VERSION == 10
    request = pb.HandshakeRequest(side=side_to_proto(prefill))
    request.side.protocol_version = old
    with running(decode) as server:
        code, _, rejection, details = raw_handshake(server.address, request)
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert rejection is not None and rejection.protocol_version == PROTOCOL_VERSION
    assert (f"this side speaks kvbeam protocol version {PROTOCOL_VERSION}, the peer speaks "
            f"{old}") in details, details


def test_reply_of_another_version_is_refused_by_the_client(prefill: SideInfo,
                                                           decode: SideInfo) -> None:
    class Liar(ControlServicer):
        def Handshake(self, request: pb.HandshakeRequest,
                      context: grpc.ServicerContext) -> pb.HandshakeResponse:
            reply = pb.HandshakeResponse(side=side_to_proto(self.local))
            reply.side.protocol_version = PROTOCOL_VERSION + 1
            return reply

    with running(decode, servicer=Liar(decode)) as server:
        with pytest.raises(ProtocolVersionError) as info:
            handshake(prefill, server.address)
        assert info.value.remote == PROTOCOL_VERSION + 1

        class Garbage(ControlServicer):
            def Handshake(self, request: pb.HandshakeRequest,
                          context: grpc.ServicerContext) -> pb.HandshakeResponse:
                reply = pb.HandshakeResponse(side=side_to_proto(self.local))
                reply.side.metadata.components[0].buffers[0].item_len = 0
                return reply

    with running(decode, servicer=Garbage(decode)) as server, \
            pytest.raises(ProtocolError) as perr:
        handshake(prefill, server.address)
    assert perr.value.field == "side.metadata.components[0].buffers[0].item_len"
    assert server.address in str(perr.value)


def test_client_verifies_even_when_the_server_accepts(prefill: SideInfo,
                                                      decode: SideInfo) -> None:
    paged = side(Role.DECODE, with_slots(config(paged=True), DECODE_SLOTS))

    class Lax(ControlServicer):  # accepts anything, answers with incompatible pools
        def Handshake(self, request: pb.HandshakeRequest,
                      context: grpc.ServicerContext) -> pb.HandshakeResponse:
            return pb.HandshakeResponse(side=side_to_proto(paged))

    with running(decode, servicer=Lax(decode)) as server, \
            pytest.raises(PoolCompatibilityError) as info:
        handshake(prefill, server.address)
    assert "unified_kv" in {d.field for d in info.value.differences}


def test_server_bug_in_endpoint_for_is_internal(prefill: SideInfo, decode: SideInfo) -> None:
    class Buggy(ControlServicer):
        def endpoint_for(self, peer: VerifiedPeer) -> Endpoint:
            return Endpoint("rdma", gid="fe80::1", qpns=(5,), mtu=1500)

    with running(decode, servicer=Buggy(decode)) as server, \
            pytest.raises(PeerError) as info:
        handshake(prefill, server.address)
    assert info.value.code == "INTERNAL"
    assert "endpoint.mtu" in str(info.value)
    assert prefill.instance_id not in server.peers


def test_role_conflict(prefill: SideInfo) -> None:
    other = side(Role.PREFILL, config())
    with running(other) as server, pytest.raises(RoleConflictError, match="both sides are"):
        handshake(prefill, server.address)


def test_malformed_request_is_invalid_argument(prefill: SideInfo, decode: SideInfo) -> None:
    request = pb.HandshakeRequest(side=side_to_proto(prefill))
    request.side.metadata.components[1].buffers[0].item_len = 0
    with running(decode) as server:
        code, _, rejection, details = raw_handshake(server.address, request)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert rejection is not None
        assert rejection.reason == Reason.REJECT_REASON_INVALID_METADATA
        assert rejection.field == "side.metadata.components[1].buffers[0].item_len"
        assert "item_len" in details
        # An empty request is refused the same way, and the server keeps serving.
        code, *_ = raw_handshake(server.address, pb.HandshakeRequest())
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert handshake(prefill, server.address).role is Role.DECODE


def test_client_reports_the_peers_objection(prefill: SideInfo, decode: SideInfo) -> None:
    class Strict(ControlServicer):
        def Handshake(self, request: pb.HandshakeRequest,
                      context: grpc.ServicerContext) -> pb.HandshakeResponse:
            request.side.metadata.model = ""
            return super().Handshake(request, context)

    with running(decode, servicer=Strict(decode)) as server, \
            pytest.raises(HandshakeRejectedError) as info:
        handshake(prefill, server.address)
    assert info.value.field == "side.metadata.model"
    assert info.value.code == "INVALID_ARGUMENT"
