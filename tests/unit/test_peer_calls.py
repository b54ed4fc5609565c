"""One path between the daemons: every per-request message goes over the peer channel
(server/peers/calls.py). A connection without an open channel calls no RPC: prefill's
BeginWrite fails naming the peer and why, decode makes no offer, an Abort goes over the
pair's newer connection or is not sent, prefill's core drops such a connection and
handshakes again (a new link, a new channel), and a handshake whose decode names no
channel, or one that cannot be opened, fails."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import grpc
import numpy as np
import pytest

from kvbeam.errors import PeerChannelError, PeerUnavailableError
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.types import IndexKind
from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
from kvbeam.proto.peer_frames import ABORT, HEADER, OFFER, Reply
from kvbeam.server.core.ports import Offered, WriteGrant
from kvbeam.server.peers.calls import (
    ChannelDecodePeers,
    ChannelPrefillPeers,
    no_channel,
    offer_answer,
)
from kvbeam.server.peers.channel import CHANNEL_ADDRESS_KEY, CHANNEL_TOKEN_KEY, PeerChannels
from kvbeam.server.settings import ControlOptions
from kvbeam.server.state.handshake import VerifiedPeer
from kvbeam.server.state.peers import PeerConn, Peers
from kvbeam.states import TransferState
from tests.core_fakes import FakeLink, fake_conn, prefill_core, slot_lists, wait_for
from tests.fixtures import layout

ADDR = "127.0.0.1:9"


class _Closed:
    """A peer channel closed with a BYE (the peer replaced its link)."""

    closed = True
    orderly = True
    close_reason = "the peer closed it: its connection was closed on this side"
    peer = f"decode d1 at {ADDR}"

    def call(self, *_a: Any) -> Any:
        raise AssertionError("a closed channel was called")

    start_call = call

    def close(self, reason: str, *, bye: bool = False) -> None:
        pass  # closed already (a real channel's close is idempotent)


class _Metrics:
    begin_writes = SimpleNamespace(inc=lambda: None)


def _conn(channel: Any) -> PeerConn:
    conn = fake_conn(ADDR, AllocatedSide(layout()))
    conn.channel = channel
    return conn


def _decode_peers(peers: Peers | None = None) -> ChannelDecodePeers:
    local: Any = SimpleNamespace(instance_id="p1")
    return ChannelDecodePeers(lambda: local, cast(Any, None), ControlOptions(rpc_timeout_s=1.0),
                              cast(Any, _Metrics()),
                              Peers() if peers is None else peers)


@pytest.mark.parametrize("channel", [None, _Closed()], ids=["never-opened", "closed-bye"])
def test_begin_write_without_a_channel_fails_naming_why_and_calls_no_rpc(
        channel: Any) -> None:
    peers, conn = _decode_peers(), _conn(channel)
    with pytest.raises(PeerUnavailableError) as err:
        peers.begin_write(conn, "r1", 100, False)
    text = str(err.value)
    assert text.startswith(f"BeginWrite to {ADDR}: no peer channel to decode "), text
    assert ("never opened one" if channel is None else "its connection was closed") in text
    assert err.value.address == ADDR


@pytest.mark.parametrize("channel", [None, _Closed()], ids=["not-bound-yet", "closed-bye"])
def test_decode_makes_no_offer_without_a_channel(channel: Any) -> None:
    local: Any = SimpleNamespace(instance_id="d1")
    peers = ChannelPrefillPeers(lambda: local, ControlOptions(rpc_timeout_s=1.0), Peers())
    conn = _conn(channel)
    grant = WriteGrant(5, {})
    assert not peers.offer(conn, "r1", 100, grant, 10.0)  # nothing sent
    assert "closed" in no_channel(conn, "prefill") or channel is None


def _verified(extra: dict[str, str]) -> VerifiedPeer:
    return cast(VerifiedPeer, SimpleNamespace(instance_id="d1", endpoint=SimpleNamespace(
        extra=extra)))


def test_a_handshake_whose_decode_names_no_channel_fails() -> None:
    peers = _decode_peers()
    peers.channels = cast(PeerChannels, SimpleNamespace())
    with pytest.raises(PeerUnavailableError, match="names no peer channel") as err:
        peers._open_channel(_verified({}), ADDR)
    assert err.value.address == ADDR


def test_a_handshake_whose_channel_cannot_be_opened_fails_naming_its_address() -> None:
    def refuse(*_a: Any) -> Any:
        raise ConnectionRefusedError("[Errno 111] Connection refused")

    peers = _decode_peers()
    peers.channels = cast(PeerChannels, SimpleNamespace(connect=refuse))
    with pytest.raises(PeerUnavailableError) as err:
        peers._open_channel(_verified({CHANNEL_ADDRESS_KEY: "127.0.0.1:1",
                                       CHANNEL_TOKEN_KEY: "t"}), ADDR)
    assert "its peer channel at 127.0.0.1:1 could not be opened" in str(err.value)


def test_prefill_drops_a_connection_whose_channel_closed_and_handshakes_again() -> None:
    """The core's side: a connection whose channel a BYE closed is not used again (it
    could carry no BeginWrite); the next request handshakes a new link and succeeds."""
    core, fake = prefill_core()
    core.send("first", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    assert wait_for(lambda: len(fake.digests) == 1)  # after its writes were posted
    old = core.peers.by_address(ADDR)
    assert old is not None
    link = cast(FakeLink, old.link)
    for write in list(link.writes):  # the data and, with integrity on, the digest record
        core.on_event(link.completion(write[0]))
    assert core.status("first").state is TransferState.SUCCESS
    old.channel = _Closed()  # decode released that connection: a BYE

    core.send("next", 300, ADDR, [], True, indices=slot_lists(core, 1, 300))
    assert wait_for(lambda: len(fake.digests) == 2)
    new = core.peers.by_address(ADDR)
    assert new is not None and new is not old
    assert old.closed and link.released, "the connection without a channel was kept"
    assert fake.connects == [ADDR, ADDR]  # handshook again
    assert fake.begins[1] == ("next", new.link.id)
    new_link = cast(FakeLink, new.link)
    for write in list(new_link.writes):
        core.on_event(new_link.completion(write[0]))
    assert core.status("next").state is TransferState.SUCCESS


def test_a_channel_lost_without_a_bye_fails_the_connections_requests() -> None:
    """Closed without a BYE the peer is lost (its handler says so too): a request on
    the connection fails; a new one handshakes again."""
    core, fake = prefill_core()
    core.send("first", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    assert wait_for(lambda: len(fake.digests) == 1)  # its writes are in flight
    old = core.peers.by_address(ADDR)
    assert old is not None
    lost = _Closed()
    lost.orderly, lost.close_reason = False, "the peer closed the connection"
    old.channel = lost
    core.send("next", 300, ADDR, [], True, indices=slot_lists(core, 1, 300))
    assert wait_for(lambda: core.status("first").state is TransferState.FAILED), \
        core.status("first")
    assert core.status("first").detail == \
        f"peer channel to decode d1 at {ADDR} lost: the peer closed the connection"
    assert wait_for(lambda: len(fake.digests) == 2)
    assert fake.connects == [ADDR, ADDR]


class _Sending:
    """A channel that records the frames sent on it."""

    closed = False

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


def test_decode_offers_one_way_and_waits_for_nothing() -> None:
    """The Offer is one frame with no correlation id and no deadline, the OfferRequest
    alone; nothing waits for an answer."""
    local: Any = SimpleNamespace(instance_id="d1")
    peers = ChannelPrefillPeers(lambda: local, ControlOptions(rpc_timeout_s=1.0), Peers())
    channel = _Sending()
    grant = WriteGrant(5, {IndexKind.KV_PAGES: np.array([3, 4], dtype=np.int64)},
                       mailbox_slot=2)
    assert peers.offer(_conn(channel), "r1", 100, grant, 10.0)
    [data] = channel.sent
    kind, correlation, length = HEADER.unpack_from(data)
    assert (kind, correlation, length) == (OFFER, 0, len(data) - HEADER.size)
    request = pb.OfferRequest.FromString(data[HEADER.size:])
    assert (request.request_id, request.instance_id, request.transfer_id,
            request.mailbox_slot, request.lease_ms) == ("r1", "d1", 5, 2, 10_000)


def _answer(accepted: bool = True, digests_follow: bool = True,
            code: grpc.StatusCode = grpc.StatusCode.OK) -> pb.OfferResponse:
    return pb.OfferResponse(request_id="r1", transfer_id=16, accepted=accepted,
                            digests_follow=digests_follow, code=code.value[0],
                            detail="" if code is grpc.StatusCode.OK else "why")


@pytest.mark.parametrize(("answer", "want"), [
    (_answer(True, True), Offered.DIGESTS_FOLLOW),
    (_answer(True, False), Offered.NO_DIGESTS),
    (_answer(False, True), Offered.REFUSED),
    (_answer(code=grpc.StatusCode.NOT_FOUND), Offered.REFUSED),
    (_answer(code=grpc.StatusCode.PERMISSION_DENIED), Offered.REFUSED),
    (_answer(code=grpc.StatusCode.INTERNAL), Offered.UNKNOWN),
    (pb.OfferResponse(request_id="r1", code=4242), Offered.UNKNOWN),
], ids=["kept-digests", "kept-no-digests", "not-accepted", "not-found", "denied",
        "internal", "unknown-code"])
def test_an_offer_answer_maps_to_what_decode_does(answer: pb.OfferResponse,
                                                  want: Offered) -> None:
    assert offer_answer(answer, ADDR) is want


class _Answering:
    """An open channel that answers each Abort with ``answer`` (a Reply or a refusal)."""

    closed = False

    def __init__(self, answer: Reply | PeerChannelError) -> None:
        self.answer = answer
        self.calls: list[tuple[int, pb.AbortRequest, float]] = []

    def start_call(self, kind: int, message: bytes, timeout_s: float) -> Any:
        from concurrent.futures import Future

        self.calls.append((kind, pb.AbortRequest.FromString(message), timeout_s))
        future: Future[Reply] = Future()
        if isinstance(self.answer, Reply):
            future.set_result(self.answer)
        else:
            future.set_exception(self.answer)
        return future


@pytest.mark.parametrize(("answer", "confirmed"), [
    (Reply(b"", 0), True), (Reply(b"", 2), False),
    (PeerChannelError(grpc.StatusCode.NOT_FOUND, "UnknownRequest: r1"), True),
    (PeerChannelError(grpc.StatusCode.UNAVAILABLE, "closed"), False),
], ids=["drained", "in-flight", "unknown-there", "closed"])
def test_an_abort_goes_over_the_channel_and_says_whether_the_peer_confirmed(
        answer: Any, confirmed: bool) -> None:
    channel = _Answering(answer)
    assert _decode_peers().abort(_conn(channel), ADDR, "r1", "failed here", 1.0) is confirmed
    [(kind, request, timeout)] = channel.calls
    assert (kind, request.request_id, request.detail, timeout) == (ABORT, "r1",
                                                                   "failed here", 1.0)


def test_an_abort_whose_channel_closed_goes_over_the_pairs_newer_connection() -> None:
    """The request's connection lost its channel (a BYE: its link was replaced); the
    pair's newer connection carries the Abort. With none, nothing is sent (no RPC, no
    one-off dial): the peer's own deadline ends the request."""
    peers = Peers()
    calls = _decode_peers(peers)
    old = _conn(_Closed())
    assert calls.abort(old, ADDR, "r1", "x") is False  # nothing open to tell it on
    newer_channel = _Answering(Reply(b""))
    peers.add(_conn(newer_channel))
    assert calls.abort(old, ADDR, "r1", "x") is True
    assert [c[1].request_id for c in newer_channel.calls] == ["r1"]
    assert calls.abort(None, ADDR, "r2", "x") is True  # never connected: the pair's one


def test_aborts_at_shutdown_start_at_once_and_count_what_the_peers_confirmed() -> None:
    local: Any = SimpleNamespace(instance_id="d1")
    calls = ChannelPrefillPeers(lambda: local, ControlOptions(rpc_timeout_s=1.0), Peers())
    live = _Answering(Reply(b""))
    busy = _Answering(Reply(b"", 1))
    conns = [_conn(live), _conn(busy), _conn(None)]  # the last has no open channel
    assert calls.abort_all([(conns[0], "a"), (conns[1], "b"), (conns[2], "c")], "bye",
                           0.5) == 1
    assert [c[1].request_id for c in live.calls + busy.calls] == ["a", "b"]
