"""Transfer plans: coalescing, validation, and properties (hypothesis)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbeam.errors import PlanError
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import SideLayout, build_side_layout
from kvbeam.pools.paged import paged_side_config, paged_spec
from kvbeam.pools.plan import build_plan, coalesce
from kvbeam.pools.sglang_mha import sglang_mha_spec
from kvbeam.pools.spec import SideConfig
from kvbeam.pools.types import IndexKind
from kvbeam.transport.blocks import Blocks
from tests.fixtures import PAGED_DRAFT, PAGED_TARGET, UNIFIED_TARGET, layout


def _arr(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def test_issue_example_two_buffers() -> None:
    a = coalesce(1000, 3000, 16, _arr(1, 2), _arr(3, 4))
    b = coalesce(2000, 4000, 32, _arr(1, 2), _arr(3, 4))
    got = Blocks.concat([a, b])
    triples = list(zip(got.src.tolist(), got.dst.tolist(), got.lengths.tolist(), strict=True))
    assert triples == [(1016, 3048, 32), (2032, 4096, 64)]


def test_runs_break_when_either_side_jumps() -> None:
    blocks = coalesce(0, 0, 10, _arr(1, 2, 3, 7, 8), _arr(5, 6, 9, 10, 11))
    triples = list(zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.lengths.tolist(),
                       strict=True))
    assert triples == [(10, 50, 20), (30, 90, 10), (70, 100, 20)]


def _addrs(lay: SideLayout, base: int) -> list[int]:
    # Synthetic, non-overlapping addresses: tensors laid out back to back.
    starts = np.cumsum([0] + [t.nbytes for t in lay.tensors])
    return [base + int(starts[b.tensor]) + b.offset for b in lay.flat_buffers]


def _plan(src: SideLayout, dst: SideLayout, s_idx: dict[IndexKind, np.ndarray],
          d_idx: dict[IndexKind, np.ndarray]) -> object:
    return build_plan(src, _addrs(src, 1 << 32), s_idx, dst, _addrs(dst, 1 << 40), d_idx)


def test_out_of_range_index_is_refused() -> None:
    lay = layout()
    idx = request_indices(UNIFIED_TARGET, 0, 100)
    bad = dict(idx)
    bad[IndexKind.SWA_RING_ROWS] = idx[IndexKind.SWA_RING_ROWS] + 10_000
    with pytest.raises(PlanError, match=r"destination index \d+ out of range for buffer"):
        _plan(lay, lay, idx, bad)
    neg = dict(idx)
    neg[IndexKind.REQ_SLOT] = _arr(-1)
    with pytest.raises(PlanError, match="source index -1 out of range"):
        _plan(lay, lay, neg, idx)


@pytest.mark.parametrize("kind", [IndexKind.SWA_RING_ROWS, IndexKind.C128_STATE,
                                  IndexKind.REQ_SLOT])
def test_exact_kinds_refuse_length_mismatch(kind: IndexKind) -> None:
    lay = layout(compression_ratios=(0, 4, 128, 4))
    idx = request_indices(lay_spec := replace(UNIFIED_TARGET, compression_ratios=(0, 4, 128, 4)),
                          0, 300)
    assert 128 in lay_spec.compression_ratios
    short = dict(idx)
    short[kind] = idx[kind][:0]
    with pytest.raises(PlanError, match="needs an exact match"):
        _plan(lay, lay, idx, short)


def test_page_kinds_send_the_tail_when_decode_holds_a_prefix() -> None:
    lay = layout(UNIFIED_TARGET, None)
    idx = request_indices(UNIFIED_TARGET, 1, 1000)  # 4 KV pages
    dst = dict(idx)
    dst[IndexKind.KV_PAGES] = idx[IndexKind.KV_PAGES][2:]
    plan = build_plan(lay, _addrs(lay, 0), idx, lay, _addrs(lay, 0), dst)
    first = plan.buffers[0]
    assert first.items == 2
    longer = dict(idx)
    longer[IndexKind.KV_PAGES] = np.concatenate([idx[IndexKind.KV_PAGES], _arr(0)])
    with pytest.raises(PlanError, match="destination has more KV_PAGES indices"):
        build_plan(lay, _addrs(lay, 0), idx, lay, _addrs(lay, 0), longer)


def test_item_length_mismatch_is_refused() -> None:
    src = layout()
    dst = layout(head_dim=32)
    idx = request_indices(UNIFIED_TARGET, 0, 10)
    with pytest.raises(PlanError, match="item length differs"):
        _plan(src, dst, idx, idx)


def test_component_count_mismatch_is_refused() -> None:
    idx = request_indices(UNIFIED_TARGET, 0, 10)
    with pytest.raises(PlanError, match="component count differs"):
        _plan(layout(), layout(draft=None), idx, idx)


def test_address_list_must_match_the_layout() -> None:
    lay = layout()
    idx = request_indices(UNIFIED_TARGET, 0, 10)
    with pytest.raises(PlanError, match="address lists do not match"):
        build_plan(lay, [0], idx, lay, _addrs(lay, 0), idx)


def test_kv_and_state_selection() -> None:
    lay = layout()
    idx = request_indices(UNIFIED_TARGET, 0, 700)
    kv_only = build_plan(lay, _addrs(lay, 0), idx, lay, _addrs(lay, 0), idx, include_states=False)
    assert {b.component for b in kv_only.buffers} == {0}
    states = build_plan(lay, _addrs(lay, 0), idx, lay, _addrs(lay, 0), idx, include_kv=False)
    assert 0 not in {b.component for b in states.buffers}
    whole = build_plan(lay, _addrs(lay, 0), idx, lay, _addrs(lay, 0), idx)
    assert whole.total_bytes == kv_only.total_bytes + states.total_bytes


def test_draft_component_moves_the_target_window() -> None:
    lay = layout(PAGED_TARGET, PAGED_DRAFT)
    idx = request_indices(PAGED_TARGET, 2, 500)
    plan = build_plan(lay, _addrs(lay, 0), idx, lay, _addrs(lay, 0), idx)
    draft = [b for b in plan.buffers if b.name.startswith("draft.")]
    target0 = next(b for b in plan.buffers if b.name == "target.layer0.swa")
    assert draft and draft[0].component == len(lay.components) - 1
    assert draft[0].items == target0.items == len(idx[IndexKind.SWA_PAGES])


SPECS = [UNIFIED_TARGET, PAGED_TARGET, replace(UNIFIED_TARGET, compression_ratios=(128, 4, 0)),
         replace(PAGED_TARGET, compression_ratios=(4, 128), online_c128=True)]


@settings(max_examples=60, deadline=None)
@given(
    spec_i=st.integers(0, len(SPECS) - 1),
    src_slot=st.integers(0, 3),
    dst_slot=st.integers(0, 15),
    seq_len=st.integers(0, 2048),
    draft=st.booleans(),
)
def test_plans_stay_in_bounds_and_coalescing_preserves_bytes(
    spec_i: int, src_slot: int, dst_slot: int, seq_len: int, draft: bool
) -> None:
    spec = SPECS[spec_i]
    dspec = replace(spec, compression_ratios=(0,)) if draft else None
    src = layout(spec, dspec)
    dst_spec = replace(spec, num_req_slots=16)
    dst = layout(dst_spec, replace(dst_spec, compression_ratios=(0,)) if draft else None)
    s_idx = request_indices(spec, src_slot, seq_len)
    d_idx = request_indices(dst_spec, dst_slot, seq_len)
    s_addrs, d_addrs = _addrs(src, 1 << 32), _addrs(dst, 1 << 40)
    plan = build_plan(src, s_addrs, s_idx, dst, d_addrs, d_idx)
    # The draft component is always last.
    if draft:
        assert src.components[-1].pool == "draft"
    for bp in plan.buffers:
        sb = src.components[bp.component].buffers[bp.buffer]
        db = dst.components[bp.component].buffers[bp.buffer]
        flat = src.flat_buffers.index(sb)
        blocks = bp.blocks
        # never outside the buffer
        assert np.all(blocks.src >= s_addrs[flat])
        assert np.all(blocks.src + blocks.lengths <= s_addrs[flat] + sb.nbytes)
        assert np.all(blocks.dst >= d_addrs[flat])
        assert np.all(blocks.dst + blocks.lengths <= d_addrs[flat] + db.nbytes)
        # coalescing preserves the byte set: expanding blocks gives exactly the items
        item = sb.item_len
        s_items = np.concatenate([np.arange(s, s + n, item) for s, n in
                                  zip(blocks.src.tolist(), blocks.lengths.tolist(), strict=True)]
                                 or [np.zeros(0, np.int64)])
        d_items = np.concatenate([np.arange(d, d + n, item) for d, n in
                                  zip(blocks.dst.tolist(), blocks.lengths.tolist(), strict=True)]
                                 or [np.zeros(0, np.int64)])
        s_exp = s_addrs[flat] + s_idx[sb.index_kind] * item
        d_exp = d_addrs[flat] + d_idx[db.index_kind] * item
        assert s_items.tolist() == s_exp.tolist()
        assert d_items.tolist() == d_exp.tolist()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10_000), st.integers(0, 1 << 20)), max_size=20),
       st.integers(1, 5000))
def test_blocks_split_preserves_bytes(blocks: list[tuple[int, int]], max_len: int) -> None:
    lengths = np.array([n for n, _ in blocks], dtype=np.uint64)
    src = np.array([s for _, s in blocks], dtype=np.uint64)
    b = Blocks(src, src + np.uint64(7), lengths)
    s = b.split(max_len)
    assert s.total_bytes == b.total_bytes
    assert len(s) == 0 or int(s.lengths.max()) <= max_len
    assert np.all(s.dst == s.src + np.uint64(7))


@pytest.mark.parametrize("kind", ["paged", "sglang_mha", "dsv4"])
def test_a_layer_range_plans_only_those_layers_kv_buffers(kind: str) -> None:
    """``layers``: the main KV buffers of the source's layers in the range, nothing of
    the others; what the layer ranges plan adds up to the whole plan of every layer."""
    if kind == "paged":
        config = paged_side_config("m", paged_spec(
            num_layers=3, block_size=16, num_kv_heads=1, head_size=8, dtype="float16",
            inner_layout="LBHNC", num_blocks=64))
    elif kind == "sglang_mha":
        config = SideConfig(model="m", target=sglang_mha_spec(
            num_layers=3, page_size=4, num_kv_heads=2, head_dim=8, dtype="float16",
            token_rows=260, aux_item_lens=(8,), aux_rows=4))
    else:
        config = SideConfig(model="m", target=UNIFIED_TARGET, draft=None)
    lay = build_side_layout(config)
    addrs = [(i + 1) << 32 for i in range(len(lay.flat_buffers))]
    src = dst = request_indices(config.target, 0, 100)
    whole = build_plan(lay, addrs, src, lay, addrs, dst, include_states=False)
    parts = []
    for layer in range(lay.num_layers):
        plan = build_plan(lay, addrs, src, lay, addrs, dst, include_states=False,
                          layers=(layer, layer + 1))
        names = [name for _ci, _bi, name in plan.heads]
        assert names == [b.name for b, at in zip(lay.kv.buffers, lay.kv_layers, strict=True)
                         if at == layer], (layer, names)
        parts.append(plan.total_bytes)
    assert sum(parts) == whole.total_bytes > 0
