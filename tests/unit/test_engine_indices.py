"""Engine-chosen index lists: every refusal names the side, kind and first bad index."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbeam.errors import BadIndexList, BadRequest
from kvbeam.pools.engine_indices import split_mapping, validate
from kvbeam.pools.indices import expected_lengths, request_indices
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.types import IndexKind
from kvbeam.rpc_errors import code_for
from tests.engine_lists import kind_items, random_lists
from tests.fixtures import PAGED_DRAFT, PAGED_TARGET, UNIFIED_TARGET, layout, side

K = IndexKind
SEQ = 700
C128_TARGET = replace(UNIFIED_TARGET, compression_ratios=(0, 4, 128, 0))


def _ok(seed: int = 0, seq_len: int = SEQ) -> dict[IndexKind, np.ndarray]:
    return random_lists(UNIFIED_TARGET, layout(), seq_len, np.random.default_rng(seed))


def _refused(target: dict[IndexKind, np.ndarray],
             draft: dict[IndexKind, np.ndarray] | None = None, *,
             lay: object = None, spec: object = UNIFIED_TARGET, seq_len: int = SEQ,
             side_name: str = "decode", **kw: object) -> BadIndexList:
    with pytest.raises(BadIndexList) as info:
        validate(side_name, spec, lay or layout(), target, draft or {}, seq_len, **kw)  # type: ignore[arg-type]
    return info.value


def test_valid_lists_come_back_with_every_kind() -> None:
    lists = _ok()
    target, draft = validate("decode", UNIFIED_TARGET, layout(), lists, {}, SEQ)
    assert set(target) == set(IndexKind) and draft == {}
    assert len(target[K.SWA_PAGES]) == 0  # unified: no SWA pages, an empty list on the wire
    assert all(np.array_equal(target[k], v) for k, v in lists.items())


def test_slot_based_lists_are_valid_engine_lists() -> None:
    lists = {k: v for k, v in request_indices(UNIFIED_TARGET, 3, SEQ).items()
             if k in kind_items(layout())}
    validate("prefill", UNIFIED_TARGET, layout(), lists, {}, SEQ)


def test_out_of_range_names_side_kind_position_and_the_pool_size() -> None:
    lists = _ok()
    pages = kind_items(layout())[K.KV_PAGES]
    lists[K.KV_PAGES][1] = pages + 1
    lists[K.KV_PAGES][2] = pages + 5
    exc = _refused(lists)
    assert str(exc) == (f"decode: KV_PAGES index {pages + 1} at position 1 is out of range: "
                        f"the pool has {pages} pages (valid 0..{pages - 1})")
    assert (exc.side, exc.kind, exc.pool, exc.position, exc.index) == (
        "decode", "KV_PAGES", "target", 1, pages + 1)
    assert isinstance(exc, BadRequest) and code_for(exc).name == "INVALID_ARGUMENT"


def test_negative_index_is_out_of_range() -> None:
    lists = _ok()
    lists[K.SWA_RING_ROWS][7] = -1
    assert "SWA_RING_ROWS index -1 at position 7 is out of range" in str(_refused(lists))


def test_duplicate_names_both_positions() -> None:
    lists = _ok()
    lists[K.SWA_RING_ROWS][9] = lists[K.SWA_RING_ROWS][4]
    exc = _refused(lists, side_name="prefill")
    assert re.fullmatch(r"prefill: SWA_RING_ROWS index \d+ at position 9 repeats position 4",
                        str(exc))
    assert exc.position == 9


@pytest.mark.parametrize("kind", [K.KV_PAGES, K.SWA_RING_ROWS, K.REQ_SLOT])
def test_wrong_length_is_refused(kind: IndexKind) -> None:
    lists = _ok()
    lists[kind] = np.append(lists[kind], 0)
    want = expected_lengths(UNIFIED_TARGET, SEQ)[kind]
    assert f"decode: {kind.value} has {want + 1} indices; {SEQ} tokens need {want}" in str(
        _refused(lists))


def test_decode_page_lists_may_be_shorter_only_when_allowed() -> None:
    lists = _ok()
    lists[K.KV_PAGES] = lists[K.KV_PAGES][1:]
    exc = _refused(lists, shorter_why="the integrity check off")
    assert "(a shorter KV_PAGES list needs the integrity check off)" in str(exc)
    validate("decode", UNIFIED_TARGET, layout(), lists, {}, SEQ, shorter_pages=True)
    exact = _ok()
    exact[K.SWA_RING_ROWS] = exact[K.SWA_RING_ROWS][1:]  # an EXACT_MATCH kind: never shorter
    assert "SWA_RING_ROWS has" in str(_refused(exact, shorter_pages=True))


def test_unknown_kind_and_pool_are_refused() -> None:
    with pytest.raises(BadIndexList, match="unknown index kind 'KV_PAGE'"):
        split_mapping({"KV_PAGE": [1]})
    with pytest.raises(BadIndexList, match="unknown pool 'drafts'"):
        split_mapping({"drafts.KV_PAGES": [1]})
    target, draft = split_mapping({"KV_PAGES": [3, 1], "draft.SWA_RING_ROWS": np.arange(2)})
    assert target[K.KV_PAGES].tolist() == [3, 1] and list(draft) == [K.SWA_RING_ROWS]
    with pytest.raises(BadIndexList, match="a flat list of integers"):
        split_mapping({"KV_PAGES": [1.5]})  # type: ignore[list-item]


def test_kind_absent_from_the_layout_is_refused() -> None:
    paged = build_side_layout(side(PAGED_TARGET, PAGED_DRAFT))
    lists = random_lists(PAGED_TARGET, paged, SEQ, np.random.default_rng(1))
    lists[K.SWA_RING_ROWS] = np.arange(len(_ok()[K.SWA_RING_ROWS]))
    exc = _refused(lists, lay=paged, spec=PAGED_TARGET)
    assert "decode: this layout has no SWA_RING_ROWS buffers" in str(exc)
    assert exc.kind == "SWA_RING_ROWS"


def test_missing_kinds_are_named() -> None:
    lists = _ok()
    del lists[K.REQ_SLOT], lists[K.SWA_RING_ROWS]
    assert "index lists missing for SWA_RING_ROWS, REQ_SLOT" in str(_refused(lists))


def test_draft_lists_need_a_draft_of_that_kind() -> None:
    no_draft = layout(draft=None)
    lists = random_lists(UNIFIED_TARGET, no_draft, SEQ, np.random.default_rng(2))
    exc = _refused(lists, {K.SWA_RING_ROWS: np.arange(128)}, lay=no_draft)
    assert "draft SWA_RING_ROWS list given, but this side has no draft pool" in str(exc)
    assert exc.pool == "draft"
    exc = _refused(_ok(), {K.KV_PAGES: np.arange(3)})
    assert "the draft pool has no KV_PAGES buffers" in str(exc)


def test_draft_list_is_checked_against_the_draft_buffers() -> None:
    lay = layout()
    draft = random_lists(UNIFIED_TARGET, lay, SEQ, np.random.default_rng(3), pool="draft")
    _target, out = validate("decode", UNIFIED_TARGET, lay, _ok(), draft, SEQ)
    assert np.array_equal(out[K.SWA_RING_ROWS], draft[K.SWA_RING_ROWS])
    rows = kind_items(lay, "draft")[K.SWA_RING_ROWS]
    draft[K.SWA_RING_ROWS][0] = rows
    exc = _refused(_ok(), draft)
    assert str(exc).startswith(f"decode: draft SWA_RING_ROWS index {rows} at position 0 is out "
                               f"of range: the pool has {rows} ring rows")


def test_c128_state_is_empty_on_a_group_boundary() -> None:
    lay = layout(C128_TARGET)
    lists = random_lists(C128_TARGET, lay, 512, np.random.default_rng(4))
    assert len(lists[K.C128_STATE]) == 0
    validate("decode", C128_TARGET, lay, lists, {}, 512)
    lists[K.C128_STATE] = np.array([0], dtype=np.int64)
    assert "C128_STATE has 1 indices; 512 tokens need 0" in str(
        _refused(lists, lay=lay, spec=C128_TARGET, seq_len=512))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), seq_len=st.integers(1, 2048), data=st.data())
def test_the_first_bad_position_is_named(seed: int, seq_len: int, data: st.DataObject) -> None:
    lists = _ok(seed, seq_len)
    kinds = [k for k, v in lists.items() if len(v)]
    kind = data.draw(st.sampled_from(kinds))
    arr = lists[kind]
    items = kind_items(layout())[kind]
    bad = sorted(data.draw(st.sets(st.integers(0, len(arr) - 1), min_size=1, max_size=3)))
    dup = data.draw(st.booleans()) and len(arr) > 1 and bad[0] > 0
    for p in bad:
        arr[p] = arr[0] if dup else items + p
    exc = _refused(lists, seq_len=seq_len)
    assert (exc.kind, exc.position) == (kind.value, bad[0])
    assert f"index {int(arr[bad[0]])} at position {bad[0]} " in str(exc)


def test_a_long_request_validates_without_a_python_loop_per_index() -> None:
    big = replace(UNIFIED_TARGET, page_size=64, max_context_len=1 << 17, num_req_slots=4)
    lay = layout(big, draft=None)
    lists = random_lists(big, lay, 1 << 17, np.random.default_rng(5))
    assert len(lists[K.KV_PAGES]) == 2048
    # Counted, not timed: the Python calls a validation makes do not grow with the list
    # (a short request's and this one's differ by a few, not by thousands).
    short = random_lists(big, lay, 1 << 15, np.random.default_rng(5))  # 512 pages
    runs: list[Callable[[], object]] = [
        lambda: validate("decode", big, lay, lists, {}, 1 << 17),
        lambda: validate("decode", big, lay, short, {}, 1 << 15)]
    for run in runs:
        run()  # the layout's expected lengths are cached on first use
    assert _python_calls(runs[0]) <= _python_calls(runs[1]) + 20


def _python_calls(fn: Callable[[], object]) -> int:
    """Python-level function calls (and calls into C functions) made by ``fn()``."""
    calls = 0

    def count(_frame: object, event: str, _arg: object) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_wire_lists_round_trip_with_the_draft_pool() -> None:
    from kvbeam.errors import ProtocolError
    from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
    from kvbeam.proto.transfer_codec import (
        grant_indices_from_proto,
        index_lists_from_proto,
        indices_to_proto,
    )

    target = request_indices(UNIFIED_TARGET, 1, SEQ)
    draft = {K.SWA_RING_ROWS: np.array([5, 3, 9], dtype=np.int64)}
    wire = indices_to_proto(target, draft)
    kv = pb.INDEX_KIND_KV_PAGES
    assert [m.pool for m in wire][-1] == "draft"
    got, got_draft = grant_indices_from_proto(wire, "indices")
    assert all(np.array_equal(got[k], target[k]) for k in IndexKind)
    assert got_draft[K.SWA_RING_ROWS].tolist() == [5, 3, 9]
    negative = indices_to_proto(target, {K.SWA_RING_ROWS: np.array([5, -3], dtype=np.int64)})
    with pytest.raises(ProtocolError, match=r"indices\[draft.SWA_RING_ROWS\].indices"):
        grant_indices_from_proto(negative, "indices")
    with pytest.raises(ProtocolError, match="index kinds missing"):
        grant_indices_from_proto(wire[1:], "indices")
    with pytest.raises(ProtocolError, match="unknown pool 'drafty'"):
        index_lists_from_proto([pb.IndexList(kind=kv, indices=[1], pool="drafty")], "indices")
    with pytest.raises(ProtocolError, match=r"SWA_RING_ROWS appears twice \(draft\)"):
        index_lists_from_proto([*wire, wire[-1]], "indices")
    t, d = index_lists_from_proto([pb.IndexList(kind=kv, indices=[7], pool="target")], "x")
    assert t[K.KV_PAGES].tolist() == [7] and d == {}


def test_packed_wire_lists_read_as_the_repeated_ones() -> None:
    """What the daemons send each other (protocol 7): the same lists, packed."""
    from kvbeam.errors import ProtocolError
    from kvbeam.proto.kvbeam.v1 import kvbeam_pb2 as pb
    from kvbeam.proto.transfer_codec import grant_indices_from_proto, indices_to_proto

    target = request_indices(UNIFIED_TARGET, 1, SEQ)
    draft = {K.SWA_RING_ROWS: np.array([5, 3, 1 << 40], dtype=np.int64)}
    packed = indices_to_proto(target, draft, packed=True)
    assert all(m.packed and not m.indices for m in packed)
    assert packed[0].packed[:8] == int(target[K.KV_PAGES][0]).to_bytes(8, "little")
    for wire in (packed, indices_to_proto(target, draft)):
        got, got_draft = grant_indices_from_proto(wire, "indices")
        assert all(np.array_equal(got[k], target[k]) for k in IndexKind)
        assert got_draft[K.SWA_RING_ROWS].tolist() == [5, 3, 1 << 40]
        got[K.KV_PAGES][0] = 99  # the lists are the reader's own (writable) arrays
    kv = pb.INDEX_KIND_KV_PAGES
    both = pb.IndexList(kind=kv, indices=[1], packed=(1).to_bytes(8, "little"))
    with pytest.raises(ProtocolError, match=r"indices\[0\]: sets both indices and packed"):
        _read_lists([both])
    torn = pb.IndexList(kind=kv, packed=b"\x01" * 12)
    with pytest.raises(ProtocolError,
                       match=r"indices\[0\].packed: 12 bytes is not a whole number"):
        _read_lists([torn])
    negative = indices_to_proto(target, {K.SWA_RING_ROWS: np.array([-2], dtype=np.int64)},
                                packed=True)
    with pytest.raises(ProtocolError, match=r"indices\[draft.SWA_RING_ROWS\].indices"):
        grant_indices_from_proto(negative, "indices")


def _read_lists(lists: list[Any]) -> object:
    from kvbeam.proto.transfer_codec import index_lists_from_proto

    return index_lists_from_proto(lists, "indices")
