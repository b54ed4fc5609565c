"""kvbeam's sglang sender and receiver staged, driven as sglang's queues drive them.

sglang's pool stand-in is ordinary CPU tensors in sglang's shapes (K and V buffers per
layer, one metadata row buffer), found by the pointers a ``KVArgs`` gives, exactly as
the manager finds a GPU pool's; each side's staging buffer is a real one (memfds). The
test holds both daemons' ends of the engine channels (tests/unit/test_sglang_request_ends.py):
it reads the frames, moves the staged bytes from prefill's staging items to decode's as
the daemons would, and pushes the states.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvbeam.errors import ConfigError
from kvbeam.integrations.sglang import bootstrap, staged
from kvbeam.integrations.sglang.conn import PREFILL_KEY, KvbeamKVReceiver, KvbeamKVSender
from kvbeam.pools.types import IndexKind
from kvbeam.proto import engine_frames as ef
from kvbeam.states import FailureReason, TransferState
from tests.unit.test_sglang_request_ends import Side, _config, _error, _side

FAILED, WAITING, TRANSFERRING, SUCCESS = 0, 2, 3, 4
ROWS, HEADS, DIM = 65, 2, 4


def _pool(seed: int) -> tuple[Any, Any, Any]:
    """sglang's MHA pool and metadata rows as CPU tensors, and the KVArgs over them."""
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(ROWS, HEADS, DIM, generator=g).half() for _ in range(2)]
    v = [torch.randn(ROWS, HEADS, DIM, generator=g).half() for _ in range(2)]
    pool = SimpleNamespace(k_buffer=k, v_buffer=v)
    rows = torch.randint(0, 1000, (8, 16), dtype=torch.int32, generator=g)
    metadata = SimpleNamespace(output_ids=rows)
    kv = [*k, *v]
    args = SimpleNamespace(
        kv_data_ptrs=[t.data_ptr() for t in kv], kv_data_lens=[t.nbytes for t in kv],
        kv_item_lens=[HEADS * DIM * 2] * 4, state_types=[], state_data_ptrs=[],
        state_data_lens=[], state_item_lens=[], aux_data_ptrs=[rows.data_ptr()],
        aux_data_lens=[rows.nbytes], aux_item_lens=[64])
    return pool, metadata, args


def _staged_side(mode: str, daemon: str, seed: int, capacity: staged.Capacity) -> Side:
    side = _side(mode, _config(), daemon)
    pool, metadata, args = _pool(seed)
    mgr = side.mgr
    mgr.kv_args = args
    tensors = staged.pool_tensors(pool, metadata)
    mgr.device_kv = staged.device_kv(args, mgr.layout, tensors)
    mgr.staging = staged.staging_buffer(mgr.config, "cpu", capacity)
    mgr.staging_log = staged.StagingLog(mode)
    side.pool, side.metadata = pool, metadata  # type: ignore[attr-defined]
    return side


@pytest.fixture
def store() -> Iterator[str]:
    server = bootstrap.BootstrapServer("127.0.0.1", 0)
    try:
        yield server.address
    finally:
        server.close()


@pytest.fixture
def pair(store: str) -> Iterator[tuple[Side, Side]]:
    prefill = _staged_side("prefill", "127.0.0.1:1", 1, staged.Capacity(4, 16, 5.0))
    decode = _staged_side("decode", "127.0.0.1:2", 2, staged.Capacity(1, 16, 1.5))
    bootstrap.call(store, "put", PREFILL_KEY, prefill.mgr.registration())
    try:
        yield prefill, decode
    finally:
        for side in (prefill, decode):
            side.close()
            assert side.mgr.staging is not None
            side.mgr.staging.close()


def _move(prefill: Side, send: ef.Send, decode: Side, reserve: ef.Reserve) -> None:
    """What the daemons do: each staged item of prefill's SEND into decode's reserved one."""
    src, dst = prefill.mgr.staging, decode.mgr.staging
    assert src is not None and dst is not None
    for sb, db in zip(src.layout.flat_buffers, dst.layout.flat_buffers, strict=True):
        kind = sb.index_kind
        s = src.pools.buffer_view(sb).view(-1, sb.item_len)
        d = dst.pools.buffer_view(db).view(-1, db.item_len)
        d[torch.from_numpy(np.asarray(reserve.indices[kind]))] = s[torch.from_numpy(
            np.asarray((send.indices or {})[kind]))]


def _rows(side: Side, pages: list[int], aux: int) -> list[torch.Tensor]:
    pool, metadata = side.pool, side.metadata  # type: ignore[attr-defined]
    out = [t[pages].clone() for t in (*pool.k_buffer, *pool.v_buffer)]
    return [*out, metadata.output_ids[aux].clone()]


def test_a_staged_request_is_gathered_sent_once_and_scattered_before_success(
        store: str, pair: tuple[Side, Side]) -> None:
    """Prefill's chunks go out as ONE send from staging items at the last chunk (its
    pages and metadata row gathered); decode reserves staging items and says Success
    only once they are scattered into its pool and metadata row (nothing before)."""
    prefill, decode = pair
    src_pages, dst_pages = [5, 17, 3, 40, 41, 42], [9, 8, 7, 30, 31, 60]
    rx = KvbeamKVReceiver(decode.mgr, store, 21)
    rx.init(0)
    rx.send_metadata(np.array(dst_pages, dtype=np.int32), 6, None)
    (reserve,) = decode.frames()
    assert isinstance(reserve, ef.Reserve) and reserve.request_id == "sglang-21"
    assert reserve.indices[IndexKind.KV_PAGES].tolist() != dst_pages  # staging items
    tx = KvbeamKVSender(prefill.mgr, store, 21)
    tx.init(len(src_pages), 2)
    assert tx.poll() == WAITING
    tx.send(np.array(src_pages[:4], dtype=np.int32), None, num_kv_tokens=4)
    assert prefill.frames() == []  # an earlier chunk: nothing sent on its own
    tx.send(np.array(src_pages[4:], dtype=np.int32), [], num_kv_tokens=2)
    (send,) = prefill.frames()
    assert isinstance(send, ef.Send) and send.final and send.kv_offset == 0
    assert set(send.indices or {}) == {IndexKind.KV_PAGES, IndexKind.REQ_SLOT}
    before = _rows(decode, dst_pages, 6)
    _move(prefill, send, decode, reserve)
    assert rx.poll() == WAITING  # landed, not Success yet: nothing scattered
    assert all(torch.equal(a, b) for a, b in zip(before, _rows(decode, dst_pages, 6),
                                                 strict=True))
    decode.daemon.sendall(ef.encode(ef.State("sglang-21", TransferState.SUCCESS, None, 3,
                                             "ok")))
    deadline = time.monotonic() + 5
    while (state := rx.poll()) != SUCCESS:
        assert state == WAITING and time.monotonic() < deadline
        time.sleep(0.01)
    for got, want in zip(_rows(decode, dst_pages, 6), _rows(prefill, src_pages, 2),
                         strict=True):
        assert torch.equal(got, want)
    rx.clear()
    (release,) = decode.frames()
    assert isinstance(release, ef.Release)
    prefill.daemon.sendall(ef.encode(ef.State("sglang-21", TransferState.SUCCESS, None, 3,
                                              "ok")))
    while tx.poll() != SUCCESS:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    tx.clear()
    for side in pair:
        assert side.mgr.staging is not None
        m = side.mgr.staging.metrics
        assert (m.held, m.waiting) == (0, 0)
    assert prefill.mgr.staging is not None and decode.mgr.staging is not None
    assert prefill.mgr.staging.metrics.requests_out == decode.mgr.staging.metrics.requests_in == 1


def test_a_full_staging_buffer_makes_decode_wait_then_fail_naming_it(
        store: str, pair: tuple[Side, Side]) -> None:
    """Decode's buffer holds one request: the second waits (nothing reserved, nothing
    posted), then fails when its wait (1.5 s) runs out, leaving why for prefill; a
    request larger than the buffer fails at once. The first's items go back when it
    fails."""
    _, decode = pair
    first = KvbeamKVReceiver(decode.mgr, store, 31)
    first.init(0)
    first.send_metadata(np.arange(4, dtype=np.int32), 0, None)
    second = KvbeamKVReceiver(decode.mgr, store, 32)
    second.init(0)
    second.send_metadata(np.arange(4, 8, dtype=np.int32), 1, None)
    assert second.poll() == WAITING and bootstrap.call(store, "get", "room.32") is None
    assert [f.request_id for f in decode.frames()] == ["sglang-31"]
    deadline = time.monotonic() + 10
    while second.poll() != FAILED:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "staging buffer full: waited 1.5 s" in _error(second)
    assert "staging buffer full" in bootstrap.call(store, "get", "room.32")["reason"]
    huge = KvbeamKVReceiver(decode.mgr, store, 33)
    huge.init(0)
    huge.send_metadata(np.arange(20, dtype=np.int32), 2, None)  # 16 pages of room
    assert huge.poll() == FAILED and "staging buffer too small" in _error(huge)
    decode.daemon.sendall(ef.encode(ef.State("sglang-31", TransferState.FAILED,
                                             FailureReason.TIMEOUT, 3, "x")))
    deadline = time.monotonic() + 5
    while first.poll() != FAILED:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert decode.mgr.staging is not None and decode.mgr.staging.metrics.held == 0


def test_a_pointer_that_is_no_pool_tensor_is_refused() -> None:
    pool, metadata, args = _pool(3)
    layout = _side("decode", _config(), "127.0.0.1:2").mgr.layout
    args.kv_data_ptrs[1] += 2
    with pytest.raises(ConfigError, match=r"component 0 \(kv\) buffer 1 at"):
        staged.device_kv(args, layout, staged.pool_tensors(pool, metadata))


def test_the_staging_settings_are_read_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert staged.staging_requested() is None
    for value, want in (("1", True), ("true", True), ("0", False), ("auto", None)):
        monkeypatch.setenv("KVBEAM_STAGING", value)
        assert staged.staging_requested() is want
    monkeypatch.setenv("KVBEAM_STAGING", "maybe")
    with pytest.raises(ConfigError, match="KVBEAM_STAGING='maybe'"):
        staged.staging_requested()
    monkeypatch.setenv("KVBEAM_STAGING_REQUESTS", "3")
    monkeypatch.setenv("KVBEAM_STAGING_WAIT_S", "1.5")
    assert staged.Capacity.read(SimpleNamespace(context_length=2048)) == \
        staged.Capacity(3, 2048, 1.5)
    monkeypatch.setenv("KVBEAM_STAGING_TOKENS", "0")
    with pytest.raises(ConfigError, match="KVBEAM_STAGING_TOKENS='0'"):
        staged.Capacity.read(None)
