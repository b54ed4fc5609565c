"""What a chunk makes ready and what of it is left to write (server/core/chunks.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from kvbeam.server.core.chunks import NOTHING, Chunk, unwritten

LAYERS = 4


def _cells(rects: list[tuple[int, int, int, int]]) -> set[tuple[int, int]]:
    """The (page, layer) cells the rectangles cover; each cell at most once."""
    out: set[tuple[int, int]] = set()
    for lo, hi, first, last in rects:
        for cell in itertools.product(range(lo, hi), range(first, last)):
            assert cell not in out, f"{cell} written twice"
            out.add(cell)
    return out


def _ready(chunk: Chunk, pages: int) -> set[tuple[int, int]]:
    return {(p, layer) for p in range(pages) for layer in range(chunk.layers_at(p, LAYERS))}


def test_a_whole_chunk_after_nothing_is_one_rectangle_of_every_layer() -> None:
    assert unwritten(NOTHING, Chunk.whole(5, True), skip=0, num_layers=LAYERS) == [
        (0, 5, 0, LAYERS)]


def test_layers_of_the_same_pages_write_only_the_new_layers() -> None:
    assert unwritten(Chunk(0, 5, 1, False), Chunk(0, 5, 3, False), skip=0,
                     num_layers=LAYERS) == [(0, 5, 1, 3)]


def test_the_next_chunk_completes_the_last_ones_layers_and_starts_its_own() -> None:
    """Pages [2, 5) were written in 3 layers; now they are whole and pages [5, 7) are
    ready in 1: the rest of the first chunk's layers, then the new pages' first."""
    assert unwritten(Chunk(2, 5, 3, False), Chunk(5, 7, 1, False), skip=0,
                     num_layers=LAYERS) == [(2, 5, 3, 4), (5, 7, 0, 1)]


def test_pages_decode_holds_are_never_written() -> None:
    assert unwritten(NOTHING, Chunk(0, 6, 2, False), skip=4, num_layers=LAYERS) == [
        (4, 6, 0, 2)]
    assert unwritten(NOTHING, Chunk.whole(3, False), skip=4, num_layers=LAYERS) == []


def test_nothing_new_is_nothing_to_write() -> None:
    assert unwritten(Chunk(0, 5, 3, False), Chunk(0, 5, 2, False), skip=0,
                     num_layers=LAYERS) == []


@pytest.mark.parametrize("seed", range(40))
def test_every_cell_is_written_once_whatever_the_staircases(seed: int) -> None:
    """Random staircases in order (as the engine channel admits them): the rectangles of
    each step are exactly the cells newly ready, and together every cell once."""
    rng = random.Random(seed)
    pages = rng.randint(1, 9)
    skip = rng.randint(0, pages)
    steps, full, to, layers = [], 0, 0, 0
    while full < pages:
        if full < to:  # more layers of the partial pages (perhaps all of them)
            layers = rng.randint(layers + 1, LAYERS)
        else:  # the next chunk's pages, ready in some layers (perhaps all)
            to = rng.randint(to + 1, pages)
            layers = rng.randint(1, LAYERS)
        if layers == LAYERS:
            full, layers = to, 0
        steps.append(Chunk(full, to, layers, False))
    written, done = NOTHING, set[tuple[int, int]]()
    for chunk in steps:
        cells = _cells(unwritten(written, chunk, skip=skip, num_layers=LAYERS))
        want = {c for c in _ready(chunk, pages) if c[0] >= skip} - done
        assert cells == want, (written, chunk)
        done |= cells
        written = chunk
    assert done == {(p, layer) for p in range(skip, pages) for layer in range(LAYERS)}


def test_a_chunk_adds_to_another_only_with_a_cell_the_other_lacks() -> None:
    for a, b in itertools.product(
            [Chunk(f, t, lay, False) for f in range(4) for t in range(f, 4)
             for lay in (range(1, LAYERS) if f < t else (0,))], repeat=2):
        new = _ready(a, 4) - _ready(b, 4)
        assert a.adds_to(b) == bool(new), (a, b)
