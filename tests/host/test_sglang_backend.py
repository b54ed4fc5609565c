"""kvbeam as sglang's transfer backend over real daemons (TCP), driven as sglang drives it.

The reference engines' pools are memfds; sglang's ``KVArgs`` built from their
pointers go to kvbeam's sglang manager, which attaches them to a ``--pools engine``
daemon. Each request is moved through sglang's own calls in the prefill and decode
schedulers' order (receiver init, send_metadata, sender init, send per chunk with
the states on the last, poll until Success, clear) and the decode reference engine
must continue token-identically (tokens, logits, NextN draft proposals). Abort
paths free both sides; a mismatched draft is refused at manager construction.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvbeam.engine import KVPoll
from kvbeam.errors import UnknownRequest
from kvbeam.integrations.sglang.conn import KvbeamKVReceiver, KvbeamKVSender
from kvbeam.pools.checks import SAME_UNIFIED
from kvbeam.pools.spec import SideConfig
from kvbeam.proto.attach_codec import config_to_mapping
from kvbeam.refengine.configs import tiny_config
from kvbeam.refengine.run import compare, make_prompt, torch_threads
from kvbeam.states import VERIFIED_PREFIX, FailureReason
from tests.sglang_helpers import SglangPair, positional_states

K = 8
FAILED, WAITING, SUCCESS = 0, 2, 4


def _run(pair: SglangPair, lengths: tuple[int, ...], label: str) -> None:
    with torch_threads(1):
        for n in lengths:
            t0 = time.monotonic()
            c = compare(pair.config, make_prompt(n, 512, seed=n), K, transfer=pair.transfer,
                        prefill_side=pair.prefill_pools, decode_side=pair.decode_pools)
            print(f"\n{label} prompt {n}: equal {c.equal}, {time.monotonic() - t0:.1f} s")
            assert pair.decode_status.detail.startswith(VERIFIED_PREFIX), pair.decode_status
            assert c.tokens_equal and c.proposals_equal, c.table()
            assert c.moved.proposals  # the NextN draft ran on moved state
            assert c.equal, c.table()


@pytest.fixture(scope="module")
def pair() -> Iterator[SglangPair]:
    """Unified KV with the NextN draft; 128-token chunks (a 250-token prompt is two)."""
    with SglangPair(tiny_config(unified=True, draft=True), chunk_tokens=128) as p:
        yield p


def _check_calls(pair: SglangPair) -> None:
    print("\n" + pair.table())
    saw = [row[3] for row in pair.calls]
    assert saw[:5] == ["Bootstrapping", "WaitingForInput", "Bootstrapping",
                       "WaitingForInput", "WaitingForInput"], pair.table()
    assert [r for r in pair.calls if r[1] == "poll() until done"] == [
        ("prefill", "poll() until done", "pushed state", "Success"),
        ("decode", "poll() until done", "pushed state (after XXH3-128 check)", "Success")]
    assert sum(r[1].startswith("send(") for r in pair.calls) == 2  # two chunks


def test_sglang_calls_move_unified_state_token_identically(pair: SglangPair) -> None:
    _run(pair, (250,), "unified")
    _check_calls(pair)


def test_each_chunk_is_written_as_sglang_hands_it_over(pair: SglangPair) -> None:
    """Chunked prefill overlaps the transfer: the first chunk's pages are written at
    prefill's daemon before sglang hands over the last chunk, and decode continues
    token-identically once that landed."""
    from kvbeam.client import KvbeamClient

    def first_chunk_written(tx: KvbeamKVSender) -> None:
        with KvbeamClient(pair.prefill_mgr.daemon) as prefill:
            written = _until(lambda: int(prefill.status(tx.request_id).bytes_done > 0), 1,
                             30)
        assert written == 1, "the first chunk was not written before the last was sent"
        assert tx.poll() != SUCCESS  # the last chunk is still to come

    with torch_threads(1):
        c = compare(pair.config, make_prompt(250, 512, seed=7), K,
                    transfer=functools.partial(pair.transfer, after_chunk=first_chunk_written),
                    prefill_side=pair.prefill_pools, decode_side=pair.decode_pools)
    assert c.equal, c.table()
    assert pair.decode_status.detail.startswith(VERIFIED_PREFIX), pair.decode_status


def test_sglang_calls_move_paged_state_token_identically() -> None:
    with SglangPair(tiny_config(unified=False, draft=True), chunk_tokens=128) as paged:
        _run(paged, (250, 20), "paged")
        _check_calls(paged)


def _start(pair: SglangPair, room: int) -> tuple[KvbeamKVSender, KvbeamKVReceiver]:
    """A request up to the point where prefill would send (decode has reserved nothing)."""
    rx = KvbeamKVReceiver(pair.decode_mgr, pair.bootstrap_addr, room)
    rx.init(0)
    tx = KvbeamKVSender(pair.prefill_mgr, pair.bootstrap_addr, room)
    tx.init(1, 0)
    rx.send_metadata(np.array([0], dtype=np.int32), 0, _states(pair, _lists(0)))
    assert tx.poll() == WAITING and rx.poll() == WAITING
    return tx, rx


def _lists(item: int) -> dict[str, list[int]]:
    """Index lists of a 100-token request at item ``item`` of every kind."""
    return {"KV_PAGES": [item], "SWA_RING_ROWS": list(range(32 * item, 32 * item + 32)),
            "REQ_SLOT": [item], "C128_STATE": [item]}


def _states(pair: SglangPair, lists: dict[str, list[int]]) -> list[object]:
    """``lists`` as sglang's positional state_indices (draft: the target's)."""
    return [None if c.pool == "draft" else
            {k: lists[k] for k in sorted({b.index_kind.name for b in c.buffers})}
            for c in pair.prefill_mgr.layout.states]


def _until(poll: Callable[[], int], want: int, timeout: float = 10.0) -> int:
    """Poll until ``want`` (the daemons' pushes and decode's room check are asynchronous)."""
    deadline = time.monotonic() + timeout
    state = poll()
    while state != want and time.monotonic() < deadline:
        time.sleep(0.02)
        state = poll()
    return state


def _pages_free(pair: SglangPair, lists: dict[str, list[int]], request_id: str) -> None:
    """Decode's daemon has freed ``lists``' items: a new reservation of them is taken.

    Called once decode's engine saw the old request Failed: decode pushes that only once
    its pages are free (an aborted reservation that was offered to prefill: after prefill
    confirmed it stopped), so no retry. The probe names a prefill no daemon is connected
    to (no offer is made), so its own abort frees its items at once."""
    from kvbeam.client import KvbeamClient

    with KvbeamClient(pair.decode_mgr.daemon) as decode:
        decode.reserve(request_id, 100, "127.0.0.1:1", indices=lists)
        decode.abort(request_id, "test")


def test_decode_abort_before_send_fails_both_and_holds_nothing(pair: SglangPair) -> None:
    from kvbeam.client import KvbeamClient

    tx, rx = _start(pair, 1001)
    rx.abort()
    assert rx.poll() == FAILED
    # Prefill reads the room again when it sends: the withdrawn room stops it.
    tx.send(np.array([1], dtype=np.int32), _states(pair, _lists(1)), num_kv_tokens=100)
    assert tx.poll() == FAILED
    with pytest.raises(RuntimeError, match=r"decode gave room 1001 up: room 1001: aborted "
                                           r"by sglang on decode"):
        tx.failure_exception()
    tx.clear()
    rx.clear()
    with KvbeamClient(pair.prefill_mgr.daemon) as prefill, \
            pytest.raises(UnknownRequest):  # prefill's daemon never heard of it
        prefill.status(tx.request_id)
    assert rx.request is not None
    assert rx.request.wait(10) is KVPoll.Failed  # decode's reservation was aborted ...
    _pages_free(pair, _lists(0), "check-1001")   # ... and its pages freed


def test_prefill_abort_before_send_fails_decode(pair: SglangPair) -> None:
    tx, rx = _start(pair, 1002)
    tx.abort()
    assert tx.poll() == FAILED
    assert _until(rx.poll, FAILED) == FAILED  # decode's room check, within ROOM_CHECK_S
    with pytest.raises(RuntimeError, match="prefill gave room 1002 up: room 1002: aborted "
                                           "by sglang on prefill"):
        rx.failure_exception()
    tx.clear()
    rx.clear()
    assert rx.request is not None and rx.request.wait(10) is KVPoll.Failed
    _pages_free(pair, _lists(0), "check-1002")


def test_a_refused_send_gives_decodes_reservation_back(pair: SglangPair) -> None:
    tx, rx = _start(pair, 1003)
    bad = _lists(1)
    bad["KV_PAGES"] = [10**6]  # outside prefill's pool: prefill's daemon refuses the SEND
    tx.send(np.array(bad["KV_PAGES"], dtype=np.int32), _states(pair, bad), num_kv_tokens=100)
    assert _until(tx.poll, FAILED) == FAILED
    with pytest.raises(RuntimeError, match="out of range"):
        tx.failure_exception()
    assert _until(rx.poll, FAILED) == FAILED  # decode's reservation was aborted ...
    tx.clear()
    rx.clear()
    assert rx.request is not None and rx.request.wait(10) is KVPoll.Failed
    _pages_free(pair, _lists(0), "check-1003")  # ... its pages freed


def test_abort_after_reserve_frees_the_decode_slot(pair: SglangPair) -> None:
    slots = pair.config.target.num_req_slots
    # More requests than decode has slots, each reserved over the engine channel at the
    # same pages: each abort must give its slot and pages back.
    for i in range(slots + 1):
        if i:
            _pages_free(pair, _lists(0), f"check-{2000 + i}")  # the previous one's, freed
        tx, rx = _start(pair, 2000 + i)
        rx.abort()
        assert rx.poll() == FAILED
        assert rx.request is not None and rx.request.wait(10) is KVPoll.Failed
        failed = rx.request.failure()
        assert failed is not None and failed[0] is FailureReason.ABORTED, failed
        tx.clear()
        rx.clear()
    # And a full request still moves afterwards.
    _run(pair, (250,), "after aborts")


def test_mismatched_draft_refused_at_manager_construction() -> None:
    data = config_to_mapping(tiny_config(unified=True, draft=True))
    data["draft"]["unified_kv"] = False
    with pytest.raises(RuntimeError, match=f"^{SAME_UNIFIED}"):
        SglangPair(SideConfig.from_mapping(data, "mismatched-draft"))


def test_positional_states_cover_every_kind_of_the_layout() -> None:
    from kvbeam.integrations.sglang.kvargs import state_index_lists
    from kvbeam.pools.layout import build_side_layout
    from kvbeam.pools.types import IndexKind

    layout = build_side_layout(tiny_config(unified=False, draft=True))
    lists = {k: np.array([3]) for k in IndexKind}
    got = state_index_lists(layout, positional_states(layout, lists))
    assert set(got) == {b.index_kind.name for c in layout.states for b in c.buffers
                        if c.pool == "target"}


def test_a_request_makes_no_grpc_call_and_polls_read_pushed_state(
        pair: SglangPair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every per-request call (send_metadata, send, poll, clear) goes over the engine
    channel: any gRPC call of the scheduler API fails the test."""
    from kvbeam.client import KvbeamClient

    calls: list[str] = []

    def refuse(name: str) -> object:
        def call(self: object, *args: object, **kwargs: object) -> object:
            calls.append(name)
            raise AssertionError(f"gRPC {name} in the sglang backend's request path")
        return call

    for name in ("reserve", "send", "status", "wait", "open_watch", "abort", "release"):
        monkeypatch.setattr(KvbeamClient, name, refuse(name))
    _run(pair, (250,), "no gRPC")
    assert calls == []


def _sends(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every SEND frame an engine channel of this process writes from now on, until the
    test ends (prefill's: decode's channel writes RESERVE frames)."""
    from kvbeam.engine.channel import EngineChannel
    from kvbeam.proto import engine_frames as ef

    frames: list[object] = []
    write = EngineChannel.send

    def send(self: EngineChannel, frame: ef.EngineFrame) -> None:
        if isinstance(frame, ef.Send):
            frames.append(frame)
        write(self, frame)

    monkeypatch.setattr(EngineChannel, "send", send)
    return frames


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
def test_stream_chunks_off_sends_the_whole_request_once_at_its_last_chunk(
        pair: SglangPair, monkeypatch: pytest.MonkeyPatch, streamed: bool) -> None:
    """``KVBEAM_STREAM_CHUNKS`` (the manager's ``stream_chunks``): on, each of a
    three-chunk request's chunks is one SEND as sglang hands it over, the last final;
    off, nothing is sent before the last chunk, which sends one final SEND carrying
    every page and the states. Decode continues token-identically either way."""
    from kvbeam.pools.types import IndexKind
    from kvbeam.proto import engine_frames as ef

    assert pair.prefill_mgr.stream_chunks is True  # the default: on
    monkeypatch.setattr(pair.prefill_mgr, "stream_chunks", streamed)
    frames = _sends(monkeypatch)
    with torch_threads(1):
        c = compare(pair.config, make_prompt(300, 512, seed=11), K, transfer=pair.transfer,
                    prefill_side=pair.prefill_pools, decode_side=pair.decode_pools)
    assert c.equal, c.table()
    assert pair.decode_status.detail.startswith(VERIFIED_PREFIX), pair.decode_status
    sends = [f for f in frames if isinstance(f, ef.Send)]
    pages = [len(f.indices[IndexKind.KV_PAGES]) if f.indices else 0 for f in sends]
    print(f"\n{'streamed' if streamed else 'whole'}: {len(sends)} SEND frame(s), pages "
          f"{pages}, final {[f.final for f in sends]}, kv_offset "
          f"{[f.kv_offset for f in sends]}")
    assert len({f.request_id for f in sends}) == 1, sends
    states = [sorted(k.name for k in (f.indices or {}) if k is not IndexKind.KV_PAGES)
              for f in sends]
    if streamed:
        assert [f.final for f in sends] == [False, False, True], sends
        assert [f.kv_offset for f in sends] == [0, 1, 2] and pages == [1, 1, 1], sends
        assert states[:2] == [[], []] and states[2], states  # the states come last
    else:
        assert len(sends) == 1 and sends[0].final, sends
        assert sends[0].kv_offset is None  # the whole request in one frame
        assert pages == [3], sends  # every page of the 300 tokens (128 per page)
        assert states[0], states  # and the states


def test_a_bad_stream_chunks_value_is_refused_naming_the_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Read as the daemons read booleans; unset is on; a server_args attribute wins; a
    typo fails the manager's construction before anything is attached."""
    from types import SimpleNamespace

    from kvbeam.engine import EnginePools
    from kvbeam.errors import ConfigError
    from kvbeam.integrations.sglang.conn import KvbeamKVManager, stream_chunks_setting
    from tests.sglang_kvargs import kvargs_for

    monkeypatch.delenv("KVBEAM_STREAM_CHUNKS", raising=False)
    assert stream_chunks_setting(None) is True
    for text, want in (("0", False), ("off", False), ("FALSE", False), ("1", True),
                       ("yes", True), ("", True)):
        monkeypatch.setenv("KVBEAM_STREAM_CHUNKS", text)
        assert stream_chunks_setting(SimpleNamespace()) is want, text
    monkeypatch.setenv("KVBEAM_STREAM_CHUNKS", "1")
    assert stream_chunks_setting(SimpleNamespace(kvbeam_stream_chunks=False)) is False
    monkeypatch.setenv("KVBEAM_STREAM_CHUNKS", "sometimes")
    with pytest.raises(ConfigError, match=r"KVBEAM_STREAM_CHUNKS='sometimes': 1/true"):
        stream_chunks_setting(None)
    with pytest.raises(ConfigError, match=r"server_args.kvbeam_stream_chunks='2'"):
        stream_chunks_setting(SimpleNamespace(kvbeam_stream_chunks=2))
    with EnginePools(tiny_config(unified=True, draft=True)) as pools, \
            pytest.raises(ConfigError, match="KVBEAM_STREAM_CHUNKS='sometimes'"):
        KvbeamKVManager(kvargs_for(pools), "prefill",
                        SimpleNamespace(kvbeam_attach_socket="/nonexistent/kvbeam.sock",
                                        kvbeam_daemon="127.0.0.1:1"))
