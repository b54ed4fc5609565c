"""The engine channel's frames and the daemon's handling of untrusted ones (no daemon)."""

from __future__ import annotations

import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvbeam.errors import BadRequest
from kvbeam.pools.types import IndexKind
from kvbeam.proto import engine_frames as ef
from kvbeam.server.engines.channel import EngineChannel
from kvbeam.states import FailureReason, TransferState, TransferStatus


def _body(frame: bytes) -> bytes:
    return frame[4:]


def test_every_frame_round_trips() -> None:
    lists = {IndexKind.KV_PAGES: np.array([5, 1, 9]), IndexKind.REQ_SLOT: np.array([3])}
    draft = {IndexKind.KV_PAGES: np.array([7, 8, 2])}
    frames: list[ef.EngineFrame | ef.DaemonFrame] = [
        ef.Reserve("r-1", 700, "127.0.0.1:5", lists, draft),
        ef.Reserve("r-1", 700, "127.0.0.1:5", lists, {}, kv_skip=3),
        ef.Decline("r-1", "127.0.0.1:5", "holds it all"),
        ef.Send("r-1", 700, "127.0.0.1:6", True, lists, {}),
        ef.Send("r-1", 700, "127.0.0.1:6", False, {IndexKind.KV_PAGES: np.array([4])}, {},
                kv_offset=1),
        ef.Send("r-1", 700, "127.0.0.1:6", True, lists, {}, kv_offset=2),
        ef.Send("r-1", 700, "127.0.0.1:6", False, {IndexKind.KV_PAGES: np.array([4])}, {},
                kv_offset=0, layers=3),
        ef.Send("r-1", 700, "127.0.0.1:6", False, None, None, kv_offset=1, layers=61),
        ef.Abort("r-1", "why"), ef.Release("r-1"),
        ef.State("r-1", TransferState.FAILED, FailureReason.TIMEOUT, 3, "late"),
        ef.Error("", "length", "too long")]
    kinds = (*ef.ENGINE_KINDS, ef.STATE, ef.ERROR)
    for f in frames:
        back = ef.decode(_body(ef.encode(f)), kinds)
        assert type(back) is type(f)
        for name in ("request_id", "seq_len", "final", "detail", "state", "reason",
                     "kv_offset", "kv_skip", "prefill_address", "layers"):
            assert getattr(back, name, None) == getattr(f, name, None), name
        for name in ("indices", "draft"):
            a, b = getattr(back, name, None) or {}, getattr(f, name, None) or {}
            assert a.keys() == b.keys()
            for k in a:
                assert np.array_equal(a[k], b[k])


@pytest.mark.parametrize(("mangle", "field"), [
    (lambda b: b[:-1], "lists[1].indices"),          # truncated inside a list
    (lambda b: bytes([1]) + b[1:], "version"),        # another version (1: big-endian)
    (lambda b: b[:1] + bytes([99]) + b[2:], "kind"),  # an unknown kind
    (lambda b: b + b"\0", "length"),                  # trailing bytes
    (lambda b: b[:4], "request_id"),                  # the id cut short
])
def test_a_malformed_frame_is_refused_naming_the_field(mangle: object, field: str) -> None:
    body = _body(ef.encode(ef.Reserve("rid", 700, "h:1", {IndexKind.KV_PAGES: np.arange(3),
                                                          IndexKind.REQ_SLOT: np.arange(1)})))
    with pytest.raises(ef.FrameError) as info:
        ef.decode(mangle(body))  # type: ignore[operator]
    assert info.value.field == field, str(info.value)


@pytest.mark.parametrize(("final", "lists"), [(False, True), (True, False), (False, False)],
                         ids=["chunk-whole-lists", "final-no-lists", "chunk-no-lists"])
def test_a_send_without_kv_offset_is_the_whole_request(final: bool, lists: bool) -> None:
    """One way to send in chunks (pieces, kv_offset): a SEND without it is the whole
    request in one frame, final, with its lists; anything else is refused naming
    kv_offset, when encoding and when decoding."""
    whole = {IndexKind.KV_PAGES: np.arange(2)}
    frame = ef.Send("r", 700, "h:1", final, whole if lists else None, None)
    with pytest.raises(ef.FrameError) as info:
        ef.encode(frame)
    assert info.value.field == "kv_offset"
    good = _body(ef.encode(ef.Send("r", 700, "h:1", True, whole, None)))
    flags_at = 1 + 1 + 2 + 1 + 4 + 2 + len("h:1")  # version, kind, id, seq_len, address
    bad = good[:flags_at] + bytes([int(final) | (ef.HAS_LISTS if lists else 0)]) \
        + good[flags_at + 1:]
    with pytest.raises(ef.FrameError) as info:
        ef.decode(bad if lists else bad[:flags_at + 1])
    assert info.value.field == "kv_offset"


@pytest.mark.parametrize(("frame", "why"), [
    (ef.Send("r", 700, "h:1", True, {IndexKind.KV_PAGES: np.arange(2)}, None, kv_offset=0,
             layers=2), "only a piece that is not final"),
    (ef.Send("r", 700, "h:1", True, {IndexKind.KV_PAGES: np.arange(2)}, None, layers=2),
     "only a piece that is not final"),
    (ef.Send("r", 700, "h:1", False, None, None, kv_offset=0, layers=0), "1..65535"),
], ids=["final", "whole", "zero"])
def test_only_a_piece_that_is_not_final_names_its_layers(frame: ef.Send, why: str) -> None:
    """LAYERS: refused naming ``layers`` when encoding, and on the wire when decoding
    (the flag on a final frame or a whole request, a count of 0)."""
    with pytest.raises(ef.FrameError) as info:
        ef.encode(frame)
    assert info.value.field == "layers" and why in str(info.value)
    piece = _body(ef.encode(ef.Send("r", 700, "h:1", False, None, None, kv_offset=0,
                                    layers=2)))
    flags_at = 1 + 1 + 2 + 1 + 4 + 2 + len("h:1")
    final = piece[:flags_at] + bytes([piece[flags_at] | ef.FINAL | ef.HAS_LISTS]) \
        + piece[flags_at + 1:] + b"\0"  # an empty list section
    zero = piece[:-2] + b"\0\0"
    for bad, words in ((final, "only a piece that is not final"), (zero, "at least 1")):
        with pytest.raises(ef.FrameError) as info:
            ef.decode(bad)
        assert info.value.field == "layers" and words in str(info.value)


def test_a_reserve_without_kv_skip_is_the_old_frame_and_kv_skip_is_bounded() -> None:
    lists = {IndexKind.KV_PAGES: np.arange(2)}
    plain = ef.encode(ef.Reserve("rid", 700, "h:1", lists))
    skipped = ef.encode(ef.Reserve("rid", 700, "h:1", lists, kv_skip=5))
    assert skipped[4:] == plain[4:] + struct.pack("<I", 5)  # a trailing u32, only when set
    back = ef.decode(_body(skipped))
    assert isinstance(back, ef.Reserve) and back.kv_skip == 5
    with pytest.raises(ef.FrameError) as info:
        ef.encode(ef.Reserve("rid", 700, "h:1", lists, kv_skip=-1))
    assert info.value.field == "kv_skip"


def test_an_unknown_index_kind_and_a_repeated_list_are_refused() -> None:
    good = _body(ef.encode(ef.Reserve("rid", 7, "h:1", {IndexKind.KV_PAGES: np.arange(2)})))
    head = 4 + 3 + 4 + 2 + 3  # version/kind/idlen, "rid", seq_len, address
    bad_kind = bytearray(good)
    bad_kind[head + 2] = 77  # count byte, pool byte, then the kind
    with pytest.raises(ef.FrameError, match=r"lists\[0\].kind: unknown index kind 77"):
        ef.decode(bytes(bad_kind))
    twice = ef.encode(ef.Reserve("rid", 7, "h:1", {IndexKind.KV_PAGES: np.arange(2)}))
    twice_body = bytearray(_body(twice))
    twice_body[head] = 2
    twice_body += twice_body[head + 1:]
    with pytest.raises(ef.FrameError, match=r"lists\[1\].kind: KV_PAGES appears twice"):
        ef.decode(bytes(twice_body))


def test_an_oversize_length_is_refused_before_its_body_arrives() -> None:
    buf = ef.FrameBuffer(limit=1024)
    with pytest.raises(ef.FrameError, match="frame of 1025 bytes announced") as info:
        buf.feed(struct.pack("<I", 1025))  # only the 4-byte prefix: no body was read
    assert info.value.field == "length"
    assert "big-endian" not in str(info.value)


def test_a_big_endian_length_of_an_older_engine_is_named_as_such() -> None:
    # Engine frames before version 2 had big-endian integers: their length reads huge.
    with pytest.raises(ef.FrameError, match=r"read big-endian it is 300 bytes: the peer is "
                                            r"a kvbeam whose engine framing is older") as info:
        ef.FrameBuffer().feed(struct.pack(">I", 300))
    assert info.value.field == "length"


def test_frames_split_and_coalesced_arrive_whole() -> None:
    data = b"".join(ef.encode(ef.Release(f"r{i}")) for i in range(5))
    buf = ef.FrameBuffer()
    got = []
    for i in range(0, len(data), 3):
        got += buf.feed(data[i:i + 3])
    assert [ef.decode(b).request_id for b in got] == [f"r{i}" for i in range(5)]
    assert buf.pending == 0


class _Ops:
    def __init__(self) -> None:
        self.seen: list[str] = []
        self.live: set[str] = set()  # what the fake core holds live

    def reserve(self, frame: ef.Reserve) -> None:
        if frame.seq_len == 13:
            raise BadRequest("seq_len 13 is unlucky")
        self.seen.append(f"reserve {frame.request_id}")

    def send(self, frame: ef.Send) -> None:
        self.seen.append(f"send {frame.request_id}")

    def abort(self, frame: ef.Abort) -> None:
        self.seen.append(f"abort {frame.request_id}")

    def release(self, frame: ef.Release) -> None:
        raise RuntimeError("a bug in the core")

    def decline(self, frame: ef.Decline) -> None:
        self.seen.append(f"decline {frame.request_id}")

    def refused(self, frame: ef.EngineFrame, exc: Exception) -> None:
        self.seen.append(f"refused {frame.request_id}")

    def holds(self, request_id: str) -> bool:
        return request_id in self.live

    def known(self, request_id: str) -> bool:
        return request_id in self.live


def _pushed(sock: socket.socket, channel: EngineChannel) -> list[ef.DaemonFrame]:
    assert channel.flush()
    sock.settimeout(2)
    buf = ef.FrameBuffer()
    out: list[bytes] = []
    while not out:
        out = buf.feed(sock.recv(65536))
    return [ef.decode(b, (ef.STATE, ef.ERROR)) for b in out]  # type: ignore[misc]


def test_the_daemon_channel_answers_every_bad_frame_and_keeps_serving() -> None:
    ops = _Ops()
    daemon, engine = socket.socketpair()
    with ThreadPoolExecutor(1) as io:
        ch = EngineChannel(ops, io)
        ch.bind(daemon)
        body = _body(ef.encode(ef.Reserve("r1", 7, "h:1")))
        engine.sendall(ef.encode(ef.Reserve("r1", 13, "h:1"))  # refused by the core
                       + struct.pack("<I", len(body) - 1) + body[:-1]  # truncated
                       + ef.encode(ef.Reserve("bad id!", 7, "h:1"))  # not a request id
                       + ef.encode(ef.Release("r0"))  # an unexpected error
                       + ef.encode(ef.Reserve("r2", 7, "h:1")))
        assert ch.readable(daemon) == []
        errors = _pushed(engine, ch)
        assert [(e.request_id, e.field) for e in errors if isinstance(e, ef.Error)] == [
            ("r1", "reserve"), ("r1", "lists"), ("bad id!", "request_id"), ("r0", "release")]
        assert "seq_len 13 is unlucky" in errors[0].message  # type: ignore[union-attr]
        # A refused RESERVE leaves the daemon holding nothing of it: Failed follows its
        # ERROR, so the engine ends the request; a refused RELEASE changes no state.
        ended = [(e.request_id, e.state, e.reason) for e in errors if isinstance(e, ef.State)]
        assert ended == [(rid, TransferState.FAILED, FailureReason.INVALID_REQUEST)
                         for rid in ("r1", "r1", "bad id!")], ended
        assert ops.seen == ["refused r1", "refused r0", "reserve r2"]
        # Only the requests it started here are pushed: r2, not r1 (refused) nor others.
        for rid in ("r1", "r2", "grpc-started"):
            ch.on_change(TransferStatus(rid, "p", TransferState.SUCCESS, None, "ok", 2, 0.1))
        pushed = _pushed(engine, ch)
        assert [(p.request_id, p.state) for p in pushed] == [  # type: ignore[union-attr]
            ("r2", TransferState.SUCCESS)]
        ch.close()
    daemon.close()
    engine.close()


def test_decode_pushes_a_failed_state_once_the_requests_pages_are_freed() -> None:
    """Decode's channel (failed_when_freed) holds a request's Failed back until the core
    frees its pages (on_freed), in either order; other states go at once."""
    daemon, engine = socket.socketpair()
    with ThreadPoolExecutor(1) as io:
        ch = EngineChannel(_Ops(), io, failed_when_freed=True)
        ch.bind(daemon)
        engine.sendall(b"".join(ef.encode(ef.Reserve(r, 7, "h:1")) for r in ("a", "b")))
        assert ch.readable(daemon) == []

        def snap(rid: str, state: TransferState, version: int) -> TransferStatus:
            reason = FailureReason.ABORTED if state is TransferState.FAILED else None
            return TransferStatus(rid, "p", state, reason, "x", version, 0.1)

        ch.on_change(snap("a", TransferState.BOOTSTRAPPING, 0))
        assert [(p.request_id, p.state) for p in _pushed(engine, ch)] == [  # type: ignore[union-attr]
            ("a", TransferState.BOOTSTRAPPING)]
        ch.on_change(snap("a", TransferState.FAILED, 1))  # prefill may still write: held
        ch.on_freed("b")  # b freed before it failed (its Failed then goes at once)
        assert ch.flush()
        engine.setblocking(False)
        with pytest.raises(BlockingIOError):
            engine.recv(1)
        engine.setblocking(True)
        ch.on_freed("a")
        ch.on_change(snap("b", TransferState.FAILED, 1))
        ch.on_freed("zzz")  # not the engine's: nothing
        pushed = _pushed(engine, ch)
        assert [(p.request_id, p.state) for p in pushed] == [  # type: ignore[union-attr]
            ("a", TransferState.FAILED), ("b", TransferState.FAILED)]
        ch.close()
    daemon.close()
    engine.close()


def test_a_pushed_state_goes_out_at_once_and_a_full_socket_keeps_the_order() -> None:
    """A state pushed with nothing queued is on the socket before the push returns (no
    flush by the loop thread); once the socket is full, later states queue behind
    what it did not take, and the flush delivers every frame whole and in order."""
    daemon, engine = socket.socketpair()
    daemon.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with ThreadPoolExecutor(1) as io:
        ch = EngineChannel(_Ops(), io)
        ch.bind(daemon)
        n = 400
        engine.sendall(b"".join(ef.encode(ef.Reserve(f"r{i}", 7, "h:1")) for i in range(n)))
        while len(ch._mine) < n:  # the requests it started here
            ch.readable(daemon)

        def state(i: int) -> TransferStatus:
            return TransferStatus(f"r{i}", "p", TransferState.SUCCESS, None, "d" * 200, 2, 0.1)

        ch.on_change(state(0))
        engine.settimeout(2)
        first = ef.FrameBuffer().feed(engine.recv(65536))  # no flush() was called
        assert [ef.decode(b, (ef.STATE,)).request_id for b in first] == ["r0"]
        for i in range(1, n):  # more than the socket takes unread
            ch.on_change(state(i))
        assert len(ch._out) > 0, "the socket took everything: the test filled nothing"
        buf, got = ef.FrameBuffer(), list[bytes]()
        engine.setblocking(False)
        while len(got) < n - 1:
            ch.flush()
            try:
                got += buf.feed(engine.recv(65536))
            except BlockingIOError:
                time.sleep(0.001)
        assert [ef.decode(b, (ef.STATE,)).request_id for b in got] == [
            f"r{i}" for i in range(1, n)]
        assert buf.pending == 0 and ch.flush()
        ch.close()
    daemon.close()
    engine.close()
