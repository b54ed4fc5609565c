"""``kv_skip`` (leading KV pages decode holds) checked on both sides, without daemons."""

from __future__ import annotations

from typing import cast

import pytest

from kvbeam.errors import BadKvSkip
from kvbeam.pools.engine_indices import check_kv_skip
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.paged import paged_side_config, paged_spec
from kvbeam.rpc_errors import code_for
from kvbeam.server.core.ports import WriteGrant
from kvbeam.states import FailureReason, TransferState
from tests.core_fakes import FakeLink, slot_lists, wait_for
from tests.fixtures import UNIFIED_TARGET, layout
from tests.unit.test_core_offers import ADDR, SEQ, _connected

PAGED = paged_spec(num_layers=2, block_size=16, num_kv_heads=1, head_size=8, dtype="float16",
                   inner_layout="LBHNC", num_blocks=64)
PAGED_LAYOUT = build_side_layout(paged_side_config("m", PAGED))


def _refused(spec: object, lay: object, kv_skip: int, seq_len: int = 100,
             lists: bool = True) -> str:
    with pytest.raises(BadKvSkip) as info:
        check_kv_skip("decode", spec, lay, kv_skip, seq_len, lists=lists)  # type: ignore[arg-type]
    assert info.value.field == "kv_skip"  # the engine channel's ERROR names it
    assert code_for(info.value).name == "INVALID_ARGUMENT"
    return str(info.value)


def test_kv_skip_on_a_paged_layout_leaves_the_pages_after_it() -> None:
    assert check_kv_skip("decode", PAGED, PAGED_LAYOUT, 0, 100, lists=False) is None
    assert check_kv_skip("decode", PAGED, PAGED_LAYOUT, 6, 100, lists=True) == 1


def test_every_kv_skip_without_a_meaning_is_refused_naming_the_values() -> None:
    assert "kv_skip -1: a count of leading KV pages, not negative" in _refused(
        PAGED, PAGED_LAYOUT, -1)
    assert "kv_skip 7 leaves no KV page of the request's 7 (100 tokens, 16 per page)" in \
        _refused(PAGED, PAGED_LAYOUT, 7)
    assert "at most 6" in _refused(PAGED, PAGED_LAYOUT, 9)
    assert "kv_skip 2 needs the engine's index lists" in _refused(PAGED, PAGED_LAYOUT, 2,
                                                                  lists=False)
    dsv4 = _refused(UNIFIED_TARGET, layout(), 2, seq_len=700)  # states, rings, a draft
    assert "kv_skip 2 is only for a layout of KV pages alone; this one has " in dsv4
    assert "SWA_RING_ROWS" in dsv4 and "REQ_SLOT" in dsv4 and "a draft pool" in dsv4


def test_prefill_refuses_a_peers_kv_skip_that_its_source_cannot_have() -> None:
    """Decode's grant is untrusted: a kv_skip on prefill's DSV4 request (its layout has
    states, rings and a draft) fails it (invalid_request, naming the grant) before any
    write is posted."""
    core, _fake, conn, _events = _connected()
    grant = WriteGrant(41, request_indices(UNIFIED_TARGET, 2, SEQ), kv_skip=3)
    assert core.offer("bad", conn.instance_id, SEQ, grant, lease_s=10.0)
    core.send("bad", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    assert wait_for(lambda: core.status("bad").state is TransferState.FAILED)
    snap = core.status("bad")
    assert snap.reason is FailureReason.INVALID_REQUEST
    assert snap.detail.startswith("decode's grant: prefill: kv_skip 3 is only for a layout "
                                  "of KV pages alone"), snap.detail
    assert len(cast(FakeLink, conn.link).writes) == 2  # only the first request's (and record)
