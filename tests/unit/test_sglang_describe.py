"""The sglang backend's pool description read from the engine (no sglang server).

sglang's pool objects are stand-ins with sglang 0.5.23's attribute names (the real
``MHATokenToKVPool`` is built in tests/host/test_sglang_describe.py, in the sglang
server venv); the comparisons are the ones the manager runs at start and decode runs
per prefill.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from kvbeam.errors import ConfigError
from kvbeam.integrations.sglang import memory
from kvbeam.integrations.sglang.describe import (
    engine_description,
    mha_description,
    peer_differences,
    reconcile,
)
from kvbeam.pools.sglang_mha import sglang_mha_spec
from kvbeam.pools.spec import SideConfig
from kvbeam.refengine.configs import tiny_config

AUX = (64, 128)


def _pool(**over: Any) -> SimpleNamespace:
    """An ``MHATokenToKVPool`` as the backend reads it: 2 layers, 2 heads x 32, page 1."""
    values: dict[str, Any] = dict(layer_num=2, page_size=1, head_num=2, head_dim=32,
                                  v_head_dim=32, dtype="torch.float16", size=64,
                                  kv_cache_layout="nhd")
    values.update(over)
    return SimpleNamespace(**values)


def _kvargs(rows: int = 16) -> SimpleNamespace:
    return SimpleNamespace(aux_item_lens=list(AUX), aux_data_lens=[n * rows for n in AUX])


def _config(**over: Any) -> SideConfig:
    values: dict[str, Any] = dict(num_layers=2, page_size=1, num_kv_heads=2, head_dim=32,
                                  dtype="float16", token_rows=65, aux_item_lens=AUX,
                                  aux_rows=16, max_inflight=16)
    values.update(over)
    return SideConfig(model="m", target=sglang_mha_spec(**values), source="side.yaml")


def test_an_mha_pool_is_described_whole_from_sglangs_objects() -> None:
    got = mha_description(_pool(), _kvargs(), "m")
    assert got.config is not None
    assert got.config.target == _config().target  # every field, capacities included
    assert got.derived["target.dtype"] == "float16" and got.derived["model"] == "m"
    bf16 = mha_description(_pool(dtype="torch.bfloat16", page_size=4), _kvargs(), "m")
    assert bf16.config is not None
    assert (bf16.config.target.dtype, bf16.config.target.page_size,
            bf16.config.target.max_context_len) == ("bfloat16", 4, 68)


@pytest.mark.parametrize(("over", "match"), [
    ({"kv_cache_layout": "hnd"}, "layout is hnd: kvbeam moves the nhd layout only"),
    ({"v_head_dim": 16}, "V head dim 16 beside K head dim 32"),
    ({"dtype": "torch.float8_e5m2"}, r"dtype float8_e5m2: kvbeam moves .*\(--kv-cache-dtype\)"),
])
def test_pools_kvbeam_cannot_move_are_refused_naming_why(over: dict[str, Any],
                                                         match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        mha_description(_pool(**over), _kvargs(), "m")


def test_metadata_buffers_of_different_rows_are_refused() -> None:
    args = SimpleNamespace(aux_item_lens=[64, 128], aux_data_lens=[64 * 16, 128 * 8])
    with pytest.raises(ConfigError, match="different row counts"):
        mha_description(_pool(), args, "m")


def test_a_side_yaml_that_differs_from_the_engine_is_refused_naming_both() -> None:
    engine = mha_description(_pool(dtype="torch.bfloat16"), _kvargs(), "m")
    # The case: both YAMLs said float16, the server ran --kv-cache-dtype bfloat16.
    given = _config(dtype="float16")
    with pytest.raises(ConfigError) as info:
        reconcile(engine, given, "decode")
    text = str(info.value)
    assert "target.dtype: side.yaml says 'float16', sglang's server has 'bfloat16'" in text
    assert "--kv-cache-dtype" in text and "leave KVBEAM_CONFIG unset" in text
    # Every differing field is named, not the first only.
    two = _config(dtype="float16", page_size=2, token_rows=66)
    with pytest.raises(ConfigError) as info:
        reconcile(engine, two, "decode")
    assert all(f in str(info.value) for f in ("target.dtype", "target.page_size",
                                              "--page-size", "target.max_context_len"))
    # Negative control: the same YAML as the engine's is taken.
    same = reconcile(engine, replace(_config(dtype="bfloat16")), "decode")
    assert same == engine.config


def test_without_a_yaml_the_engines_description_is_used() -> None:
    engine = mha_description(_pool(), _kvargs(), "m")
    assert reconcile(engine, None, "prefill") == engine.config


def test_memory_no_sglang_pool_describes_needs_the_yaml() -> None:
    with pytest.raises(ConfigError, match="nothing describes the pools: set KVBEAM_CONFIG"):
        reconcile(None, None, "prefill")
    given = _config()
    assert reconcile(None, given, "prefill") is given


def _dsv4(unified: bool, window: int = 128, ring: int = 128, slots: int = 8,
          ratios: tuple[int, ...] = (0, 4, 128), page: int = 64) -> SimpleNamespace:
    """A ``DeepSeekV4TokenToKVPool`` as sglang's setup_state_kv_args reads it."""
    return SimpleNamespace(_unified_kv=unified, compression_ratios=list(ratios),
                           page_size=page, sliding_window=window, unified_swa_window=window,
                           unified_swa_ring_size=ring, unified_swa_pages=slots * ring)


def test_dsv4_geometry_is_read_from_sglangs_attributes_and_checked() -> None:
    config = tiny_config(unified=True, draft=True)
    t, d = config.target, config.draft
    assert d is not None
    target = _dsv4(True, t.sliding_window, t.ring_size, t.num_req_slots,
                   t.compression_ratios, t.page_size)
    draft = _dsv4(True, d.sliding_window, d.ring_size, d.num_req_slots,
                  d.compression_ratios, d.page_size)
    engine = engine_description((target, memory.DSV4), (draft, memory.DSV4), _kvargs(), "m")
    assert engine is not None and engine.config is None
    assert reconcile(engine, config, "prefill") is config
    # A YAML whose draft says paged SWA while sglang's draft is unified: refused.
    paged_draft = replace(config, draft=replace(d, unified_kv=False))
    with pytest.raises(ConfigError, match=r"draft.unified_kv: .* says False, sglang's "
                                          r"server has True"):
        reconcile(engine, paged_draft, "prefill")
    with pytest.raises(ConfigError, match=r"draft: .* has no draft pool, sglang's server has"):
        reconcile(engine, replace(config, draft=None), "prefill")
    # Only the checked fields come from sglang: the rest needs the YAML.
    with pytest.raises(ConfigError, match=r"gives only target.compression_ratios.*set "
                                          r"KVBEAM_CONFIG"):
        reconcile(engine, None, "prefill")


def test_an_mha_pool_with_a_draft_is_refused() -> None:
    with pytest.raises(ConfigError, match="speculative draft KV pool"):
        engine_description((_pool(), memory.MHA), (_pool(), memory.MHA), _kvargs(), "m")


def test_the_pools_kvargs_points_at_are_found_target_first() -> None:
    class Pool:  # held weakly, as sglang's objects are
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

        def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
            return [self.ptr], [64], [8]

    pool = Pool

    target, draft, other = pool(1000), pool(5000), pool(9000)
    for p in (other, draft, target):
        memory.remember(p, memory.DSV4)
    args = SimpleNamespace(kv_data_ptrs=[1000, 2000], state_data_ptrs=[[3000], [5000]])
    assert memory.pools_for(args) == ((target, memory.DSV4), (draft, memory.DSV4))
    assert memory.pools_for(SimpleNamespace(kv_data_ptrs=[4000])) == (None, None)
    with pytest.raises(ValueError, match="unknown sglang pool kind"):
        memory.remember(target, "mla")


def test_peer_differences_name_the_sglang_setting_on_each() -> None:
    prefill = _config()
    decode = _config(dtype="bfloat16", page_size=4, token_rows=68)
    got = peer_differences(prefill, decode, "127.0.0.1:8998")
    text = "; ".join(got)
    assert "dtype: prefill=float16, decode=bfloat16 (--kv-cache-dtype" in text
    assert "block size: prefill=1, decode=4 (--page-size)" in text
    # Capacities are each side's own: not a difference.
    assert peer_differences(prefill, _config(token_rows=129, aux_rows=4,
                                             max_inflight=4), "x") == []
