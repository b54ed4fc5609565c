"""The peer channel (proto/peer_frames.py, server/peers/channel.py): frames, HELLO, calls,
closes, heartbeats.

Real sockets on loopback, two hubs (a "decode" that listens, a "prefill" that dials);
no daemon. What the daemons bind a channel to and do on its loss is in
tests/host/test_peer_channel_daemons.py.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from kvbeam.errors import FrameError
from kvbeam.errors import PeerChannelError as ChannelError
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.proto import peer_frames as pf
from kvbeam.proto.peer_frames import BEGIN_WRITE, HEADER, Hello
from kvbeam.proto.version import PROTOCOL_VERSION
from kvbeam.server.api.decode import DecodeServicer
from kvbeam.server.peers import channel as pc
from kvbeam.server.peers.channel import PeerChannel, PeerChannels
from tests.core_fakes import fake_conn, wait_for
from tests.fake_clock import FakeClock
from tests.fixtures import layout

TOKEN = "t" * 32


class Side:
    """One hub and what reached it."""

    def __init__(self, role: str, *, answer: bool = True, peer_timeout_s: float = 10.0,
                 heartbeat_s: float = 0.1, clock: FakeClock | None = None) -> None:
        self.answer = answer
        self.requests: list[tuple[int, bytes]] = []
        self.closed: list[str] = []
        self.hellos: list[Hello] = []
        self.channels: list[PeerChannel] = []  # bound on their HELLO
        self.hub = PeerChannels(role, self._request, self._closed, on_hello=self._hello,
                                heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s,
                                **({"clock": clock} if clock is not None else {}))

    def _request(self, channel: PeerChannel, kind: int, correlation: int,
                 payload: bytes) -> None:
        _timeout, message = pf.decode_request(payload)
        self.requests.append((kind, message))
        if self.answer:
            channel.reply(correlation, grpc.StatusCode.OK, message=b"re:" + message,
                          in_flight=len(message))

    def _closed(self, channel: PeerChannel, reason: str) -> None:
        self.closed.append(reason)

    def _hello(self, channel: PeerChannel, hello: Hello) -> object:
        self.hellos.append(hello)
        self.channels.append(channel)
        if hello.token != TOKEN:
            raise FrameError("hello.token", "not the token our handshake gave")
        return object()


@pytest.fixture
def decode() -> Iterator[Side]:
    side = Side("decode")
    side.hub.listen("127.0.0.1", 0, "127.0.0.1")
    side.hub.start()
    yield side
    side.hub.stop()


@pytest.fixture
def prefill() -> Iterator[Side]:
    side = Side("prefill")
    side.hub.start()
    yield side
    side.hub.stop()


def _open(prefill: Side, decode: Side, token: str = TOKEN) -> PeerChannel:
    hello = Hello(PROTOCOL_VERSION, "prefill-1", "decode-1", token)
    channel = prefill.hub.connect(decode.hub.address, hello, "decode-1", 5.0)
    channel.bound = object()  # what the daemon binds it to; closes are reported then
    return channel


def _raw(decode: Side) -> socket.socket:
    host, _, port = decode.hub.address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5.0)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


# ---- frames ------------------------------------------------------------------------------
def test_hello_round_trips_and_malformed_ones_name_the_field() -> None:
    hello = Hello(PROTOCOL_VERSION, "p", "d", TOKEN)
    raw = pf.encode_hello(hello)
    kind, _, _length = HEADER.unpack_from(raw)
    assert kind == pf.HELLO and pf.decode_hello(raw[HEADER.size:]) == hello
    payload = raw[HEADER.size:]
    with pytest.raises(FrameError, match="trailing"):
        pf.decode_hello(payload + b"x")
    with pytest.raises(FrameError, match="token"):
        pf.decode_hello(payload[:-5])
    with pytest.raises(FrameError, match="too short"):
        pf.decode_hello(b"\x01")
    bad = struct.pack("<I", 4) + struct.pack("<H", 2) + b"\xff\xfe"
    with pytest.raises(FrameError, match=r"prefill_instance.*UTF-8"):
        pf.decode_hello(bad)


def test_a_reply_carries_the_status_details_and_writes_in_flight() -> None:
    raw = pf.encode_reply(7, grpc.StatusCode.NOT_FOUND, "UnknownRequest: r")
    kind, correlation, _ = HEADER.unpack_from(raw)
    assert (kind, correlation) == (pf.REPLY, 7)
    refused = pf.decode_reply(raw[HEADER.size:])
    assert isinstance(refused, ChannelError)
    assert refused.code() is grpc.StatusCode.NOT_FOUND
    assert refused.details() == "UnknownRequest: r"
    ok = pf.decode_reply(pf.encode_reply(8, grpc.StatusCode.OK, message=b"m",
                                         in_flight=3)[HEADER.size:])
    assert ok == pf.Reply(b"m", 3)
    with pytest.raises(FrameError, match="unknown status code"):
        pf.decode_reply(struct.pack("<BII", 200, 0, 0))
    with pytest.raises(FrameError, match="runs past"):
        pf.decode_reply(struct.pack("<BII", 0, 0, 10) + b"abc")


def test_a_payload_over_the_limit_is_refused_when_encoding() -> None:
    with pytest.raises(FrameError, match="over the limit"):
        pf.frame(pf.PING, 0, b"\0" * (pf.MAX_PAYLOAD + 1))


# ---- calls -------------------------------------------------------------------------------
def test_calls_are_answered_by_correlation_id_many_at_once(prefill: Side,
                                                          decode: Side) -> None:
    channel = _open(prefill, decode)
    futures = [channel.start_call(BEGIN_WRITE, f"m{i}".encode(), 5.0) for i in range(50)]
    replies = [f.result(10) for f in futures]
    assert [r.payload for r in replies] == [f"re:m{i}".encode() for i in range(50)]
    assert all(r.in_flight == len(f"m{i}") for i, r in enumerate(replies))
    assert decode.hellos == [Hello(PROTOCOL_VERSION, "prefill-1", "decode-1", TOKEN)]
    assert channel.call(BEGIN_WRITE, b"d", 5.0).payload == b"re:d"


def test_a_request_the_receiver_does_not_serve_closes_the_channel(prefill: Side,
                                                                  decode: Side) -> None:
    channel = _open(prefill, decode)
    # OFFER goes decode -> prefill only: decode refuses it on an established channel.
    with pytest.raises(ChannelError) as err:
        channel.call(pf.OFFER, b"x", 5.0)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert wait_for(lambda: channel.closed)
    assert wait_for(lambda: prefill.closed), prefill.closed
    # The hub still serves: a new channel works.
    assert _open(prefill, decode).call(BEGIN_WRITE, b"y", 5.0).payload == b"re:y"


def test_a_call_unanswered_fails_with_deadline_exceeded() -> None:
    clock = FakeClock()
    caller = Side("prefill", clock=clock)
    silent = Side("decode", answer=False)
    silent.hub.listen("127.0.0.1", 0, "127.0.0.1")
    caller.hub.start()
    silent.hub.start()
    try:
        channel = _open(caller, silent)
        answer = channel.start_call(BEGIN_WRITE, b"x", 0.3)
        assert wait_for(lambda: silent.requests, 10.0)
        clock.advance(0.29)
        assert clock.wait_reads()
        assert not answer.done()  # not before its deadline
        clock.advance(0.02)
        err = answer.exception(10.0)
        assert isinstance(err, ChannelError), err
        assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no answer in time" in str(err.details())  # the hub's expiry, not a backstop
        assert not channel.closed  # a slow answer is not a lost peer
    finally:
        caller.hub.stop()
        silent.hub.stop()


def test_the_peer_closing_fails_waiting_calls_at_once_and_reports_the_loss(
        prefill: Side) -> None:
    silent = Side("decode", answer=False)
    silent.hub.listen("127.0.0.1", 0, "127.0.0.1")
    silent.hub.start()
    channel = _open(prefill, silent)
    future = channel.start_call(BEGIN_WRITE, b"x", 30.0)
    assert wait_for(lambda: silent.requests)
    silent.hub.stop()  # closes its end (a BYE-less close: the peer's process went)
    with pytest.raises(ChannelError) as err:
        future.result(5.0)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert wait_for(lambda: prefill.closed)  # EOF or a reset, by timing: never orderly
    assert not channel.orderly


def test_bye_is_an_orderly_close(prefill: Side, decode: Side) -> None:
    channel = _open(prefill, decode)
    assert wait_for(lambda: len(decode.hub._channels) == 1)
    (theirs,) = decode.hub._channels
    theirs.bound = object()
    channel.close("link replaced", bye=True)
    assert wait_for(lambda: theirs.closed)
    assert theirs.orderly and "link replaced" in theirs.close_reason


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of one loopback TCP connection (a socketpair has no resets)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname(), timeout=5.0)
        theirs, _ = listener.accept()
    return ours, theirs


def test_a_bye_before_a_reset_under_a_writer_is_still_an_orderly_close() -> None:
    # The peer said BYE and closed with our PING unread, so its kernel reset the
    # connection; our next send fails. The BYE is read before the close is judged, so
    # the peer counts as alive (only its link went), not gone. No selector thread: the
    # test runs the hub's tick itself, so the send surely fails first.
    closed: list[str] = []
    hub = PeerChannels("decode", lambda *a: None, lambda c, why: closed.append(why))
    ours, theirs = _tcp_pair()
    ours.setblocking(False)
    channel = PeerChannel(hub, ours, "prefill p")
    channel.bound = object()
    try:
        channel.send(pf.frame(pf.PING, 0))
        theirs.sendall(pf.frame(pf.BYE, 0, b"link replaced"))
        time.sleep(0.1)  # our PING sits unread in its buffer: the close resets
        theirs.close()
        time.sleep(0.1)
        for _ in range(3):  # the first send after a reset may still be taken
            channel.send(pf.frame(pf.PING, 0))
        hub.tick(time.monotonic())
        assert channel.closed
        assert channel.orderly, channel.close_reason
        assert "link replaced" in channel.close_reason
    finally:
        hub.stop()


def test_a_connect_that_gives_up_before_the_welcome_says_bye(prefill: Side) -> None:
    # Decode may bind the channel after we stopped waiting: a BYE tells it we live on.
    with socket.create_server(("127.0.0.1", 0)) as mute:
        address = f"127.0.0.1:{mute.getsockname()[1]}"
        hello = Hello(PROTOCOL_VERSION, "prefill-1", "decode-1", TOKEN)
        with pytest.raises(TimeoutError, match=r"no WELCOME within 0\.3 s"):
            prefill.hub.connect(address, hello, "decode-1", 0.3)
        conn, _ = mute.accept()
        with conn:
            conn.settimeout(5.0)
            got = b""
            while chunk := conn.recv(4096):
                got += chunk
    kind, _, length = HEADER.unpack_from(got)
    assert kind == pf.HELLO
    after = HEADER.size + length
    kind, _, length = HEADER.unpack_from(got, after)
    assert kind == pf.BYE
    assert b"gave up" in got[after + HEADER.size:], got


# ---- HELLO and refusals ------------------------------------------------------------------
def test_a_wrong_token_is_refused_before_any_frame_is_served(prefill: Side,
                                                             decode: Side) -> None:
    with pytest.raises(ConnectionError, match="refused our HELLO"):
        _open(prefill, decode, token="x" * 32)
    assert not decode.hub._channels


def test_a_first_frame_that_is_not_a_hello_is_dropped(decode: Side) -> None:
    sock = _raw(decode)
    sock.sendall(pf.frame(pf.PING, 0))
    assert _recv_exact(sock, HEADER.size) == b""  # closed, no WELCOME
    sock.close()


def test_an_oversize_frame_closes_the_channel_naming_the_peer(decode: Side,
                                                              caplog: Any) -> None:
    sock = _raw(decode)
    sock.sendall(pf.encode_hello(Hello(PROTOCOL_VERSION, "p", "d", TOKEN)))
    assert HEADER.unpack(_recv_exact(sock, HEADER.size))[0] == pf.WELCOME
    assert wait_for(lambda: len(decode.hub._channels) == 1)
    sock.sendall(HEADER.pack(pf.BEGIN_WRITE, 1, pf.MAX_PAYLOAD + 1))
    assert _recv_exact(sock, 1) == b""  # the channel was closed
    assert wait_for(lambda: decode.closed)
    assert "over the limit" in decode.closed[0], decode.closed
    sock.close()


def test_a_peer_that_sends_no_hello_is_dropped_after_the_timeout() -> None:
    clock = FakeClock()
    side = Side("decode", clock=clock)
    side.hub.listen("127.0.0.1", 0, "127.0.0.1")
    side.hub.start()
    try:
        sock = _raw(side)
        assert wait_for(lambda: side.hub._pending, 10.0)  # accepted: its deadline is set
        clock.advance(pc.HELLO_TIMEOUT_S)
        assert clock.wait_reads()
        assert side.hub._pending  # not before its deadline
        clock.advance(0.01)
        sock.settimeout(10.0)
        assert _recv_exact(sock, 1) == b""
        sock.close()
    finally:
        side.hub.stop()


def _welcomed(side: Side) -> socket.socket:
    """Start ``side``'s hub listening and open a raw "prefill" socket that it welcomed."""
    side.hub.listen("127.0.0.1", 0, "127.0.0.1")
    side.hub.start()
    sock = _raw(side)
    sock.sendall(pf.encode_hello(Hello(PROTOCOL_VERSION, "p", "d", TOKEN)))
    assert HEADER.unpack(_recv_exact(sock, HEADER.size))[0] == pf.WELCOME
    return sock


def test_a_silent_peer_is_lost_after_peer_timeout() -> None:
    # Decode's hub; the "prefill" is a raw socket that answers nothing after the
    # WELCOME (a frozen process). Lost after heartbeat_s + peer_timeout_s of silence.
    clock = FakeClock()
    side = Side("decode", peer_timeout_s=5.0, heartbeat_s=1.0, clock=clock)
    try:
        sock = _welcomed(side)
        clock.advance(5.9)
        assert clock.wait_reads()
        assert not side.closed, side.closed  # not before the limit
        clock.advance(0.2)
        assert wait_for(lambda: side.closed, 10.0)
        assert "stopped answering heartbeats" in side.closed[0]
        assert "6 s allowed" in side.closed[0]
        sock.close()
    finally:
        side.hub.stop()


def test_heartbeats_far_apart_do_not_lose_an_idle_peer_after_the_timeout_alone() -> None:
    # --heartbeat-s 3600 (tests that want no beats): a quiet but live peer is not lost
    # when peer_timeout_s of silence passed; it gets a whole interval more to speak.
    clock = FakeClock()
    side = Side("decode", peer_timeout_s=0.2, heartbeat_s=30.0, clock=clock)
    assert side.hub.silence_limit_s == 30.2
    try:
        sock = _welcomed(side)
        clock.advance(1.0)  # five peer timeouts of silence
        assert clock.wait_reads()
        assert not side.closed, side.closed
        clock.advance(29.3)  # past the interval and the timeout: lost now
        assert wait_for(lambda: side.closed, 10.0)
        sock.close()
    finally:
        side.hub.stop()


def test_a_silent_peer_counts_missed_heartbeats_on_its_connection_until_it_speaks() -> None:
    # Decode offers nothing to a peer that misses heartbeats, prefill waits for no offer
    # of it: the peer's connection reads the count of its open channel (none: 0).
    clock = FakeClock()
    side = Side("decode", peer_timeout_s=30.0, heartbeat_s=1.0, clock=clock)
    try:
        sock = _welcomed(side)  # a "prefill" that goes silent after the WELCOME
        channel = side.channels[0]
        conn = fake_conn("127.0.0.1:9", AllocatedSide(layout()))
        conn.channel = channel
        assert conn.missed_heartbeats == 0
        clock.advance(2.5)  # silent for two whole intervals: one heartbeat missed
        assert conn.missed_heartbeats == 1
        clock.advance(1.0)
        assert conn.missed_heartbeats == 2
        sock.sendall(pf.frame(pf.PING, 0))  # it speaks: counted from its last frame
        assert wait_for(lambda: conn.missed_heartbeats == 0, 10.0)
        assert conn.unchanneled_for(time.monotonic()) == 0.0
        channel.close("test over")
        assert conn.missed_heartbeats == 0  # no open channel: nothing counted
        assert conn.unchanneled_for(time.monotonic() + 5.0) >= 5.0
        sock.close()
    finally:
        side.hub.stop()


def test_heartbeats_keep_an_idle_channel_alive() -> None:
    # Both hubs on one clock; each step is a heartbeat interval, several silence limits
    # in all: every step's PING is answered, so neither side is ever silent too long.
    clock = FakeClock()
    prefill = Side("prefill", peer_timeout_s=0.6, heartbeat_s=1.0, clock=clock)
    side = Side("decode", peer_timeout_s=0.6, heartbeat_s=1.0, clock=clock)
    side.hub.listen("127.0.0.1", 0, "127.0.0.1")
    prefill.hub.start()
    side.hub.start()
    try:
        channel = _open(prefill, side)
        assert wait_for(lambda: side.channels, 10.0)
        theirs = side.channels[0]
        for _ in range(5):  # 5 s: three silence limits (1.6 s)
            now = clock.advance(1.0)
            assert wait_for(lambda t=now: channel.last_heard >= t and theirs.last_heard >= t,
                            10.0), (now, channel.last_heard, theirs.last_heard)
        assert not channel.closed and not side.closed and not prefill.closed
        assert channel.call(BEGIN_WRITE, b"z", 5.0).payload == b"re:z"
    finally:
        prefill.hub.stop()
        side.hub.stop()


def test_a_stalled_peer_fails_when_its_send_buffer_fills(
        prefill: Side, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pc, "MAX_OUTBOUND", 1 << 20)
    side = Side("decode", answer=False)
    side.hub.listen("127.0.0.1", 0, "127.0.0.1")
    side.hub.start()
    held = threading.Event()
    try:
        channel = _open(prefill, side)
        assert side.hub._loop is not None

        def stall() -> None:
            held.wait(60)

        side.hub._loop.call_soon_threadsafe(stall)  # its loop stops reading: the peer stalls
        done = threading.Event()

        def flood() -> None:
            for _ in range(200):
                channel.start_call(BEGIN_WRITE, b"\0" * (256 << 10), 30.0)
                if channel.closed:
                    break
            done.set()

        threading.Thread(target=flood, daemon=True).start()
        assert done.wait(30.0), "a writer blocked on a stalled peer"
        assert channel.closed and "stopped reading" in channel.close_reason
    finally:
        held.set()
        side.hub.stop()


# ---- decode binds a channel to the verified prefill -------------------------------------
class _Conn:
    def __init__(self, token: str) -> None:
        self.instance_id = "prefill-1"
        self.control_address = "127.0.0.1:1"
        self.channel_token = token
        self.channel: Any = None
        self.closed = False


class _Chan:
    def __init__(self) -> None:
        self.peer = "127.0.0.1:2"
        self.closes: list[tuple[str, bool]] = []

    def close(self, reason: str, *, bye: bool = False) -> None:
        self.closes.append((reason, bye))


def _decode_servicer(conn: _Conn | None) -> Any:
    peers = SimpleNamespace(get=lambda iid: conn if conn and iid == conn.instance_id else None)
    return SimpleNamespace(local=SimpleNamespace(instance_id="decode-1"),
                           rt=SimpleNamespace(peers=peers))


@pytest.mark.parametrize(("hello", "field"), [
    (Hello(PROTOCOL_VERSION - 1, "prefill-1", "decode-1", TOKEN), "hello.version"),
    (Hello(PROTOCOL_VERSION, "prefill-1", "decode-0", TOKEN), "hello.decode_instance"),
    (Hello(PROTOCOL_VERSION, "prefill-9", "decode-1", TOKEN), "hello.prefill_instance"),
    (Hello(PROTOCOL_VERSION, "prefill-1", "decode-1", "y" * 32), "hello.token"),
])
def test_decode_refuses_a_hello_naming_the_field(hello: Hello, field: str) -> None:
    servicer = _decode_servicer(_Conn(TOKEN))
    with pytest.raises(FrameError) as err:
        DecodeServicer.channel_hello(servicer, _Chan(), hello)  # type: ignore[arg-type]
    assert err.value.field == field, err.value


def test_a_new_channel_from_the_same_prefill_replaces_the_old_one_at_once() -> None:
    conn = _Conn(TOKEN)
    servicer = _decode_servicer(conn)
    hello = Hello(PROTOCOL_VERSION, "prefill-1", "decode-1", TOKEN)
    first, second = _Chan(), _Chan()
    bind: Any = DecodeServicer.channel_hello
    assert bind(servicer, first, hello) is conn
    assert conn.channel is first and first.peer.startswith("prefill prefill-1")
    assert bind(servicer, second, hello) is conn
    assert conn.channel is second
    assert first.closes == [("replaced by a new channel from the same prefill", True)]
