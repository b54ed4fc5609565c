"""Per-request index maps."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvbeam.errors import PlanError
from kvbeam.pools.indices import (
    c128_state,
    kv_pages,
    request_indices,
    swa_index_mapping_fingerprint,
    swa_ring_rows,
    swa_window_pages,
)
from kvbeam.pools.types import IndexKind
from tests.fixtures import PAGED_TARGET, UNIFIED_TARGET

SPEC = replace(UNIFIED_TARGET, num_req_slots=8, max_context_len=8192)


def test_c128_state_sglang_example() -> None:
    spec = replace(SPEC, num_draft_tokens=4)  # ring 256
    assert spec.c128_ring_size == 256
    assert c128_state(spec, 7, 129).tolist() == [15]


@pytest.mark.parametrize("seq_len", [0, 128, 256, 1024])
def test_c128_state_empty_at_multiples_of_128(seq_len: int) -> None:
    assert c128_state(SPEC, 3, seq_len).tolist() == []


def test_c128_state_offline_and_online() -> None:
    offline = replace(SPEC, num_draft_tokens=0)  # ring 128: one item per request
    assert c128_state(offline, 5, 300).tolist() == [5]
    spec256 = replace(SPEC, num_draft_tokens=2)
    assert c128_state(spec256, 2, 100).tolist() == [4]
    assert c128_state(spec256, 2, 200).tolist() == [5]
    assert c128_state(spec256, 2, 300).tolist() == [4]  # (299 % 256) // 128 = 0
    online = replace(SPEC, online_c128=True)
    assert c128_state(online, 6, 129).tolist() == [6]


def test_swa_ring_rows_cover_the_window() -> None:
    ring = SPEC.ring_size  # 131
    rows = swa_ring_rows(SPEC, 2, 300)
    assert len(rows) == 128
    expected = 2 * ring + np.arange(172, 300) % ring
    assert rows.tolist() == expected.tolist()
    assert swa_ring_rows(SPEC, 1, 5).tolist() == [131, 132, 133, 134, 135]
    assert swa_ring_rows(SPEC, 1, 0).tolist() == []


def test_swa_window_pages_floor_the_window_start() -> None:
    spec = replace(PAGED_TARGET, page_size=64, sliding_window=128, num_req_slots=8,
                   max_context_len=8192)
    k = spec.swa_pages_per_request
    assert k == 3
    # L = 200: window starts at 72 -> page 1; last page is 3 (tokens 192..199)
    assert swa_window_pages(spec, 2, 200).tolist() == [2 * k + 1 % k, 2 * k + 2 % k, 2 * k + 3 % k]
    assert swa_window_pages(spec, 0, 10).tolist() == [0]
    assert swa_window_pages(spec, 0, 0).tolist() == []


def test_kv_pages_are_the_slots_pages() -> None:
    spec = replace(SPEC, page_size=256)
    assert kv_pages(spec, 3, 600).tolist() == [3 * spec.max_pages_per_req + i for i in range(3)]
    assert kv_pages(spec, 3, 0).tolist() == []


def test_request_indices_validates() -> None:
    with pytest.raises(PlanError, match="request slot 8 out of range"):
        request_indices(SPEC, 8, 10)
    with pytest.raises(PlanError, match="request slot -1 out of range"):
        request_indices(SPEC, -1, 10)
    with pytest.raises(PlanError, match="non-negative"):
        request_indices(SPEC, 0, -5)
    with pytest.raises(PlanError, match="exceeds max_context_len"):
        request_indices(SPEC, 0, 10**9)
    idx = request_indices(SPEC, 1, 129)
    assert set(idx) == set(IndexKind)
    assert idx[IndexKind.REQ_SLOT].tolist() == [1]


def test_fingerprint_is_stable_and_sensitive() -> None:
    a = swa_index_mapping_fingerprint(PAGED_TARGET)
    assert a == swa_index_mapping_fingerprint(replace(PAGED_TARGET, num_req_slots=99))
    assert a != swa_index_mapping_fingerprint(replace(PAGED_TARGET, swa_pages_per_req=5))
    assert a != swa_index_mapping_fingerprint(replace(PAGED_TARGET, page_size=128))
    assert a.startswith("sha256:") and len(a) == len("sha256:") + 16
    u = swa_index_mapping_fingerprint(UNIFIED_TARGET)
    assert u != swa_index_mapping_fingerprint(replace(UNIFIED_TARGET, swa_ring_size=140))
