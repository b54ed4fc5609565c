"""Fuzz the side-config loader: any YAML value either loads or is a ConfigError.

A daemon's first contact with an operator is its config; a malformed one must be
refused with a message naming the field, never with a TypeError from deep inside.
"""

from __future__ import annotations

from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbeam.errors import ConfigError
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.spec import SideConfig

FIELDS = ["compression_ratios", "unified_kv", "sliding_window", "num_draft_tokens",
          "swa_ring_size", "page_size", "num_req_slots", "head_dim", "dtype",
          "swa_pages_per_req", "online_c128", "max_context_len", "c4_ring_size",
          "c128_ring_size", "indexer_head_dim", "bogus"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40),
                    st.floats(allow_nan=True), st.text(max_size=8),
                    st.sampled_from([0, 1, 4, 128, 256, 4096, "bfloat16", "float8_e4m3fn"]))
VALUES = st.one_of(SCALARS, st.lists(st.one_of(st.sampled_from([0, 4, 128]), SCALARS),
                                     max_size=6))
#: A valid base with up to two fields replaced, so the fuzz also reaches the layout.
BASE = {"compression_ratios": [0, 4, 128], "sliding_window": 128, "page_size": 256}
SPECS = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=2).map(
    lambda changes: BASE | changes)


@settings(max_examples=400, deadline=None)
@given(target=SPECS, draft=st.one_of(st.none(), SPECS),
       model=st.one_of(st.just("m"), SCALARS))
def test_any_mapping_loads_or_names_its_problem(target: dict[str, Any],
                                                draft: dict[str, Any] | None,
                                                model: Any) -> None:
    raw: dict[str, Any] = {"model": model, "target": target}
    if draft is not None:
        raw["draft"] = draft
    try:
        config = SideConfig.from_mapping(raw, source="fuzz.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("fuzz.yaml: ")
        return
    try:
        layout = build_side_layout(config)
    except ConfigError:
        return  # geometry the layout refuses, with a ConfigError: fine
    event("layout built")
    assert layout.total_bytes > 0
