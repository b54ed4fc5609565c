"""Shared test data: pool specs (sglang's DSV4 fixtures among them), the shipped configs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kvbeam.pools.layout import SideLayout, build_side_layout
from kvbeam.pools.spec import PoolSpec, SideConfig

#: The repository root.
REPO = Path(__file__).resolve().parent.parent
#: The shipped side configs (what the containers and daemon tests run).
CONFIGS = REPO / "docker" / "config"


def shipped_config(role: str, paged: bool = False) -> str:
    """Path of a shipped config: docker/config/ROLE[-paged].yaml."""
    return str(CONFIGS / f"{role}{'-paged' if paged else ''}.yaml")


#: sglang's unified-KV fixture: window 128, ring 131 (4 draft tokens), pages 524, page size 256.
UNIFIED_TARGET = PoolSpec(
    compression_ratios=(0, 4, 0, 4),
    unified_kv=True,
    sliding_window=128,
    num_draft_tokens=4,
    page_size=256,
    num_req_slots=4,
    max_context_len=2048,
    head_dim=16,
    indexer_head_dim=8,
)
UNIFIED_DRAFT = replace(UNIFIED_TARGET, compression_ratios=(0,))
PAGED_TARGET = replace(UNIFIED_TARGET, unified_kv=False)
PAGED_DRAFT = replace(PAGED_TARGET, compression_ratios=(0,))


def side(target: PoolSpec = UNIFIED_TARGET, draft: PoolSpec | None = UNIFIED_DRAFT,
         model: str = "dsv4-test", **target_changes: Any) -> SideConfig:
    """A side config, optionally with target fields changed."""
    return SideConfig(model=model, target=replace(target, **target_changes), draft=draft)


def layout(target: PoolSpec = UNIFIED_TARGET, draft: PoolSpec | None = UNIFIED_DRAFT,
           **target_changes: Any) -> SideLayout:
    """A side layout, optionally with target fields changed."""
    return build_side_layout(side(target, draft, **target_changes))
