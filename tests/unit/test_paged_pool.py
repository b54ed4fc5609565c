"""The generic paged pool kind: spec, layout, wire round trip and two-sided checks."""

from __future__ import annotations

import dataclasses

import pytest

from kvbeam.errors import ConfigError, PoolCompatibilityError
from kvbeam.pools.checks import check_sides, compare_sides
from kvbeam.pools.engine_indices import validate
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.paged import block_bytes, paged_side_config, paged_spec
from kvbeam.pools.spec import SideConfig
from kvbeam.pools.types import IndexKind
from kvbeam.proto.attach_codec import config_to_mapping
from kvbeam.proto.layout_codec import layout_from_proto, layout_to_proto
from tests.fixtures import side as dsv4_side

BASE = dict(num_layers=2, block_size=32, num_kv_heads=2, head_size=32, dtype="bfloat16",
            inner_layout="LBHNC", num_blocks=10)


def side(**over: object) -> SideConfig:
    return paged_side_config("tiny-llama", paged_spec(**{**BASE, **over}))  # type: ignore[arg-type]


def test_layout_is_one_block_buffer_per_layer() -> None:
    layout = build_side_layout(side())
    item = 2 * 32 * 2 * 32 * 2
    assert block_bytes(side().target) == item
    assert [b.item_len for b in layout.flat_buffers] == [item, item]
    assert [b.items for b in layout.flat_buffers] == [10, 10]
    assert {b.index_kind for b in layout.flat_buffers} == {IndexKind.KV_PAGES}
    assert layout.states == () and layout.total_bytes == 2 * 10 * item


def test_wire_round_trip_keeps_the_paged_fields() -> None:
    layout = build_side_layout(side())
    back = layout_from_proto(layout_to_proto(layout))
    assert back == layout
    assert (back.target.kind, back.target.num_kv_heads, back.target.inner_layout) == (
        "paged", 2, "LBHNC")


def test_config_mapping_round_trip() -> None:
    cfg = side()
    assert SideConfig.from_mapping(config_to_mapping(cfg), cfg.source) == cfg


def test_same_geometry_other_capacity_is_compatible() -> None:
    check_sides(build_side_layout(side()), build_side_layout(side(num_blocks=99)))


@pytest.mark.parametrize(("over", "field", "values"), [
    ({"num_layers": 3}, "num_layers", ("2", "3")),
    ({"block_size": 64}, "block_size", ("32", "64")),
    ({"num_kv_heads": 4}, "num_kv_heads", ("2", "4")),
    ({"head_size": 64}, "head_size", ("32", "64")),
    ({"dtype": "float32"}, "dtype", ("bfloat16", "float32")),
    ({"inner_layout": "LBNHC"}, "inner_layout", ("LBHNC", "LBNHC")),
])
def test_every_difference_is_named_with_both_values(over: dict[str, object], field: str,
                                                    values: tuple[str, str]) -> None:
    diffs = compare_sides(build_side_layout(side()), build_side_layout(side(**over)))
    named = [d for d in diffs if d.field == field]
    assert len(named) == 1, diffs
    assert named[0].side == "prefill/decode"
    assert named[0].values == (("prefill", values[0]), ("decode", values[1]))
    assert values[0] in named[0].message and values[1] in named[0].message


def test_all_differences_at_once_and_raised() -> None:
    other = side(block_size=64, num_kv_heads=4, inner_layout="X")
    with pytest.raises(PoolCompatibilityError) as err:
        check_sides(build_side_layout(side()), build_side_layout(other))
    fields = {d.field for d in err.value.differences}
    assert {"block_size", "num_kv_heads", "inner_layout"} <= fields


def test_paged_against_dsv4_names_the_kind() -> None:
    diffs = compare_sides(build_side_layout(side()), build_side_layout(dsv4_side()))
    kind = [d for d in diffs if d.field == "kind"]
    assert kind and kind[0].values == (("prefill", "paged"), ("decode", "dsv4"))


def test_old_peer_without_kind_decodes_as_dsv4() -> None:
    msg = layout_to_proto(build_side_layout(dsv4_side()))
    msg.target.kind = ""
    msg.target.num_kv_heads = 0
    back = layout_from_proto(msg)
    assert back.target.kind == "dsv4" and back.target.num_kv_heads == 1


@pytest.mark.parametrize(("over", "field"), [
    ({"inner_layout": ""}, "inner_layout"),
    ({"num_kv_heads": 0}, "num_kv_heads"),
])
def test_bad_paged_spec_refused(over: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        side(**over)


def test_dsv4_refuses_paged_only_fields() -> None:
    with pytest.raises(ConfigError, match="kind"):
        dataclasses.replace(dsv4_side().target, num_kv_heads=2).validate("t")


def test_engine_block_ids_are_the_kv_pages_list() -> None:
    cfg = side()
    layout = build_side_layout(cfg)
    target, _ = validate("decode", cfg.target, layout, {IndexKind.KV_PAGES: [7, 3, 9]}, {}, 70)
    assert list(target[IndexKind.KV_PAGES]) == [7, 3, 9]
