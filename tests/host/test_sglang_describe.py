"""The backend's description of sglang's real ``MHATokenToKVPool`` and ``MetadataBuffers``.

Built on the CPU with sglang 0.5.23's own classes (no server): the description read from
them must lay out exactly the buffers sglang hands a backend (``get_contiguous_buf_infos``,
``get_buf_infos``), for each KV dtype, and a side YAML that says another dtype is
refused. Runs in the sglang server venv (``make test-sglang``); elsewhere it is skipped,
and KVBEAM_REQUIRE_SGLANG_SERVER=1 turns the skip into a failure.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

HAVE_POOLS = importlib.util.find_spec("sglang") is not None and all(
    importlib.util.find_spec(m) is not None for m in ("transformers", "uvicorn"))
if not HAVE_POOLS and os.environ.get("KVBEAM_REQUIRE_SGLANG_SERVER") == "1":
    raise RuntimeError("KVBEAM_REQUIRE_SGLANG_SERVER=1 but the sglang server venv is not "
                       "this interpreter's (make test-sglang)")
pytestmark = pytest.mark.skipif(not HAVE_POOLS,
                                reason="sglang's pool classes need the server venv "
                                       "(make test-sglang)")

from kvbeam.errors import ConfigError  # noqa: E402 (after the skip decision)
from kvbeam.integrations.sglang import memory  # noqa: E402
from kvbeam.integrations.sglang.describe import (  # noqa: E402
    engine_description,
    reconcile,
)
from kvbeam.integrations.sglang.kvargs import check_kvargs  # noqa: E402
from kvbeam.pools.layout import build_side_layout  # noqa: E402
from tests.sglang_server_helpers import STUBS  # noqa: E402

# sglang's model configs import torchvision and sgl_kernel, which have no CPU package:
# the import-only stand-ins the served test gives its servers (tests/sglang_server/stubs).
if HAVE_POOLS and str(STUBS) not in sys.path:
    sys.path.insert(0, str(STUBS))


def _sglang(dtype_name: str, page_size: int = 1) -> tuple[Any, Any, Any]:
    """sglang's pool and metadata buffers, and the KVArgs sglang's prefill fills from
    them (disaggregation/prefill.py ``_init_kv_manager``)."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(size=64, page_size=page_size, dtype=getattr(torch, dtype_name),
                            head_num=2, head_dim=32, layer_num=2, device="cpu",
                            enable_memory_saver=False, enable_alt_stream=False)
    meta = MetadataBuffers(16, hidden_size=16, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=8)
    args = SimpleNamespace(state_types=[], state_data_ptrs=[], state_data_lens=[],
                           state_item_lens=[])
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
    return pool, meta, args


@pytest.mark.parametrize(("dtype", "page_size"), [("float16", 1), ("bfloat16", 1),
                                                  ("float32", 4)])
def test_the_description_lays_out_what_sglang_hands_the_backend(dtype: str,
                                                                page_size: int) -> None:
    pool, _meta, args = _sglang(dtype, page_size)
    memory.remember(pool, memory.MHA)
    target, draft = memory.pools_for(args)
    assert target == (pool, memory.MHA) and draft is None
    engine = engine_description(target, draft, args, "tiny")
    assert engine is not None and engine.config is not None
    spec = engine.config.target
    assert (spec.dtype, spec.page_size, spec.num_kv_heads, spec.head_dim,
            len(spec.compression_ratios), spec.max_context_len) == (
        dtype, page_size, 2, 32, 2, 64 + page_size)
    assert spec.aux_rows == 16 and spec.aux_item_lens == tuple(args.aux_item_lens)
    check_kvargs(args, build_side_layout(engine.config))  # every length and item length


def test_a_yaml_with_another_dtype_than_sglangs_pool_is_refused() -> None:
    pool, _meta, args = _sglang("bfloat16")
    memory.remember(pool, memory.MHA)
    engine = engine_description(*memory.pools_for(args), args, "tiny")
    assert engine is not None and engine.config is not None
    wrong = replace(engine.config, target=replace(engine.config.target, dtype="float16"),
                    source="decode.yaml")
    with pytest.raises(ConfigError, match=r"target.dtype: decode.yaml says 'float16', "
                                          r"sglang's server has 'bfloat16' \(--kv-cache-dtype"):
        reconcile(engine, wrong, "decode")
    # Same byte lengths: the KVArgs check alone (what the plugin compared) passes it.
    check_kvargs(args, build_side_layout(wrong))
