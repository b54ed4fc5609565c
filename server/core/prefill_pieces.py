"""A prefill request whose source lists arrive in pieces, one per chunk (engine channel).

sglang's prefill hands its backend a request's KV page ids chunk by chunk (chunked
prefill): when the first chunk is ready the later pages are not allocated yet. A
SEND frame with ``kv_offset`` (flag EXTENDS, docs/protocol.md) carries the next piece:
the KV pages its chunk adds, continuing the request's KV_PAGES list at that position;
the final frame carries the last pages and every other list whole. :class:`Pieces`
keeps what came so far and checks each piece before the core queues its chunk:

- pieces in order: ``kv_offset`` is the number of pages given so far (no gap, no
  overlap, no repeat);
- a non-final piece carries target KV_PAGES only (the states and the draft's own
  lists come whole with the final frame), each page in range and none twice in the
  request, no more pages than ``seq_len`` needs;
- the final frame completes KV_PAGES; then the whole lists are validated as a
  request sent in one frame is (:func:`~kvbeam.pools.engine_indices.validate`).

The pages given so far are the pages the chunk makes ready: the engine gives a page
once the tokens in it are computed (sglang's chunks end on a page boundary). A piece
with ``layers`` (flag LAYERS: an engine that sends each layer as it computes it) makes
the pages given so far ready in the model's layers ``[0, layers)`` only: layers only
grow, and a piece adds pages only once those given before are ready in every layer
(what the core writes is then at most a two-step staircase,
:mod:`kvbeam.server.core.chunks`). A refusal
is a :class:`~kvbeam.errors.FrameError` naming the field (``kv_offset``, ``lists``) or
a :class:`~kvbeam.errors.BadIndexList` naming the page (or the field ``layers``);
nothing is recorded then. Pure
bookkeeping, on the daemon's loop.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from kvbeam.errors import FrameError
from kvbeam.pools.engine_indices import ListLike, validate, validate_prefix
from kvbeam.pools.indices import expected_lengths
from kvbeam.pools.layout import SideLayout
from kvbeam.pools.spec import PoolSpec
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.chunks import Chunk
from kvbeam.server.core.ports import IndexLists


class Pieces:
    """What came so far of a request's source lists (see the module docstring).

    ``kv_pages`` is the request's whole KV_PAGES list, -1 where no piece gave it yet;
    the core's record addresses it, and plans only the pages given.
    """

    def __init__(self, request_id: str, spec: PoolSpec, layout: SideLayout,
                 seq_len: int) -> None:
        self.request_id = request_id
        self.spec, self.layout, self.seq_len = spec, layout, seq_len
        total = expected_lengths(spec, seq_len)[IndexKind.KV_PAGES]
        self.kv_pages: npt.NDArray[np.int64] = np.full(total, -1, dtype=np.int64)
        self.given = 0   # pages given so far: the next piece's kv_offset
        self.full = 0    # pages [0, full) are ready in every layer
        self.layers = 0  # pages [full, given) are ready in layers [0, layers)

    @property
    def ready(self) -> Chunk:
        """What the pieces so far make ready (the core's chunk, not final)."""
        return Chunk(self.full, self.given, self.layers if self.full < self.given else 0,
                     False)

    def _refuse(self, field: str, problem: str) -> FrameError:
        return FrameError(field, f"request {self.request_id}: {problem}", self.request_id)

    def add(self, kv_offset: int, final: bool,
            indices: Mapping[IndexKind, ListLike], draft: Mapping[IndexKind, ListLike],
            layers: int | None = None) -> tuple[IndexLists, IndexLists] | None:
        """Check and record one frame's piece (``layers``: the layers its pages so far
        are ready in, None every layer); the whole (target, draft) lists once the final
        frame completed them, else None. Nothing is recorded when it is refused."""
        if kv_offset != self.given:
            raise self._refuse("kv_offset", (
                f"its KV pages continue at position {self.given}, this piece starts at "
                f"{kv_offset}: pieces come in order, without gaps or overlap"))
        others = [k.value for k in indices if k is not IndexKind.KV_PAGES]
        if not final and (others or draft):
            named = others + [f"draft {k.value}" for k in draft]
            raise self._refuse("lists", (
                f"a non-final piece carries target KV_PAGES only, not {', '.join(named)}: "
                "the other lists (and the draft's own) come whole with the final frame"))
        if draft and IndexKind.KV_PAGES in draft:
            raise self._refuse("lists", (
                "a draft KV_PAGES list: a request sent in pieces addresses the draft's KV "
                "with the target's pages"))
        piece = np.asarray(indices.get(IndexKind.KV_PAGES, ()), dtype=np.int64).reshape(-1)
        num_layers = self.layout.num_layers
        ready_in = num_layers if layers is None or final else layers
        self._check_layers(ready_in, num_layers, adds_pages=len(piece) > 0)
        given = self.given + len(piece)
        if given > len(self.kv_pages):
            raise self._refuse("lists", (
                f"KV_PAGES: {given} pages given, {self.seq_len} tokens need "
                f"{len(self.kv_pages)}"))
        assembled = (np.concatenate([self.kv_pages[:self.given], piece]) if len(piece)
                     else self.kv_pages[:self.given])
        if len(piece):  # a piece of more layers only gives no page to check
            validate_prefix("prefill", self.spec, self.layout, IndexKind.KV_PAGES,
                            assembled, self.seq_len)
        whole = None
        if final:
            if given != len(self.kv_pages):
                raise self._refuse("lists", (
                    f"the final frame leaves KV_PAGES at {given} of the "
                    f"{len(self.kv_pages)} pages {self.seq_len} tokens need"))
            whole = validate("prefill", self.spec, self.layout,
                             {**indices, IndexKind.KV_PAGES: assembled}, draft, self.seq_len)
        self.kv_pages[self.given:given] = piece
        self.given = given
        if ready_in == num_layers:
            self.full, self.layers = given, 0
        else:
            self.layers = ready_in
        return whole

    def _check_layers(self, layers: int, num_layers: int, *, adds_pages: bool) -> None:
        """A piece's layers: within the model's, never fewer than before for the same
        pages, and new pages only once those before are ready in every layer."""
        if layers > num_layers:
            raise self._refuse("layers", f"{layers} layers named, the model has {num_layers}")
        partial = self.full < self.given
        if partial and adds_pages and layers < num_layers:
            raise self._refuse("layers", (
                f"pages [{self.full}, {self.given}) are ready in layers [0, {self.layers}) "
                f"only: a piece adds pages once those before it are ready in every layer "
                f"(this one names {layers} of {num_layers})"))
        if partial and layers < self.layers:
            raise self._refuse("layers", (
                f"pages [{self.full}, {self.given}) are ready in {self.layers} layers "
                f"already, this piece names {layers}: layers only grow"))
