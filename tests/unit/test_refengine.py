"""The reference engine: a continuation from moved state equals the colocated run.

Prefill runs in one engine at its own shuffled indices, :func:`copy_state` moves the
request's state into a second engine whose pools start as random bytes and whose
indices are its own, and that engine continues. Tokens, logits and the draft's
proposals must equal those of one engine that ran prompt and continuation itself.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvbeam.errors import PlanError
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.layout import BufferLayout, SideLayout, build_side_layout
from kvbeam.pools.plan import IndexLists, build_plan
from kvbeam.pools.spec import SideConfig
from kvbeam.pools.types import IndexKind
from kvbeam.refengine.configs import tiny_config
from kvbeam.refengine.copy import copy_state, flip_byte
from kvbeam.refengine.engine import Engine
from kvbeam.refengine.memory import SideMemory, fill_garbage
from kvbeam.refengine.model import ReferenceModel
from kvbeam.refengine.run import SplitRun, compare, make_prompt, torch_threads

K = 12
VOCAB = 512


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Keep the shared cores usable."""
    with torch_threads(1):
        yield


# 256: page, window (32) and C128 boundary at once; 250: none (its C128 group finishes
# 6 tokens into the continuation, its C4 group 2 tokens in); 224: window boundary only;
# 20: shorter than the window (no C128 entry yet).
LENGTHS = [256, 250, 224, 20]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("draft", [True, False], ids=["draft", "nodraft"])
@pytest.mark.parametrize("unified", [True, False], ids=["unified", "paged"])
def test_moved_state_continues_token_identically(unified: bool, draft: bool,
                                                 length: int) -> None:
    cfg = tiny_config(unified=unified, draft=draft)
    result = compare(cfg, make_prompt(length, VOCAB), K)
    assert len(result.moved.tokens) == K
    assert result.tokens_equal, result.table()
    torch.testing.assert_close(result.moved.logits, result.reference.logits,
                               rtol=1e-4, atol=1e-4)
    assert result.proposals_equal
    assert bool(result.moved.proposals) == draft
    assert result.equal
    assert "tokens equal: True" in result.table()


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "paged"])
def test_online_c128_state_continues_token_identically(unified: bool) -> None:
    result = compare(tiny_config(unified=unified, online_c128=True), make_prompt(250, VOCAB), K)
    assert result.equal, result.table()


def _split(cfg: SideConfig, length: int) -> SplitRun:
    return SplitRun(cfg, make_prompt(length, VOCAB))


def test_each_engine_chooses_its_own_fragmented_indices() -> None:
    cfg = tiny_config(unified=True)
    split = _split(cfg, 250)
    src = split.result.index_lists
    dec = Engine(split.model, AllocatedSide(build_side_layout(cfg)), allocator_seed=23)
    dst = dec.adopt("r", split.result.seq_len, split.result.first_token)
    for kind in (IndexKind.KV_PAGES, IndexKind.SWA_RING_ROWS):
        assert len(src[kind]) == len(dst[kind]) > 1
        assert not np.array_equal(src[kind], dst[kind])
        # Fragmented: the lists are not one contiguous ascending run.
        assert np.any(np.diff(src[kind]) != 1) and np.any(np.diff(dst[kind]) != 1)
    assert len(src[IndexKind.SWA_RING_ROWS]) == cfg.target.sliding_window
    assert len(src[IndexKind.C128_STATE]) == 1 and len(src[IndexKind.REQ_SLOT]) == 1
    # The indexer must choose: more compressed C4 entries than it attends to.
    assert split.model.shape.c4_topk < 250 // 4


def test_c128_state_list_is_empty_on_a_c128_boundary() -> None:
    split = _split(tiny_config(unified=False), 256)
    lists = split.result.index_lists
    assert len(lists[IndexKind.C128_STATE]) == 0
    assert len(lists[IndexKind.KV_PAGES]) == 2
    # Paged: the window's SWA pages only (the window 224..255 lies in logical page 1).
    assert len(lists[IndexKind.SWA_PAGES]) == 1


def test_kvbeams_planner_accepts_the_engines_lists() -> None:
    # The daemons validate and plan with build_plan: the engine's lists must pass it and
    # plan exactly the bytes copy_state moves.
    for unified in (True, False):
        cfg = tiny_config(unified=unified)
        split = _split(cfg, 250)
        dst_side = AllocatedSide(build_side_layout(cfg))
        dec = Engine(split.model, dst_side, allocator_seed=23)
        dst = dec.adopt("r", split.result.seq_len, split.result.first_token)
        src_side = split.side
        assert isinstance(src_side, AllocatedSide)
        plan = build_plan(src_side.layout, src_side.buffer_addrs(), split.result.index_lists,
                          dst_side.layout, dst_side.buffer_addrs(), dst)
        assert plan.total_bytes == copy_state(src_side, split.result.index_lists, dst_side,
                                              dst, cfg)
        assert plan.num_blocks > len(plan.buffers)  # fragmented: several runs per buffer


def test_requests_are_refused_twice_or_out_of_range() -> None:
    cfg = tiny_config(unified=True)
    eng = Engine(ReferenceModel(cfg, 0), AllocatedSide(build_side_layout(cfg)), 3)
    eng.adopt("r", 10, 1)
    with pytest.raises(PlanError, match="already exists"):
        eng.prefill("r", [1, 2])
    with pytest.raises(PlanError, match="outside"):
        eng.adopt("s", cfg.target.max_context_len + 1, 1)


def _items(side: SideMemory, name: str) -> torch.Tensor:
    buf = next(b for b in side.layout.flat_buffers if b.name == name)
    return side.buffer_view(buf).view(-1, buf.item_len)


def test_copy_state_moves_exactly_the_listed_items() -> None:
    cfg = tiny_config(unified=True)
    split = _split(cfg, 250)
    dst_side = AllocatedSide(build_side_layout(cfg))
    fill_garbage(dst_side, seed=5)
    before = {b.name: dst_side.buffer_view(b).clone() for b in dst_side.layout.flat_buffers}
    dec = Engine(split.model, dst_side, allocator_seed=23)
    dst = dec.adopt("r", split.result.seq_len, split.result.first_token)
    src = split.result.index_lists
    moved = copy_state(split.side, src, dst_side, dst, cfg)
    assert moved > 0
    for buf in dst_side.layout.flat_buffers:
        s_idx = torch.from_numpy(src[buf.index_kind])
        d_idx = torch.from_numpy(dst[buf.index_kind])
        got, was = _items(dst_side, buf.name), before[buf.name].view(-1, buf.item_len)
        assert torch.equal(got[d_idx], _items(split.side, buf.name)[s_idx]), buf.name
        untouched = torch.ones(len(got), dtype=torch.bool)
        untouched[d_idx] = False
        assert torch.equal(got[untouched], was[untouched]), buf.name


def test_a_flipped_byte_in_the_moved_state_changes_the_logits() -> None:
    # Catching the flip is kvbeam's digest's job; this shows that an undetected flip
    # would be visible in the continuation, never silently harmless.
    split = _split(tiny_config(unified=True), 250)
    clean = split.decode(K)

    def flip(side: SideMemory, lists: IndexLists) -> None:
        # High byte of the first element of position L-1's KV row in layer 0's ring.
        flip_byte(side, lists, "target.layer0.swa_ring", item=-1, byte=1)

    flipped = split.decode(K, corrupt=flip)
    assert float((flipped.logits[0] - clean.logits[0]).abs().max()) > 1e-3


def test_a_decode_engine_serves_requests_side_by_side() -> None:
    cfg = tiny_config(unified=False)
    model = ReferenceModel(cfg, 0)
    alone = []
    for seed in (1, 2):
        eng = Engine(model, AllocatedSide(build_side_layout(cfg)), allocator_seed=3)
        eng.prefill("a", make_prompt(100, VOCAB, seed))
        alone.append(eng.decode("a", 6).tokens)
    eng = Engine(model, AllocatedSide(build_side_layout(cfg)), allocator_seed=4)
    eng.prefill("a", make_prompt(100, VOCAB, 1))
    eng.prefill("b", make_prompt(100, VOCAB, 2))
    a = eng.decode("a", 3).tokens
    b = eng.decode("b", 6).tokens
    a += eng.decode("a", 3).tokens
    assert [a, b] == alone
    eng.release("a")
    eng.release("b")


class _MemfdSide:
    """Another SideMemory: one memfd per side, mapped; buffers are views into the mapping.

    Stands in for an engine's shared-memory pools (what an engine attaches to its
    daemon): the reference engine needs only ``layout`` and ``buffer_view``.
    """

    def __init__(self, layout: SideLayout) -> None:
        self.layout = layout
        offsets, total = [], 0
        for t in layout.tensors:
            offsets.append(total)
            total += -(-t.nbytes // 4096) * 4096
        self._offsets = offsets
        self._fd = os.memfd_create("refengine-test")
        os.ftruncate(self._fd, total)
        self._map = mmap.mmap(self._fd, total)
        self._all = torch.frombuffer(self._map, dtype=torch.uint8)

    def buffer_view(self, buf: BufferLayout) -> torch.Tensor:
        return self._all.narrow(0, self._offsets[buf.tensor] + buf.offset, buf.nbytes)

    def close(self) -> None:
        del self._all
        self._map.close()
        os.close(self._fd)


def test_any_side_memory_and_transfer_function_fit() -> None:
    cfg = tiny_config(unified=False)
    src, dst = (_MemfdSide(build_side_layout(cfg)) for _ in range(2))
    calls: list[int] = []

    def transfer(src_lists: IndexLists, dst_lists: IndexLists, seq_len: int) -> None:
        calls.append(seq_len)
        copy_state(src, src_lists, dst, dst_lists, cfg)

    try:
        result = compare(cfg, make_prompt(140, VOCAB), 6, transfer=transfer,
                         prefill_side=src, decode_side=dst)
        assert calls == [140]
        assert result.equal, result.table()
    finally:
        src.close()
        dst.close()
