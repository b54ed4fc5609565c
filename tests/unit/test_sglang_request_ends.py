"""Every sglang request ends, with its cause: kvbeam's sender and receiver, driven as
sglang's queues drive them, against a real bootstrap store and engine channels whose
daemon end the test holds (closing it is the daemon's death; nothing answers on it
otherwise).

The issue's hang: after decode's daemon died, decode failed new requests at once and
sglang's ``clear()`` deleted their rooms; a prefill sender that polled after that read
"not posted yet" forever (2 of 6 requests, more than 6.5 minutes). Now the side that
gives up leaves its cause in the room, and sglang's deadlines bound every wait.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvbeam.auth import Security
from kvbeam.engine.channel import EngineChannel
from kvbeam.integrations.sglang import bootstrap
from kvbeam.integrations.sglang.conn import (
    PREFILL_KEY,
    KvbeamKVManager,
    KvbeamKVReceiver,
    KvbeamKVSender,
)
from kvbeam.integrations.sglang.scheduler import ManagerMembers
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.sglang_mha import sglang_mha_spec
from kvbeam.pools.spec import SideConfig
from kvbeam.proto import engine_frames as ef

FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING = 0, 1, 2, 3


def _config(**over: Any) -> SideConfig:
    values: dict[str, Any] = dict(num_layers=2, page_size=1, num_kv_heads=2, head_dim=4,
                                  dtype="float16", token_rows=65, aux_item_lens=(64,),
                                  aux_rows=8, max_inflight=8)
    values.update(over)
    return SideConfig(model="m", target=sglang_mha_spec(**values))


@dataclass
class Side:
    """One side's manager over an engine channel; ``daemon`` is the daemon's socket end."""

    mgr: KvbeamKVManager
    daemon: socket.socket

    @property
    def channel(self) -> EngineChannel:
        channel = self.mgr.attachment.channel
        assert channel is not None
        return channel

    def close(self) -> None:
        self.channel.close()
        self.daemon.close()

    def kill_daemon(self) -> None:
        self.daemon.close()
        channel = self.channel
        deadline = time.monotonic() + 10
        while not channel.closed_reason:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def frames(self) -> list[Any]:
        """The frames the engine wrote to its daemon so far."""
        self.daemon.settimeout(0.5)
        buf = ef.FrameBuffer()
        out: list[Any] = []
        try:
            while True:
                data = self.daemon.recv(1 << 16)
                if not data:
                    break
                out += [ef.decode(b) for b in buf.feed(data)]
        except TimeoutError:
            pass
        return out


def _side(mode: str, config: SideConfig, daemon: str, timeouts: float = 300.0) -> Side:
    engine_end, daemon_end = socket.socketpair()
    mgr = object.__new__(KvbeamKVManager)  # the members the requests use, no attach
    mgr.mode, mgr.config, mgr.layout = mode, config, build_side_layout(config)
    mgr.security, mgr.daemon, mgr.server_args = Security(), daemon, None
    mgr.bootstrap_timeout = mgr.waiting_timeout = timeouts
    mgr.tombstone_ttl = 2 * timeouts
    mgr._peer_checks = {}
    ManagerMembers._init_scheduler_members(mgr)
    mgr.attachment = SimpleNamespace(  # type: ignore[assignment]  # what requests read
        channel=EngineChannel(engine_end, f"{mode}.sock"), attached=True, path=f"{mode}.sock")
    return Side(mgr, daemon_end)


@pytest.fixture
def store() -> Iterator[str]:
    server = bootstrap.BootstrapServer("127.0.0.1", 0)
    try:
        yield server.address
    finally:
        server.close()


@pytest.fixture
def sides(store: str) -> Iterator[tuple[Side, Side]]:
    prefill = _side("prefill", _config(), "127.0.0.1:1")
    decode = _side("decode", _config(), "127.0.0.1:2")
    bootstrap.call(store, "put", PREFILL_KEY, prefill.mgr.registration())
    try:
        yield prefill, decode
    finally:
        for side in (prefill, decode):
            side.close()


def _reserve(rx: KvbeamKVReceiver, pages: int = 5) -> None:
    rx.init(0)
    rx.send_metadata(np.arange(pages, dtype=np.int32), 0, None)


def _error(obj: Any) -> str:
    with pytest.raises(RuntimeError) as info:
        obj.failure_exception()
    return str(info.value)


def test_a_dead_decode_daemon_ends_prefills_waiting_request_after_sglang_cleared_it(
        store: str, sides: tuple[Side, Side]) -> None:
    prefill, decode = sides
    rx = KvbeamKVReceiver(decode.mgr, store, 7)
    rx.init(0)
    decode.kill_daemon()  # between decode's lookup and its reservation
    rx.send_metadata(np.arange(5, dtype=np.int32), 0, None)
    assert rx.poll() == FAILED  # the reservation failed at once: no daemon
    assert "closed the attach socket" in _error(rx)
    rx.clear()  # what sglang's decode queue does with a failed request
    # The room still says why (it used to be deleted here: prefill then waited forever).
    room = bootstrap.call(store, "get", "room.7")
    assert room["aborted"] and "closed the attach socket" in room["reason"]
    tx = KvbeamKVSender(prefill.mgr, store, 7)  # prefill's first poll comes after that
    tx.init(5, 0)
    assert tx.poll() == FAILED
    assert "decode gave room 7 up: kvbeam request sglang-7 failed: shutdown" in _error(tx)
    tx.clear()
    assert bootstrap.call(store, "get", "room.7")["aborted"]  # decode's cause kept
    # A request that arrives while the daemon is gone fails at once, naming why.
    late = KvbeamKVReceiver(decode.mgr, store, 8)
    late.init(0)
    assert late.conclude_state == FAILED and late.poll() == FAILED
    assert "decode's kvbeam daemon cannot take requests" in _error(late)
    tx = KvbeamKVSender(prefill.mgr, store, 8)
    tx.init(5, 0)
    assert tx.poll() == FAILED and "closed the attach socket" in _error(tx)


def test_the_tombstone_is_forgotten_after_its_ttl(store: str) -> None:
    bootstrap.call(store, "put", "room.1", {"aborted": True}, ttl=0.2)
    bootstrap.call(store, "put", "room.2", {"daemon": "x"})
    assert bootstrap.call(store, "get", "room.1") == {"aborted": True}
    time.sleep(0.3)
    assert bootstrap.call(store, "get", "room.1") is None
    assert bootstrap.call(store, "get", "room.2") == {"daemon": "x"}  # no ttl: kept
    with pytest.raises(RuntimeError, match="ttl must be a positive number"):
        bootstrap.call(store, "put", "room.3", 1, ttl=-1)


def test_prefill_waiting_for_a_decode_that_never_comes_ends_at_sglangs_deadline(
        store: str) -> None:
    prefill = _side("prefill", _config(), "127.0.0.1:1", timeouts=0.3)
    try:
        tx = KvbeamKVSender(prefill.mgr, store, 8)
        tx.init(5, 0)
        assert tx.poll() == BOOTSTRAPPING
        time.sleep(0.4)
        assert tx.poll() == FAILED
        assert "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT" in _error(tx)
        # ... and a decode that comes late reads why, instead of reserving for nothing.
        assert "BOOTSTRAP_TIMEOUT" in bootstrap.call(store, "get", "room.8")["reason"]
    finally:
        prefill.close()


def test_decode_whose_prefill_never_writes_ends_at_sglangs_deadline(store: str) -> None:
    prefill = _side("prefill", _config(), "127.0.0.1:1")
    decode = _side("decode", _config(), "127.0.0.1:2", timeouts=0.3)
    bootstrap.call(store, "put", PREFILL_KEY, prefill.mgr.registration())
    try:
        rx = KvbeamKVReceiver(decode.mgr, store, 9)
        _reserve(rx)
        assert rx.poll() == WAITING  # reserved; the daemon never answers
        time.sleep(0.4)
        assert rx.poll() == FAILED
        assert "SGLANG_DISAGGREGATION_WAITING_TIMEOUT" in _error(rx)
        sent = decode.frames()
        assert [type(f).__name__ for f in sent] == ["Reserve", "Abort"]  # pages let go of
    finally:
        for side in (prefill, decode):
            side.close()


def test_a_dead_prefill_daemon_fails_new_requests_at_once_and_decode_follows(
        store: str, sides: tuple[Side, Side]) -> None:
    prefill, decode = sides
    rx = KvbeamKVReceiver(decode.mgr, store, 10)
    _reserve(rx)
    assert rx.poll() == WAITING
    prefill.kill_daemon()
    tx = KvbeamKVSender(prefill.mgr, store, 10)
    tx.init(5, 0)
    assert tx.poll() == FAILED  # not Bootstrapping until a deadline
    assert "prefill's kvbeam daemon cannot take requests" in _error(tx)
    rx.next_room_check = 0.0
    assert rx.poll() == FAILED
    assert "prefill gave room 10 up: room 10: prefill's kvbeam daemon" in _error(rx)
    assert [type(f).__name__ for f in decode.frames()] == ["Reserve", "Abort"]


def test_decode_reserving_after_prefill_gave_up_keeps_prefills_cause(
        store: str, sides: tuple[Side, Side]) -> None:
    # The served test's race: prefill's daemon dead, prefill fails the request at once;
    # decode, a moment later, posts its room. Posting over prefill's tombstone left decode
    # waiting for a write that never came (10 s, its daemon's Bootstrapping deadline).
    prefill, decode = sides
    prefill.kill_daemon()
    tx = KvbeamKVSender(prefill.mgr, store, 15)
    tx.init(5, 0)
    assert tx.poll() == FAILED
    rx = KvbeamKVReceiver(decode.mgr, store, 15)
    _reserve(rx)
    assert rx.poll() == FAILED  # at once, not at a deadline
    assert "prefill gave room 15 up: room 15: prefill's kvbeam daemon cannot take" in _error(rx)
    assert [type(f).__name__ for f in decode.frames()] == ["Reserve", "Abort"]
    assert bootstrap.call(store, "get", "room.15")["aborted"]  # prefill's cause still there
    assert bootstrap.call(store, "add", "room.16", {"a": 1}) is None  # absent: added
    assert bootstrap.call(store, "add", "room.16", {"a": 2}) == {"a": 1}
    assert bootstrap.call(store, "get", "room.16") == {"a": 1}


def test_decode_giving_up_while_prefill_sends_ends_prefill(
        store: str, sides: tuple[Side, Side]) -> None:
    prefill, decode = sides
    rx = KvbeamKVReceiver(decode.mgr, store, 11)
    _reserve(rx)
    tx = KvbeamKVSender(prefill.mgr, store, 11)
    tx.init(5, 0)
    assert tx.poll() == WAITING
    tx.send(np.arange(5, dtype=np.int32), [], num_kv_tokens=5)
    assert tx.poll() == TRANSFERRING  # sent; its daemon never answers
    rx.abort()  # e.g. /abort_request on decode
    tx.next_room_check = 0.0
    assert tx.poll() == FAILED
    assert "decode gave room 11 up: room 11: aborted by sglang on decode" in _error(tx)
    assert [type(f).__name__ for f in prefill.frames()] == ["Send", "Abort"]


def test_a_chunk_the_daemon_refuses_fails_the_request_naming_the_refusal(
        store: str, sides: tuple[Side, Side]) -> None:
    # A refused frame leaves a live request as the daemon holds it (no Failed pushed):
    # the sender must end it itself, not wait for a deadline.
    prefill, decode = sides
    rx = KvbeamKVReceiver(decode.mgr, store, 17)
    _reserve(rx)
    tx = KvbeamKVSender(prefill.mgr, store, 17)
    tx.init(5, 0)
    assert tx.poll() == WAITING
    tx.send(np.arange(5, dtype=np.int32), [], num_kv_tokens=5)
    assert tx.poll() == TRANSFERRING
    prefill.daemon.sendall(ef.encode(ef.Error("sglang-17", "kv_offset", "out of order")))
    deadline = time.monotonic() + 10
    while tx.poll() != FAILED:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "the daemon refused a chunk: kv_offset: out of order" in _error(tx)
    assert [type(f).__name__ for f in prefill.frames()] == ["Send", "Abort"]
    assert "refused a chunk" in bootstrap.call(store, "get", "room.17")["reason"]


@pytest.mark.parametrize(("decode_over", "named"), [
    ({"dtype": "bfloat16"}, "dtype: prefill=float16, decode=bfloat16 (--kv-cache-dtype"),
    ({"page_size": 4, "token_rows": 68}, "block size: prefill=1, decode=4 (--page-size)"),
])
def test_pools_that_cannot_pair_fail_the_request_at_init_naming_the_setting(
        store: str, decode_over: dict[str, Any], named: str) -> None:
    prefill = _side("prefill", _config(), "127.0.0.1:1")
    decode = _side("decode", _config(**decode_over), "127.0.0.1:2")
    bootstrap.call(store, "put", PREFILL_KEY, prefill.mgr.registration())
    try:
        rx = KvbeamKVReceiver(decode.mgr, store, 12)
        rx.init(0)
        assert rx.conclude_state == FAILED and rx.poll() == FAILED
        assert named in _error(rx)
        rx.send_metadata(np.arange(5, dtype=np.int32), 0, None)  # sglang would not; no-op
        assert decode.frames() == []  # nothing reserved
        tx = KvbeamKVSender(prefill.mgr, store, 12)
        tx.init(5, 0)
        assert tx.poll() == FAILED
        assert named in _error(tx)  # prefill's client sees the same cause
        # Negative control: pools alike pair (the comparison is cached per prefill).
        same = _side("decode", _config(), "127.0.0.1:3")
        try:
            ok = KvbeamKVReceiver(same.mgr, store, 13)
            ok.init(0)
            assert ok.poll() == WAITING
        finally:
            same.close()
    finally:
        for side in (prefill, decode):
            side.close()


def test_a_request_sglang_clears_before_it_ended_is_aborted_and_says_so(
        store: str, sides: tuple[Side, Side]) -> None:
    _, decode = sides
    rx = KvbeamKVReceiver(decode.mgr, store, 14)
    _reserve(rx)
    rx.clear()
    assert [type(f).__name__ for f in decode.frames()] == ["Reserve", "Abort"]
    assert "decode dropped the request" in bootstrap.call(store, "get", "room.14")["reason"]
