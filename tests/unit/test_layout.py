"""Layouts: positional components in sglang's order, buffer geometry, main KV order."""

from __future__ import annotations

from dataclasses import replace

from kvbeam.pools.layout import LayoutCache
from kvbeam.pools.types import IndexKind, StateType
from tests.fixtures import PAGED_DRAFT, PAGED_TARGET, UNIFIED_DRAFT, UNIFIED_TARGET, layout

S, R, C = StateType.SWA, StateType.SWA_RING, StateType.C128_STATE


def test_paged_type_list_is_swa_swa() -> None:
    assert layout(PAGED_TARGET, PAGED_DRAFT).state_types == [S, S]


def test_unified_type_list_is_swa_ring_ring() -> None:
    assert layout(UNIFIED_TARGET, UNIFIED_DRAFT).state_types == [S, R, R]


def test_c128_component_sits_before_the_draft() -> None:
    assert layout(compression_ratios=(0, 4, 128)).state_types == [S, R, C, R]
    lay = layout(PAGED_TARGET, PAGED_DRAFT, compression_ratios=(128, 0))
    assert lay.state_types == [S, C, S]


def test_no_draft_means_no_draft_component() -> None:
    lay = layout(UNIFIED_TARGET, None)
    assert lay.state_types == [S, R]
    assert all(c.pool == "target" for c in lay.components)


def test_draft_component_is_last_and_holds_only_draft_buffers() -> None:
    for lay in (layout(), layout(PAGED_TARGET, PAGED_DRAFT)):
        last = lay.states[-1]
        assert last.pool == "draft"
        assert all(b.name.startswith("draft.") for b in last.buffers)
        assert all(c.pool == "target" for c in lay.components[:-1])


def test_main_kv_order_c4_kv_then_c4_indexer_then_c128_kv() -> None:
    lay = layout(compression_ratios=(4, 128, 4, 0, 128))
    names = [b.name for b in lay.kv.buffers]
    assert names == [
        "target.layer0.c4_kv", "target.layer2.c4_kv",
        "target.layer0.c4_indexer", "target.layer2.c4_indexer",
        "target.layer1.c128_kv", "target.layer4.c128_kv",
    ]
    assert all(b.index_kind is IndexKind.KV_PAGES for b in lay.kv.buffers)


def test_unified_kv_region_starts_after_the_ring_rows() -> None:
    spec = UNIFIED_TARGET
    lay = layout()
    row = spec.kv_row_bytes
    kv = lay.kv.buffers[0]  # layer1 C4
    ring = next(b for b in lay.states[1].buffers if b.name == "target.layer1.swa_ring")
    assert kv.tensor == ring.tensor
    assert ring.offset == 0 and ring.nbytes == spec.swa_pages * row == 524 * row
    assert kv.offset == spec.swa_pages * row
    # compressed layers hold one row per 4 tokens: a page of 256 tokens is 64 rows
    assert kv.item_len == 64 * row
    assert kv.items == spec.full_pages
    assert lay.tensors[kv.tensor].nbytes == kv.offset + kv.nbytes


def test_c128_kv_item_is_two_rows_per_page_and_state_items() -> None:
    spec = replace(UNIFIED_TARGET, compression_ratios=(128,), num_draft_tokens=0)
    lay = layout(spec, None)
    kv = lay.kv.buffers[0]
    assert kv.item_len == 2 * spec.kv_row_bytes
    state = lay.states[-1].buffers[0]
    assert state.index_kind is IndexKind.C128_STATE
    srow = 2 * spec.head_dim * 4
    assert state.item_len == 128 * srow
    assert state.items == spec.num_req_slots  # ring 128 = one item per request
    online = layout(replace(spec, online_c128=True), None).states[-1].buffers[0]
    assert online.item_len == 3 * spec.head_dim * 4 and online.items == spec.num_req_slots


def test_paged_swa_buffers_hold_pages_per_request() -> None:
    lay = layout(PAGED_TARGET, PAGED_DRAFT)
    swa = lay.states[0].buffers[0]
    assert swa.index_kind is IndexKind.SWA_PAGES
    assert swa.item_len == PAGED_TARGET.page_size * PAGED_TARGET.kv_row_bytes
    assert swa.items == PAGED_TARGET.num_req_slots * PAGED_TARGET.swa_pages_per_request


def test_c4_states_follow_swa_pages_in_the_target_swa_component() -> None:
    lay = layout(PAGED_TARGET, PAGED_DRAFT)
    kinds = [b.index_kind for b in lay.states[0].buffers]
    n_layers = len(PAGED_TARGET.compression_ratios)
    assert kinds[:n_layers] == [IndexKind.SWA_PAGES] * n_layers
    assert kinds[n_layers:] == [IndexKind.REQ_SLOT] * 4  # 2 C4 layers x (attn, indexer)
    c4 = lay.states[0].buffers[n_layers]
    assert c4.item_len == PAGED_TARGET.c4_ring_size * 2 * PAGED_TARGET.head_dim * 4


def test_every_buffer_fits_its_tensor() -> None:
    for lay in (layout(), layout(PAGED_TARGET, PAGED_DRAFT), layout(compression_ratios=(128, 4))):
        for b in lay.flat_buffers:
            assert b.offset >= 0 and b.offset + b.nbytes <= lay.tensors[b.tensor].nbytes
            assert b.nbytes % b.item_len == 0


def test_a_layout_cache_computes_once_per_layout_object_and_extra() -> None:
    """Keyed by identity: the same layout object and extra reuse the value; another
    extra, or an equal layout that is another object, computes anew; a full cache is
    emptied rather than grown."""
    made: list[str] = []
    cache: LayoutCache[str] = LayoutCache(limit=3)

    def make(tag: str) -> str:
        made.append(tag)
        return tag

    a, b = layout(), layout()
    assert a == b and a is not b
    assert cache.get(a, None, lambda: make("a")) == "a"
    assert cache.get(a, None, lambda: make("again")) == "a"
    assert cache.get(a, 1, lambda: make("a1")) == "a1"
    assert cache.get(b, None, lambda: make("b")) == "b"
    assert made == ["a", "a1", "b"]
    assert cache.get(b, 2, lambda: make("b2")) == "b2"  # full: emptied, then kept
    assert cache.get(a, None, lambda: make("a again")) == "a again"
    assert made == ["a", "a1", "b", "b2", "a again"]
