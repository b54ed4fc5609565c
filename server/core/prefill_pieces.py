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
once the tokens in it are computed (sglang's chunks end on a page boundary). A refusal
is a :class:`~kvbeam.errors.FrameError` naming the field (``kv_offset``, ``lists``) or
a :class:`~kvbeam.errors.BadIndexList` naming the page; nothing is recorded then. Pure
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

    def _refuse(self, field: str, problem: str) -> FrameError:
        return FrameError(field, f"request {self.request_id}: {problem}", self.request_id)

    def add(self, kv_offset: int, final: bool,
            indices: Mapping[IndexKind, ListLike], draft: Mapping[IndexKind, ListLike]
            ) -> tuple[IndexLists, IndexLists] | None:
        """Check and record one frame's piece; the whole (target, draft) lists once the
        final frame completed them, else None. Nothing is recorded when it is refused."""
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
        given = self.given + len(piece)
        if given > len(self.kv_pages):
            raise self._refuse("lists", (
                f"KV_PAGES: {given} pages given, {self.seq_len} tokens need "
                f"{len(self.kv_pages)}"))
        assembled = np.concatenate([self.kv_pages[:self.given], piece])
        validate_prefix("prefill", self.spec, self.layout, IndexKind.KV_PAGES, assembled,
                        self.seq_len)
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
        return whole
