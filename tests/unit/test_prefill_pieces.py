"""A prefill request whose source lists come a piece per chunk (SEND with kv_offset)."""

from __future__ import annotations

import numpy as np
import pytest

from kvbeam.errors import BadIndexList, FrameError
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.chunks import Chunk
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


def test_pieces_by_layer_make_their_pages_ready_in_those_layers_then_in_every_one() -> None:
    p, lists = _start()
    layers = p.layout.num_layers
    assert p.add(0, False, _kv(lists, 0, 2), {}, layers=1) is None
    assert p.ready == Chunk(0, 2, 1, False)
    p.add(2, False, {}, {}, layers=3)  # more layers of the same pages
    assert p.ready == Chunk(0, 2, 3, False)
    p.add(2, False, {}, {}, layers=layers)  # every layer: the pages are whole
    assert p.ready == Chunk(2, 2, 0, False)
    p.add(2, False, _kv(lists, 2, 3), {}, layers=2)  # the next chunk's page, layer by layer
    assert p.ready == Chunk(2, 3, 2, False)
    rest = {k: v for k, v in lists.items() if k is not KV}
    assert p.add(3, True, rest, {}) is not None


@pytest.mark.parametrize(("case", "words"), [
    ("too many", "5 layers named, the model has 4"),
    ("fewer", "pages [0, 1) are ready in 3 layers already, this piece names 2: layers "
              "only grow"),
    ("pages while partial", "pages [0, 1) are ready in layers [0, 3) only: a piece adds "
                            "pages once those before it are ready in every layer"),
])
def test_a_bad_piece_by_layer_is_refused_naming_layers_and_nothing_is_recorded(
        case: str, words: str) -> None:
    p, lists = _start()
    p.add(0, False, _kv(lists, 0, 1), {}, layers=3)
    bad = {"too many": (1, False, {}, 5), "fewer": (1, False, {}, 2),
           "pages while partial": (1, False, _kv(lists, 1, 2), 3)}[case]
    offset, final, piece, layers = bad
    with pytest.raises(FrameError) as err:
        p.add(offset, final, piece, {}, layers=layers)
    assert err.value.field == "layers" and words in str(err.value), str(err.value)
    assert p.ready == Chunk(0, 1, 3, False) and p.given == 1
