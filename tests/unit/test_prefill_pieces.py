"""A prefill request whose source lists come a piece per chunk (SEND with kv_offset)."""

from __future__ import annotations

import numpy as np
import pytest

from kvbeam.errors import BadIndexList, FrameError
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.prefill_pieces import Pieces
from tests.engine_lists import random_lists
from tests.fixtures import side

SEQ = 700  # three 256-token pages
KV = IndexKind.KV_PAGES


def _start() -> tuple[Pieces, dict[IndexKind, np.ndarray]]:
    config = side()
    layout = build_side_layout(config)
    lists = random_lists(config.target, layout, SEQ, np.random.default_rng(3))
    return Pieces("r", config.target, layout, SEQ), lists


def _kv(lists: dict[IndexKind, np.ndarray], a: int, b: int) -> dict[IndexKind, np.ndarray]:
    return {KV: lists[KV][a:b]}


def test_pieces_in_order_give_the_whole_lists_at_the_final_frame() -> None:
    p, lists = _start()
    assert p.add(0, False, _kv(lists, 0, 1), {}) is None
    assert p.add(1, False, _kv(lists, 1, 2), {}) is None
    assert p.given == 2 and list(p.kv_pages[:2]) == list(lists[KV][:2]) and p.kv_pages[2] == -1
    rest = {**{k: v for k, v in lists.items() if k is not KV}, KV: lists[KV][2:]}
    whole = p.add(2, True, rest, {})
    assert whole is not None
    assert all(np.array_equal(whole[0][k], v) for k, v in lists.items())


@pytest.mark.parametrize(("case", "field", "words"), [
    ("gap", "kv_offset", "continue at position 1, this piece starts at 2"),
    ("repeat", "kv_offset", "continue at position 1, this piece starts at 0"),
    ("states", "lists", "a non-final piece carries target KV_PAGES only, not REQ_SLOT"),
    ("too many", "lists", "KV_PAGES: 4 pages given, 700 tokens need 3"),
    ("short final", "lists", "the final frame leaves KV_PAGES at 2 of the 3 pages"),
])
def test_a_bad_piece_is_refused_naming_the_field_and_nothing_is_recorded(
        case: str, field: str, words: str) -> None:
    p, lists = _start()
    p.add(0, False, _kv(lists, 0, 1), {})
    rest = {k: v for k, v in lists.items() if k is not KV}
    bad = {
        "gap": (2, True, {**rest, KV: lists[KV][2:]}),
        "repeat": (0, False, _kv(lists, 0, 1)),
        "states": (1, False, {**_kv(lists, 1, 2),
                                            IndexKind.REQ_SLOT: lists[IndexKind.REQ_SLOT]}),
        "too many": (1, False, {KV: np.array([7, 8, 9])}),
        "short final": (1, True, {**rest, KV: lists[KV][1:2]}),
    }[case]
    with pytest.raises(FrameError) as info:
        p.add(*bad, {})
    assert info.value.field == field and words in str(info.value), str(info.value)
    assert p.given == 1  # nothing recorded


def test_a_page_out_of_range_or_repeated_across_pieces_is_refused() -> None:
    p, lists = _start()
    p.add(0, False, _kv(lists, 0, 1), {})
    with pytest.raises(BadIndexList, match="repeats position 0"):
        p.add(1, False, {KV: lists[KV][0:1]}, {})
    with pytest.raises(BadIndexList, match="out of range"):
        p.add(1, False, {KV: np.array([1 << 30])}, {})
    assert p.given == 1
