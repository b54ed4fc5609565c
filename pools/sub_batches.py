"""Sub-batches: a large request's landing verified while the rest flies.

Decode advertises a sub-batch size in its handshake (``--verify-sub-batch-mib``,
endpoint ``extra[kvbeam-sub-batch]``, bytes). When prefill writes a request with
integrity on and the request moves at least two sub-batches, it cuts the writes at
flat-buffer boundaries (:func:`cuts`): in every chunk, each sub-batch's blocks
(:func:`part_blocks`) go under a transfer id that is the grant's plus the sub-batch's
number (:func:`mark_id`), and the chunk that makes a sub-batch whole
(:func:`complete_parts`: the final one, or a piece whose layers cover all of its KV
buffers) notifies that id: the notification ("mark") proves the sub-batch's bytes
landed, so decode digests its buffers at once, on its digest pool, while the later
sub-batches (or layers) are still on the wire or being computed. The last part goes
with the digest record and the grant's own transfer id, as without sub-batches; the
record says how many marks came before it, and decode's Success waits for every mark's
digests and the last part's. A request under two sub-batches has no marks (the record
says 0) and is digested whole once it landed.

Both sides compute the same cuts from the same numbers: decode's sub-batch size and
the bytes each of decode's buffers receives (prefill: its plan's blocks per buffer;
decode: the items its lists name, times the bytes each moves). Decode's transfer ids
are multiples of ``1 << MARK_BITS``, so a mark's id never names another request. All
pure: no I/O, no lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbeam.errors import ProtocolError
from kvbeam.pools.layout import LayoutCache, SideLayout
from kvbeam.pools.plan import IndexLists, TransferPlan, list_for, own_draft_list
from kvbeam.pools.types import IndexKind
from kvbeam.transport.blocks import Blocks

#: Low bits of a transfer id that number a request's marks (decode's ids leave them 0).
MARK_BITS = 4
#: The most marks (sub-batches before the last part) a request has.
MAX_MARKS = (1 << MARK_BITS) - 1
#: The endpoint ``extra`` key decode advertises its sub-batch size under (bytes).
SUB_BATCH_KEY = "kvbeam-sub-batch"
#: The smallest sub-batch a decode may advertise: below it a mark costs more than the
#: overlap it buys (a notified write, a pool task), and tests use sizes this small.
MIN_SUB_BATCH_BYTES = 64 << 10
#: The largest accepted (a typo of units, not a real size, above it).
MAX_SUB_BATCH_BYTES = 1 << 40


def buffer_bytes(layout: SideLayout, indices: IndexLists,
                 draft: IndexLists | None = None) -> list[int]:
    """The bytes each of decode's buffers receives, in flat order: the items of its list
    (the draft's own, where it has one) times its item length. Decode computes it from
    its own layout and lists, prefill from decode's layout and the grant's lists: the
    same numbers, so the same :func:`cuts`."""
    lists, key_of, item_len = _template(layout, draft)
    counts = [len(list_for(indices, draft, pool, kind)) for kind, pool in lists]
    return [counts[k] * n for k, n in zip(key_of, item_len, strict=True)]


_Template = tuple[list[tuple[IndexKind, str]], list[int], list[int]]
_TEMPLATES: LayoutCache[_Template] = LayoutCache()


def _template(layout: SideLayout, draft: IndexLists | None) -> _Template:
    """A layout's lists (kind, pool: each list counted once), each flat buffer's list
    and item length; per layout and the kinds the draft has its own list of, so a
    request only counts its lists."""
    return _TEMPLATES.get(layout, None if draft is None else frozenset(draft),
                          lambda: _build_template(layout, draft))


def _build_template(layout: SideLayout, draft: IndexLists | None) -> _Template:
    lists: dict[tuple[IndexKind, bool], tuple[int, str]] = {}
    key_of: list[int] = []
    item_len: list[int] = []
    for c in layout.components:
        for b in c.buffers:
            own = own_draft_list(draft, c.pool, b.index_kind)
            entry = lists.setdefault((b.index_kind, own), (len(lists), c.pool))
            key_of.append(entry[0])
            item_len.append(b.item_len)
    return [(kind, pool) for (kind, _), (_, pool) in lists.items()], key_of, item_len


def cuts(per_buffer: Sequence[int], sub_batch_bytes: int) -> tuple[int, ...]:
    """Where a request's marked sub-batches end: flat-buffer positions, ascending.

    Sub-batch ``k`` (1-based) is buffers ``[cuts[k-2], cuts[k-1])`` (from 0 for the
    first); the last part, with the record, is ``[cuts[-1], n)``. Empty when
    ``sub_batch_bytes`` is 0 or the request moves less than two sub-batches. A
    sub-batch ends at the first buffer that brings it to ``sub_batch_bytes`` (or to
    the request's bytes over ``MAX_MARKS + 1``, when that is larger, so a huge
    request still has at most ``MAX_MARKS`` marks); the last buffer always goes
    with the last part.
    """
    total = sum(per_buffer)
    if sub_batch_bytes <= 0 or total < 2 * sub_batch_bytes or len(per_buffer) < 2:
        return ()
    size = max(sub_batch_bytes, -(-total // (MAX_MARKS + 1)))
    out: list[int] = []
    acc = 0
    for i, nbytes in enumerate(per_buffer[:-1]):
        acc += nbytes
        if acc >= size and len(out) < MAX_MARKS:
            out.append(i + 1)
            acc = 0
    return tuple(out)


def bounds(at: Sequence[int], k: int, n: int) -> tuple[int, int]:
    """Buffers ``[lo, hi)`` of sub-batch ``k`` (1-based; ``len(at) + 1``: the last part)."""
    lo = at[k - 2] if k >= 2 else 0
    hi = at[k - 1] if k <= len(at) else n
    return lo, hi


def mark_id(transfer_id: int, k: int) -> int:
    """The transfer id of sub-batch ``k``'s mark (1..MAX_MARKS) of grant ``transfer_id``."""
    if not 1 <= k <= MAX_MARKS or transfer_id & MAX_MARKS:
        raise ValueError(f"mark {k} of transfer id {transfer_id}: marks are 1..{MAX_MARKS} "
                         f"of an id whose low {MARK_BITS} bits are 0")
    return transfer_id | k


def complete_parts(at: Sequence[int], kv_layers: Sequence[int] | None, num_kv: int,
                   layers_done: int, num_layers: int, *, final: bool) -> list[int]:
    """The marked sub-batches (1..``len(at)``) whose every buffer is whole once the
    model's first ``layers_done`` layers of every page are written (or all of it:
    ``final``). The first ``num_kv`` flat buffers are the main KV ones, of layers
    ``kv_layers`` (None: not known, so only ``layers_done == num_layers`` makes them
    whole); a state buffer is whole with the final chunk only, and so is every part
    from the first that holds one."""
    if final:
        return list(range(1, len(at) + 1))
    out = []
    for k, hi in enumerate(at, start=1):
        lo = at[k - 2] if k >= 2 else 0
        if hi > num_kv:
            break
        if layers_done >= num_layers or (kv_layers is not None and layers_done > 0
                                         and max(kv_layers[lo:hi]) < layers_done):
            out.append(k)
    return out


def part_blocks(plans: Sequence[TransferPlan], offsets: Sequence[int],
                at: Sequence[int]) -> list[Blocks]:
    """The plans' blocks cut by sub-batch: ``len(at) + 1`` batches, the last part's
    last. ``offsets``: each component's first flat buffer. A plan's buffers are in
    flat order, so each part's buffers are one run of its blocks."""
    edges = np.asarray(at, dtype=np.int64)
    runs: list[list[Blocks]] = [[] for _ in range(len(at) + 1)]
    for plan in plans:
        if not plan.heads:
            continue
        flat = np.fromiter((offsets[ci] + bi for ci, bi, _name in plan.heads),
                           dtype=np.int64, count=len(plan.heads))
        part = np.searchsorted(edges, flat, side="right")
        first = np.flatnonzero(np.concatenate(([True], part[1:] != part[:-1])))
        ends = np.append(first[1:], len(part))
        starts = plan.starts
        for lo, hi in zip(first.tolist(), ends.tolist(), strict=True):
            runs[int(part[lo])].append(plan.blocks.slice(int(starts[lo]), int(starts[hi])))
    return [r[0] if len(r) == 1 else Blocks.concat(r) for r in runs]


def split_id(transfer_id: int) -> tuple[int, int]:
    """(the grant's transfer id, mark number): mark 0 is the grant's own (the last part)."""
    return transfer_id & ~MAX_MARKS, transfer_id & MAX_MARKS


def parse_sub_batch(text: str) -> int:
    """Decode's advertised sub-batch size (``extra[kvbeam-sub-batch]``); 0 when absent.

    Raises:
        ProtocolError: not a whole number of bytes in range.
    """
    if not text:
        return 0
    field = f"side.endpoint.extra[{SUB_BATCH_KEY}]"
    try:
        value = int(text)
    except ValueError:
        raise ProtocolError(field, f"{text[:40]!r} is not a number of bytes") from None
    if not MIN_SUB_BATCH_BYTES <= value <= MAX_SUB_BATCH_BYTES:
        raise ProtocolError(field, f"{value} bytes, outside {MIN_SUB_BATCH_BYTES}.."
                                   f"{MAX_SUB_BATCH_BYTES}")
    return value
