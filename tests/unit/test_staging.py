"""Staging (kvbeam.engine.staging) on CPU tensors that are not the attached memory.

The slot allocator (extents, all-or-nothing, bounded waits), the staging config of each
pool kind, and a request gathered out of one engine's KV, moved between two staging
buffers as the daemons would move it, and scattered into another engine's KV at other
indices: every listed item arrives, nothing else is touched.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvbeam.engine.staging import StagingBuffer, staging_config
from kvbeam.engine.staging_slots import FullPolicy, SlotAllocator
from kvbeam.errors import ConfigError, PlanError, StagingFull
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.paged import paged_side_config, paged_spec
from kvbeam.pools.sglang_mha import sglang_mha_spec
from kvbeam.pools.spec import SideConfig
from kvbeam.pools.types import IndexKind
from kvbeam.refengine.configs import tiny_config

KV = IndexKind.KV_PAGES
RING = IndexKind.SWA_RING_ROWS


# ---- the allocator -------------------------------------------------------------------
def test_items_are_one_run_first_fit_and_merge_back_when_released() -> None:
    alloc = SlotAllocator({KV: 10})
    a = alloc.acquire({KV: 4}, 0)
    b = alloc.acquire({KV: 3}, 0)
    assert a.extents[KV] == ((0, 4),) and b.extents[KV] == ((4, 3),)
    alloc.release(a)
    c = alloc.acquire({KV: 5}, 0)  # free: 0..3 and 7..9, no run of 5
    assert c.extents[KV] == ((0, 4), (7, 1))  # the largest free runs first: fewest pieces
    assert c.list_for(KV).tolist() == [0, 1, 2, 3, 7]
    alloc.release(b)
    alloc.release(c)
    whole = alloc.acquire({KV: 10}, 0)  # everything merged back into one run
    assert whole.extents[KV] == ((0, 10),)
    assert alloc.occupancy() == 1.0


def test_a_double_release_is_refused() -> None:
    alloc = SlotAllocator({KV: 4})
    a = alloc.acquire({KV: 2}, 0)
    alloc.release(a)
    with pytest.raises(ValueError, match="double release"):
        alloc.release(a)


def test_all_or_nothing_across_kinds() -> None:
    alloc = SlotAllocator({KV: 4, RING: 2})
    alloc.acquire({KV: 1, RING: 2}, 0)
    with pytest.raises(StagingFull, match="SWA_RING_ROWS 0/1"):
        alloc.acquire({KV: 1, RING: 1}, 0)
    assert alloc.acquire({KV: 3, RING: 0}, 0).items == 3  # the KV refusal took nothing


def test_a_full_buffer_waits_for_a_release() -> None:
    alloc = SlotAllocator({KV: 4})
    held = alloc.acquire({KV: 4}, 0)
    threading.Timer(0.2, alloc.release, (held,)).start()
    got = alloc.acquire({KV: 2}, 10.0)
    assert got.items == 2 and alloc.waits == 1 and alloc.refusals == 0


@pytest.mark.timeout(5)  # a wait that did not end fails the test (no wall-clock assert)
def test_a_wait_that_runs_out_raises_with_the_policy_never_hangs() -> None:
    alloc = SlotAllocator({KV: 4}, FullPolicy.RECOMPUTE)
    alloc.acquire({KV: 3}, 0)
    with pytest.raises(StagingFull) as info:
        alloc.acquire({KV: 2}, 0.2)
    assert info.value.policy == "recompute"
    assert "waited 0.2 s" in str(info.value) and "KV_PAGES 1/2" in str(info.value)
    assert alloc.refusals == 1


@pytest.mark.timeout(5)  # refused at once: a wait of its 60 s would fail the test
def test_a_request_larger_than_the_buffer_is_refused_at_once() -> None:
    alloc = SlotAllocator({KV: 4})
    with pytest.raises(StagingFull, match="needs 5 KV_PAGES items, the staging buffer holds 4"):
        alloc.acquire({KV: 5}, 60.0)


def test_tickets_get_room_in_the_order_they_were_taken_and_never_block() -> None:
    """A loop that must not block asks with a ticket: a large request is not passed by
    a small one that came later (first come, first served), a ticket whose wait ran out
    raises when asked (counted once), and a cancelled one gives its items back."""
    alloc = SlotAllocator({KV: 10})
    first = alloc.acquire({KV: 6}, 0)
    big = alloc.enqueue({KV: 8}, 30)
    small = alloc.enqueue({KV: 2}, 30)
    assert alloc.poll(small) is None  # 4 free, but the 8-item ticket came first
    assert alloc.poll(big) is None and alloc.waiting == 2 and alloc.waits == 2
    alloc.release(first)
    got = alloc.poll(small)  # asking for any ticket grants every one whose turn came
    assert got is not None and big.slots is not None
    assert alloc.poll(big) is big.slots and alloc.waiting == 0
    alloc.cancel(big)  # granted and given up: its items back
    alloc.release(got)
    assert alloc.held == 0 and alloc.occupancy() == 0.0
    late = alloc.enqueue({KV: 10}, 0.05)
    blocker = alloc.acquire({KV: 1}, 0)
    time.sleep(0.1)
    with pytest.raises(StagingFull, match=r"waited 0\.05 s for room"):
        alloc.poll(late)
    with pytest.raises(StagingFull):
        alloc.poll(late)
    assert alloc.refusals == 1 and alloc.waiting == 0
    alloc.release(blocker)
    with pytest.raises(StagingFull, match="holds 10 in all"):
        alloc.enqueue({KV: 11}, 30)  # never fits: at once


def test_an_expired_ticket_does_not_hold_up_the_queue() -> None:
    alloc = SlotAllocator({KV: 4})
    held = alloc.acquire({KV: 3}, 0)
    stuck = alloc.enqueue({KV: 4}, 0.05)
    after = alloc.enqueue({KV: 1}, 30)
    assert alloc.poll(after) is None  # behind the 4-item ticket
    time.sleep(0.1)
    assert alloc.poll(after) is not None  # the first one's wait ran out: its turn passed
    with pytest.raises(StagingFull):
        alloc.poll(stuck)
    alloc.release(held)


# ---- the staging config ----------------------------------------------------------------
def _configs() -> list[SideConfig]:
    paged = paged_spec(num_layers=2, block_size=16, num_kv_heads=2, head_size=64,
                       dtype="bfloat16", inner_layout="LBHNC", num_blocks=512)
    mha = sglang_mha_spec(num_layers=2, page_size=16, num_kv_heads=2, head_dim=64,
                          dtype="bfloat16", token_rows=8192, aux_item_lens=(8, 16),
                          aux_rows=64)
    return [tiny_config(unified=True), tiny_config(unified=False),
            paged_side_config("paged", paged), SideConfig("mha", mha)]


@pytest.mark.parametrize("config", _configs(), ids=lambda c: f"{c.model}-{c.source}")
def test_a_staging_config_keeps_every_buffer_and_sizes_the_capacity(config: SideConfig) -> None:
    staged = staging_config(config, requests=2, tokens=256)
    a, b = build_side_layout(config), build_side_layout(staged)
    assert [(x.name, x.item_len, x.index_kind) for x in a.flat_buffers] == \
        [(x.name, x.item_len, x.index_kind) for x in b.flat_buffers]
    pages = {x.items for x in b.flat_buffers if x.index_kind is KV}
    assert pages == {2 * 256 // config.target.page_size}
    with pytest.raises(ConfigError, match="requests must be at least 1"):
        staging_config(config, requests=0)


# ---- a request staged out of one engine and into another --------------------------------
def _side(config: SideConfig, seed: int) -> AllocatedSide:
    side = AllocatedSide(build_side_layout(config))
    side.fill_pattern(seed)
    return side


def _move(src: StagingBuffer, src_lists: dict[IndexKind, np.ndarray], dst: StagingBuffer,
          dst_lists: dict[IndexKind, np.ndarray]) -> None:
    """What the two daemons do: item i of each source list into item i of the destination."""
    for sb, db in zip(src.layout.flat_buffers, dst.layout.flat_buffers, strict=True):
        s = src.pools.buffer_view(sb).view(-1, sb.item_len)
        d = dst.pools.buffer_view(db).view(-1, db.item_len)
        d[torch.from_numpy(dst_lists[db.index_kind])] = s[torch.from_numpy(
            src_lists[sb.index_kind])]


def _request(config: SideConfig, rng: np.random.Generator, seq_len: int
             ) -> dict[IndexKind, np.ndarray]:
    from kvbeam.pools.indices import expected_lengths

    layout = build_side_layout(config)
    out = {}
    for kind, n in expected_lengths(config.target, seq_len).items():
        items = [b.items for b in layout.flat_buffers if b.index_kind is kind]
        if items:
            out[kind] = rng.permutation(min(items))[:n].astype(np.int64)
    return out


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "paged"])
def test_stage_out_move_stage_in_lands_every_item_and_nothing_else(unified: bool) -> None:
    config = tiny_config(unified=unified)
    rng = np.random.default_rng(5)
    src_kv, dst_kv = _side(config, 1), _side(config, 2)
    before = [dst_kv.buffer_view(b).clone() for b in dst_kv.layout.flat_buffers]
    src_lists, dst_lists = _request(config, rng, 250), _request(config, rng, 250)
    with StagingBuffer(config, requests=2) as out, StagingBuffer(config, requests=3) as inn:
        staged = out.stage_out(src_kv, src_lists)
        staged.copy.wait()  # type: ignore[union-attr]
        landing = inn.reserve(dst_lists)
        assert staged.nbytes == landing.nbytes > 0
        _move(out, staged.lists, inn, landing.lists)
        inn.stage_in(landing, dst_kv, dst_lists).wait()
        out.release(staged)
        inn.release(landing)
        m_out, m_in = out.metrics, inn.metrics
    assert m_out.bytes_out == m_in.bytes_in == staged.nbytes
    assert m_out.requests_out == m_in.requests_in == 1 and m_out.held == m_in.held == 0
    for buf, old in zip(dst_kv.layout.flat_buffers, before, strict=True):
        got = dst_kv.buffer_view(buf).view(-1, buf.item_len)
        want = old.view(-1, buf.item_len).clone()
        s_rows = src_kv.buffer_view(buf).view(-1, buf.item_len)
        d_idx = torch.from_numpy(dst_lists[buf.index_kind])
        want[d_idx] = s_rows[torch.from_numpy(src_lists[buf.index_kind])]
        assert torch.equal(got, want), buf.name
        # the negative control: the landed items did change (they were other bytes)
        if len(d_idx):
            assert not torch.equal(old.view(-1, buf.item_len)[d_idx], got[d_idx]), buf.name


def test_a_bad_device_index_or_a_missing_list_is_refused_before_any_copy() -> None:
    config = tiny_config()
    kv = _side(config, 1)
    lists = _request(config, np.random.default_rng(1), 100)
    with StagingBuffer(config, requests=1) as sb:
        bad = {**lists, KV: np.array([0, 10**6])}
        with pytest.raises(PlanError, match="KV_PAGES index 1000000 outside"):
            sb.stage_out(kv, bad)
        with pytest.raises(PlanError, match="no KV_PAGES list"):
            sb.stage_out(kv, {k: v for k, v in lists.items() if k is not KV})
        assert sb.metrics.held == 0  # nothing was taken
        other = AllocatedSide(build_side_layout(tiny_config(unified=False)))
        with pytest.raises(ConfigError, match=r"staging: buffer \d+: device target\.layer0\.swa"):
            sb.stage_out(other, lists)


def test_a_full_staging_buffer_fails_the_next_request_after_its_wait() -> None:
    config = tiny_config()
    kv = _side(config, 1)
    lists = _request(config, np.random.default_rng(1), 1000)
    with StagingBuffer(config, requests=1, wait_s=0.1) as sb:
        first = sb.stage_out(kv, lists)
        with pytest.raises(StagingFull, match="staging buffer full") as info:
            sb.stage_out(kv, lists)
        assert info.value.policy == "fail"
        sb.release(first)
        sb.release(sb.stage_out(kv, lists))  # room again
        assert sb.metrics.refusals == 1


@pytest.mark.parametrize("order", ["runs", "scattered"])
def test_large_blocks_in_runs_or_scattered_round_trip(order: str) -> None:
    """64 KiB blocks: contiguous runs are copied as slices, scattered ones row by row;
    both land exactly."""
    spec = paged_spec(num_layers=2, block_size=16, num_kv_heads=8, head_size=128,
                      dtype="bfloat16", inner_layout="LBHNC", num_blocks=64)
    config = paged_side_config("big", spec)
    src_kv, dst_kv = _side(config, 3), _side(config, 4)
    if order == "runs":
        src = np.array([5, 6, 7, 8, 20, 3, 4, 40, 41], dtype=np.int64)
        dst = np.array([30, 31, 32, 33, 0, 1, 2, 50, 9], dtype=np.int64)
    else:
        rng = np.random.default_rng(2)
        src, dst = rng.permutation(64)[:9], rng.permutation(64)[:9]
    with StagingBuffer(config, requests=2, tokens=512) as out, \
            StagingBuffer(config, requests=2, tokens=512) as inn:
        out.release(out.stage_out(src_kv, {KV: np.arange(3)}))  # the next run starts at 0
        staged = out.stage_out(src_kv, {KV: src})
        landing = inn.reserve({KV: dst})
        _move(out, staged.lists, inn, landing.lists)
        inn.stage_in(landing, dst_kv, {KV: dst}).wait()
    for buf in build_side_layout(config).flat_buffers:
        s = src_kv.buffer_view(buf).view(-1, buf.item_len)
        d = dst_kv.buffer_view(buf).view(-1, buf.item_len)
        assert torch.equal(d[torch.from_numpy(dst)], s[torch.from_numpy(src)]), buf.name


@pytest.mark.parametrize("out", [True, False], ids=["gather", "scatter"])
def test_the_cuda_copy_path_moves_the_same_rows_as_the_cpu_path(out: bool) -> None:
    """The device path's extent arithmetic (a gather into a contiguous temporary, one copy
    per extent), run on CPU tensors: the same rows as the CPU path (no GPU here)."""
    from kvbeam.engine.staging import _cpu_copy, _cuda_copy

    rng = np.random.default_rng(4)
    dev = torch.from_numpy(rng.integers(0, 256, (64, 32), dtype=np.uint8))
    host = torch.from_numpy(rng.integers(0, 256, (40, 32), dtype=np.uint8))
    idx = rng.permutation(64)[:12].astype(np.int64)
    extents = ((3, 5), (20, 1), (30, 6))  # a fragmented staging allocation
    a_dev, a_host, b_dev, b_host = dev.clone(), host.clone(), dev.clone(), host.clone()
    _cpu_copy(a_dev, a_host, idx, extents, out)
    _cuda_copy(b_dev, b_host, torch.from_numpy(idx), extents, out)
    assert torch.equal(a_dev, b_dev) and torch.equal(a_host, b_host)
    assert not (torch.equal(a_dev, dev) and torch.equal(a_host, host))  # something moved
