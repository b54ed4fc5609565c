"""sglang's target/draft checks and the cross-side comparison."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvbeam.errors import KvbeamError, PoolCompatibilityError
from kvbeam.pools.checks import check_sides, check_target_draft, compare_sides
from tests.fixtures import PAGED_DRAFT, PAGED_TARGET, UNIFIED_DRAFT, UNIFIED_TARGET, layout


def _error(target: object, draft: object) -> PoolCompatibilityError:
    with pytest.raises(PoolCompatibilityError) as info:
        check_target_draft(layout(target, draft), "prefill")  # type: ignore[arg-type]
    assert isinstance(info.value, KvbeamError)
    return info.value


def test_compatible_pairs_pass() -> None:
    check_target_draft(layout(UNIFIED_TARGET, UNIFIED_DRAFT), "prefill")
    check_target_draft(layout(PAGED_TARGET, PAGED_DRAFT), "decode")
    check_target_draft(layout(UNIFIED_TARGET, None), "decode")


@pytest.mark.parametrize("ratios", [(), (0, 4), (128,)])
def test_draft_must_be_swa_only(ratios: tuple[int, ...]) -> None:
    err = _error(UNIFIED_TARGET, replace(UNIFIED_DRAFT, compression_ratios=ratios))
    assert str(err).startswith("DSV4 draft state transfer expects SWA-only NextN layers")
    assert err.differences[0].field == "draft.compression_ratios"


def test_unified_mode_must_match() -> None:
    err = _error(UNIFIED_TARGET, PAGED_DRAFT)
    assert str(err).startswith("DSV4 target and draft pools must use the same unified-KV mode")
    assert "target=True, draft=False" in str(err)
    assert "(prefill side)" in str(err)


@pytest.mark.parametrize(
    "change",
    [{"sliding_window": 64}, {"swa_ring_size": 140}, {"num_req_slots": 5}, {"num_draft_tokens": 2}],
)
def test_ring_geometry_must_match(change: dict[str, Any]) -> None:
    err = _error(UNIFIED_TARGET, replace(UNIFIED_DRAFT, **change))
    assert str(err).startswith("DSV4 target and draft pools must share SWA ring geometry: ")
    assert "target=(128, 131, 524)" in str(err)


def test_swa_index_mapping_must_match() -> None:
    err = _error(PAGED_TARGET, replace(PAGED_DRAFT, swa_pages_per_req=5))
    assert str(err).startswith("DSV4 target and draft pools must share the SWA index mapping")
    assert [d.field for d in err.differences] == ["swa_index_mapping"]


def test_paged_geometry_must_match() -> None:
    err = _error(PAGED_TARGET, replace(PAGED_DRAFT, sliding_window=64, swa_pages_per_req=2))
    assert str(err).startswith("DSV4 target and draft pools must share paged SWA geometry: ")
    assert "target=(256, 128), draft=(256, 64)" in str(err)


def test_all_problems_are_reported_at_once() -> None:
    draft = replace(PAGED_DRAFT, compression_ratios=(4,), sliding_window=64, swa_pages_per_req=5)
    err = _error(PAGED_TARGET, draft)
    fields = [d.field for d in err.differences]
    assert fields == ["draft.compression_ratios", "swa_index_mapping", "paged_swa_geometry"]


def test_compatible_sides_differ_only_in_capacity() -> None:
    prefill = layout()
    decode = layout(draft=replace(UNIFIED_DRAFT, num_req_slots=16, max_context_len=4096),
                    num_req_slots=16, max_context_len=4096)
    assert compare_sides(prefill, decode) == []
    check_sides(prefill, decode)


@pytest.mark.parametrize(
    ("change", "field", "text"),
    [
        ({"unified_kv": False}, "unified_kv",
         "prefill and decode pools differ in unified-KV mode: prefill=True, decode=False"),
        ({"sliding_window": 64}, "sliding_window", "sliding window: prefill=128, decode=64"),
        ({"swa_ring_size": 140}, "swa_ring_size", "SWA ring size: prefill=131, decode=140"),
        ({"page_size": 128}, "page_size", "page size: prefill=256, decode=128"),
        ({"compression_ratios": (0, 4, 0, 128)}, "compression_ratios",
         "compression ratios: prefill=[0, 4, 0, 4], decode=[0, 4, 0, 128]"),
        ({"dtype": "float16"}, "dtype", "dtype: prefill=bfloat16, decode=float16"),
        ({"head_dim": 32}, "head_dim", "head dim: prefill=16, decode=32"),
    ],
)
def test_cross_side_field_mismatch(change: dict[str, Any], field: str, text: str) -> None:
    draft_change = {k: v for k, v in change.items() if k != "compression_ratios"}
    diffs = compare_sides(layout(), layout(draft=replace(UNIFIED_DRAFT, **draft_change), **change))
    fields = {d.field for d in diffs}
    assert field in fields
    assert any(text in d.message for d in diffs)
    assert all(d.side == "prefill/decode" for d in diffs)


def test_item_length_difference_names_the_buffer() -> None:
    diffs = compare_sides(layout(), layout(draft=replace(UNIFIED_DRAFT, head_dim=32), head_dim=32))
    item = [d for d in diffs if d.field.endswith("item_len")]
    assert item and "item length" in item[0].message


def test_within_side_problem_is_reported_in_a_cross_side_compare() -> None:
    bad = layout(UNIFIED_TARGET, PAGED_DRAFT)
    diffs = compare_sides(layout(), bad)
    first = diffs[0]
    assert first.side == "decode"
    assert first.message.startswith("DSV4 target and draft pools must use the same unified-KV mode")


def test_model_and_draft_presence() -> None:
    diffs = compare_sides(layout(), layout(draft=None))
    assert "draft" in {d.field for d in diffs}
    assert "components.count" in {d.field for d in diffs}
    with pytest.raises(PoolCompatibilityError, match="pool difference"):
        check_sides(layout(), layout(draft=None))
