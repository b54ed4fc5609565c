"""Pool spec loading, derived geometry and validation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvbeam.errors import ConfigError
from kvbeam.pools.spec import PoolSpec, SideConfig, load_side_config
from tests.fixtures import CONFIGS, UNIFIED_TARGET


def test_sglang_fixture_geometry() -> None:
    assert UNIFIED_TARGET.ring_size == 131
    assert UNIFIED_TARGET.swa_pages == 524
    assert UNIFIED_TARGET.page_size == 256


@pytest.mark.parametrize(
    ("ndt", "online", "c4", "c128", "ring"),
    [(0, False, 8, 128, 128), (4, False, 16, 256, 131), (0, True, 8, 1, 128),
     (1, False, 16, 256, 128)],
)
def test_ring_sizes(ndt: int, online: bool, c4: int, c128: int, ring: int) -> None:
    spec = replace(UNIFIED_TARGET, num_draft_tokens=ndt, online_c128=online)
    assert (spec.c4_ring_size, spec.c128_ring_size, spec.ring_size) == (c4, c128, ring)


def test_swa_pages_is_slots_times_ring() -> None:
    spec = replace(UNIFIED_TARGET, num_req_slots=7)
    assert spec.swa_pages == 7 * 131


def test_explicit_ring_overrides_default() -> None:
    assert replace(UNIFIED_TARGET, swa_ring_size=200).ring_size == 200


@pytest.mark.parametrize("name", ["prefill", "decode", "prefill-paged", "decode-paged"])
def test_shipped_configs_load(name: str) -> None:
    cfg = load_side_config(CONFIGS / f"{name}.yaml")
    assert cfg.model == "dsv4-tiny"
    assert cfg.draft is not None
    assert cfg.target.unified_kv == ("paged" not in name)


BASE = {"compression_ratios": [0, 4], "sliding_window": 128, "page_size": 256}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"compression_ratios": [0, 3]},
         "target.compression_ratios: each ratio must be 0, 4 or 128"),
        ({"compression_ratios": "0,4"}, "target.compression_ratios: must be a list"),
        ({"compression_ratios": [0, True]}, "every ratio must be an integer"),
        ({"sliding_window": -1}, "target.sliding_window: must be a positive integer"),
        ({"page_size": 0}, "target.page_size: must be a positive integer"),
        ({"page_size": 250}, "target.page_size: must be a multiple of every compression ratio"),
        ({"num_req_slots": 0}, "target.num_req_slots: must be a positive integer"),
        ({"head_dim": 1.5}, "target.head_dim: must be an integer"),
        ({"dtype": "float64"}, "target.dtype: unknown dtype"),
        ({"unified_kv": "yes"}, "target.unified_kv: must be true or false"),
        ({"swa_ring_size": 100}, "target.swa_ring_size: ring must hold the window"),
        ({"num_draft_tokens": -2}, "target.num_draft_tokens: must be >= 0"),
        ({"swa_pages_per_req": 1}, "target.swa_pages_per_req: must be >= ceil"),
        ({"windw": 3}, "unknown field(s) windw"),
        # Found by the config fuzz: a 2**39 window made the mapping fingerprint allocate 32 GiB.
        ({"sliding_window": 1 << 39}, "target.sliding_window: must be at most 1048576"),
        ({"num_draft_tokens": 1 << 30}, "target.num_draft_tokens: must be at most 1024"),
        ({"swa_ring_size": 1 << 40}, "target.swa_ring_size: must be at most 2097152"),
        ({"swa_pages_per_req": 1 << 40}, "target.swa_pages_per_req: must be at most"),
    ],
)
def test_bad_spec_names_the_field(change: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        SideConfig.from_mapping({"model": "m", "target": BASE | change}, source="x.yaml")
    assert needle in str(info.value)
    assert str(info.value).startswith("x.yaml: ")


def test_missing_and_malformed_top_level(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model: must be a non-empty string"):
        SideConfig.from_mapping({"target": BASE})
    with pytest.raises(ConfigError, match="target: required field is missing"):
        SideConfig.from_mapping({"model": "m"})
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        SideConfig.from_mapping([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="compression_ratios: required field is missing"):
        SideConfig.from_mapping({"model": "m", "target": {"page_size": 256}})
    with pytest.raises(ConfigError, match="must list at least one layer"):
        SideConfig.from_mapping({"model": "m", "target": {"compression_ratios": []}})
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_side_config(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_side_config(tmp_path / "missing.yaml")


def test_draft_may_have_empty_ratios_for_the_check_to_catch() -> None:
    cfg = SideConfig.from_mapping(
        {"model": "m", "target": BASE, "draft": {"compression_ratios": []}})
    assert cfg.draft is not None and cfg.draft.compression_ratios == ()


def test_spec_is_frozen_and_typed() -> None:
    spec = PoolSpec.from_mapping(BASE, "t")
    assert spec.compression_ratios == (0, 4)
    with pytest.raises(AttributeError):
        spec.page_size = 1  # type: ignore[misc]
