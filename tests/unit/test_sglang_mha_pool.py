"""The sglang_mha pool kind: spec, layout (K, V, metadata rows), wire, two-sided checks."""

from __future__ import annotations

import numpy as np
import pytest

from kvbeam.errors import BadIndexList, ConfigError, PoolCompatibilityError
from kvbeam.pools.checks import check_sides, compare_sides
from kvbeam.pools.engine_indices import validate
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.paged import paged_side_config, paged_spec
from kvbeam.pools.sglang_mha import page_bytes, sglang_mha_spec
from kvbeam.pools.spec import SideConfig
from kvbeam.pools.types import IndexKind, StateType
from kvbeam.proto.attach_codec import config_to_mapping
from kvbeam.proto.layout_codec import layout_from_proto, layout_to_proto

#: sglang 0.5.23's MetadataBuffers rows for a tiny model without speculation.
AUX = (64, 64, 64, 64, 512, 512, 64, 128, 64, 64)
BASE = dict(num_layers=2, page_size=4, num_kv_heads=2, head_dim=32, dtype="float16",
            token_rows=4100, aux_item_lens=AUX, aux_rows=16)


def side(**over: object) -> SideConfig:
    return SideConfig(model="tiny-llama",
                      target=sglang_mha_spec(**{**BASE, **over}))  # type: ignore[arg-type]


def test_layout_is_k_then_v_per_layer_and_the_metadata_rows() -> None:
    layout = build_side_layout(side())
    item = 4 * 2 * 32 * 2
    assert page_bytes(side().target) == item
    kv = layout.kv.buffers
    assert [b.name for b in kv] == ["target.layer0.k", "target.layer1.k", "target.layer0.v",
                                    "target.layer1.v"]
    assert {(b.item_len, b.items, b.index_kind) for b in kv} == {(item, 1025,
                                                                  IndexKind.KV_PAGES)}
    (aux,) = layout.states
    assert aux.state_type is StateType.AUX
    assert [(b.item_len, b.items, b.index_kind) for b in aux.buffers] == [
        (n, 16, IndexKind.REQ_SLOT) for n in AUX]


def test_wire_and_config_round_trips() -> None:
    layout = build_side_layout(side())
    assert layout_from_proto(layout_to_proto(layout)) == layout
    cfg = side()
    assert SideConfig.from_mapping(config_to_mapping(cfg), cfg.source) == cfg


def test_capacities_may_differ_between_sides() -> None:
    # sglang's prefill has max_running_requests * 2 metadata rows, decode its
    # req_to_token_pool's * 2; token rows follow each server's memory.
    check_sides(build_side_layout(side()), build_side_layout(side(aux_rows=400,
                                                                  token_rows=8196)))


@pytest.mark.parametrize(("over", "wording"), [
    ({"num_kv_heads": 4}, "KV heads: prefill=2, decode=4"),
    ({"head_dim": 64}, "head size: prefill=32, decode=64"),
    ({"dtype": "bfloat16"}, "dtype: prefill=float16, decode=bfloat16"),
    ({"page_size": 8, "token_rows": 4104}, "block size: prefill=4, decode=8"),
    ({"aux_item_lens": (*AUX[:-1], 128)}, "buffer 9 (target.aux9) item length: prefill=64, "
                                          "decode=128"),
    ({"aux_item_lens": AUX[:-1]}, "component 1 (target.aux) buffer count: prefill=10, "
                                  "decode=9"),
])
def test_each_geometry_difference_is_named(over: dict[str, object], wording: str) -> None:
    diffs = compare_sides(build_side_layout(side()), build_side_layout(side(**over)))
    assert any(wording in d.message for d in diffs), [d.message for d in diffs]
    with pytest.raises(PoolCompatibilityError):
        check_sides(build_side_layout(side()), build_side_layout(side(**over)))


def test_an_sglang_pool_never_matches_a_vllm_paged_one() -> None:
    vllm = paged_side_config("tiny-llama", paged_spec(
        num_layers=2, block_size=4, num_kv_heads=2, head_size=32, dtype="float16",
        inner_layout="nhd", num_blocks=1025))
    diffs = compare_sides(build_side_layout(side()), build_side_layout(vllm))
    assert diffs[0].message == ("prefill and decode pools differ in pool kind: "
                                "prefill=sglang_mha, decode=paged")


@pytest.mark.parametrize(("over", "field"), [
    ({"aux_item_lens": ()}, "aux_item_lens"),
    ({"aux_item_lens": (64, 0)}, "aux_item_lens"),
    ({"aux_rows": 0}, "aux_rows"),
    ({"token_rows": 4101}, "max_context_len"),
])
def test_bad_specs_are_refused_naming_the_field(over: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"sglang_mha pool.{field}: "):
        sglang_mha_spec(**{**BASE, **over})  # type: ignore[arg-type]


def test_aux_fields_belong_to_the_sglang_kind_only() -> None:
    data = config_to_mapping(paged_side_config("m", paged_spec(
        num_layers=1, block_size=4, num_kv_heads=1, head_size=8, dtype="float16",
        inner_layout="x", num_blocks=4)))
    data["target"]["aux_rows"] = 3
    with pytest.raises(ConfigError, match="aux_item_lens and aux_rows belong to the "
                                          "sglang_mha kind"):
        SideConfig.from_mapping(data, "paged-with-aux")


def test_the_metadata_row_is_one_request_slot_index_in_range() -> None:
    cfg = side()
    layout = build_side_layout(cfg)
    lists = {IndexKind.KV_PAGES: np.arange(3), IndexKind.REQ_SLOT: np.array([15])}
    target, _ = validate("decode", cfg.target, layout, lists, {}, 10)
    assert target[IndexKind.REQ_SLOT].tolist() == [15]
    with pytest.raises(BadIndexList, match="REQ_SLOT index 16 at position 0 is out of range"):
        validate("decode", cfg.target, layout, {**lists, IndexKind.REQ_SLOT: np.array([16])},
                 {}, 10)
    with pytest.raises(BadIndexList, match="index lists missing for REQ_SLOT"):
        validate("decode", cfg.target, layout, {IndexKind.KV_PAGES: np.arange(3)}, {}, 10)
