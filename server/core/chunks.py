"""What a chunk of a prefill request makes ready, and what of it is left to write.

One chunk protocol (docs/protocol.md): every chunk of a request says which of its KV
pages are ready, as positions of the request's KV_PAGES list, so the core writes what
became ready since the last chunk. An engine that sends each layer as it computes it
(the engine channel's LAYERS) makes pages ready in some layers first: readiness is
then a staircase over the pages, ``[0, full)`` in every layer and ``[full, to)`` in
the model's layers ``[0, layers)``; a chunk ready in every layer has ``full == to``.

A staircase of two steps is all an engine needs: a layer-by-layer engine completes a
chunk's layers before it adds the next chunk's pages (the engine channel refuses a
piece that adds pages while earlier ones are ready in some layers only,
:class:`~kvbeam.server.core.prefill_pieces.Pieces`). What an attempt wrote is such a
staircase too, so what a chunk writes is the difference of two: at most three
rectangles of pages by layers (:func:`unwritten`). Pure functions on plain data.
"""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple


class Chunk(NamedTuple):
    """A chunk of a request: the KV pages it makes ready and whether it is the final
    one (which makes every page ready in every layer, and sends the other lists)."""

    full: int  # pages [0, full) are ready in every layer
    to: int  # pages [full, to) are ready in layers [0, layers)
    layers: int
    final: bool

    @staticmethod
    def whole(pages_to: int, final: bool) -> Chunk:
        """A chunk whose pages ``[0, pages_to)`` are ready in every layer."""
        return Chunk(pages_to, pages_to, 0, final)

    def layers_at(self, page: int, num_layers: int) -> int:
        """How many of the model's layers (from the first) page ``page`` is ready in."""
        if page < self.full:
            return num_layers
        return self.layers if page < self.to else 0

    def whole_layers(self, pages: int, num_layers: int) -> int:
        """How many of the model's layers (from the first) every one of the request's
        ``pages`` KV pages is ready in: the layers whose KV buffers hold all of it."""
        if self.final or pages == 0:
            return num_layers
        return self.layers_at(pages - 1, num_layers)

    def adds_to(self, before: Chunk) -> bool:
        """Whether this chunk makes ready anything ``before`` did not (a chunk that
        does not is nothing to write)."""
        if self.full > before.full:
            return True
        # Pages [self.full, self.to) at self.layers: those below before.full are ready
        # already; the rest need before's partial step to reach as far and as high.
        return self.to > before.full and (self.to > before.to or self.layers > before.layers)


#: Nothing written yet.
NOTHING = Chunk(0, 0, 0, False)

#: Pages ``[lo, hi)`` in the model's layers ``[first, last)``: a rectangle to write.
Rect = tuple[int, int, int, int]


def unwritten(written: Chunk, ready: Chunk, *, skip: int, num_layers: int) -> list[Rect]:
    """What of ``ready`` is not in ``written``, from page ``skip`` on (pages below it
    are held by decode: its prefix cache), as rectangles of pages by layers in page
    order, adjacent ones with the same layers merged."""
    cuts = sorted({p for p in (skip, written.full, written.to, ready.full, ready.to)
                   if p >= skip})
    out: list[Rect] = []
    for lo, hi in pairwise(cuts):
        first = written.layers_at(lo, num_layers)
        last = ready.layers_at(lo, num_layers)
        if last <= first:
            continue
        if out and out[-1][1] == lo and out[-1][2:] == (first, last):
            out[-1] = (out[-1][0], hi, first, last)
        else:
            out.append((lo, hi, first, last))
    return out
