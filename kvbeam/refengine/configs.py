"""Small side configs whose page, window and C128 boundaries short prompts reach.

Page size 128 (the smallest a C128 layer allows), window 32, head dim 32: a prompt
of 256 tokens ends on a page, window and C128 boundary at once, 250 on none of them
(and finishes its C128 group 6 tokens into the continuation). Each config validates
through :meth:`~kvbeam.pools.spec.SideConfig.from_mapping`, as a YAML file would.
"""

from __future__ import annotations

from typing import Any

from kvbeam.pools.spec import SideConfig

RATIOS = [0, 4, 128, 4, 0]


def tiny_config(unified: bool = True, draft: bool = True, online_c128: bool = False,
                **target: Any) -> SideConfig:
    """A tiny DSV4-shaped side config (unified or paged SWA, with or without NextN draft)."""
    base: dict[str, Any] = {
        "unified_kv": unified,
        "sliding_window": 32,
        "num_draft_tokens": 3 if draft else 0,
        "page_size": 128,
        "num_req_slots": 4,
        "max_context_len": 1024,
        "head_dim": 32,
        "dtype": "bfloat16",
    }
    tgt = {**base, "compression_ratios": RATIOS, "indexer_head_dim": 16,
           "online_c128": online_c128, **target}
    data: dict[str, Any] = {"model": "refengine-tiny", "target": tgt}
    if draft:
        data["draft"] = {**base, "compression_ratios": [0]}
    name = f"tiny-{'unified' if unified else 'paged'}{'-draft' if draft else ''}"
    return SideConfig.from_mapping(data, source=name)
