"""Integrity digests: XXH3-128 of the items a request moves, per buffer.

Prefill digests the source items it sends, decode the destination items that
landed; equal digest lists prove every byte arrived. ``xxhash``'s XXH3-128 reads
the numpy views of the pool tensors directly. Why XXH3-128 and not CRC32C: a
128-bit digest misses a wrong buffer with probability 2**-128 instead of 2**-32 (at
fleet scale, billions of buffers a day, 2**-32 is not never), and it is as fast or
faster everywhere we measured: 18 GB/s against 14 GB/s on the host, and 480 MB/s
against 65 MB/s in the soft-RoCE guest, whose emulator runs the ``crc32``
instruction bit by bit (docs/performance.md).

An index list that is one ascending run (the usual case: a request's pages
allocated together) is digested in place, with no copy; any other list is
gathered with one vectorised ``take`` per buffer, never a Python loop per item.
Each buffer's 2-D item view is built once per side: the per-buffer numpy/torch
overhead, not the hash, dominated small requests.

Where the compiled helper ``kvbeam.pools._xxh3`` (pools/_xxh3.c, built at install where
Debian's libxxhash-dev is) loads, :func:`digest_many` digests a request's parts in one
call (the GIL released for the digest pool's tasks), streaming each part's items as they
lie in the pool (no gather, no Python per buffer); without it, each part goes through
python-xxhash as above. Both give the same digests (tests/unit/test_digest.py runs
both); the daemon logs which it uses at start (:func:`digester`).

A request's digests are one ``bytes`` object, 16 little-endian bytes per buffer in
layout order: what the helper returns and what the digest record carries
(:mod:`kvbeam.pools.mailbox`), so they are never Python ints one by one, and decode
compares a landing with its record in one comparison. Its parts (:class:`DigestParts`)
come from a template built once per side: per request only the index lists change.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.layout import BufferLayout
from kvbeam.pools.plan import IndexLists, list_for, own_draft_list
from kvbeam.pools.types import IndexKind

#: The digest's name as operators see it (Success details, mismatch errors, docs).
DIGEST_NAME = "XXH3-128"
#: Bytes of one digest (XXH3-128), as the mailbox record carries each.
DIGEST_BYTES = 16
#: A compiled call on fewer bytes keeps the GIL unless told otherwise (:func:`digest_many`).
RELEASE_GIL_BYTES = 1 << 20

#: One buffer's share of a request's digests, as the compiled helper takes it: (the
#: buffer's (items, item_len) view of the pool memory, the items moved in order as
#: C-contiguous int64, item_len, offset, width): the bytes [offset, offset + width) of
#: each item are digested (a TP head window), or all of them (offset 0, width item_len).
Part = tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], int, int, int]


class DigestParts:
    """A request's digest parts, one per selected buffer, in layout order.

    Built from a per-side template (:func:`digest_parts`): per request only the index
    lists change, so building them is one list comprehension, and their digests are one
    compiled call. Reads the pool memory only when digested, so parts can be built under
    no lock and digested on any thread (the digest pool's, :mod:`kvbeam.pools.digest_pool`).
    A slice (``parts[lo:hi]``) is a run of them: a sub-batch's buffers, a pool task's.
    """

    __slots__ = ("_nbytes", "specs")

    def __init__(self, specs: list[Part], nbytes: int | None = None) -> None:
        #: The parts, each as the compiled helper takes it (:data:`Part`).
        self.specs = specs
        self._nbytes = nbytes

    @classmethod
    def of(cls, parts: Sequence[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any],
                                      tuple[int, int] | None]]) -> DigestParts:
        """Parts from (items, idx, window) triples: ``window`` (offset, width) of each item,
        or None for whole items (tests, tools)."""
        specs: list[Part] = []
        for items, idx, window in parts:
            item_len = int(items.shape[1])
            off, width = window if window is not None else (0, item_len)
            specs.append((items, idx, item_len, off, width))
        return cls(specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __getitem__(self, run: slice) -> DigestParts:
        return DigestParts(self.specs[run])

    @property
    def nbytes(self) -> int:
        """Bytes these parts digest."""
        if self._nbytes is None:
            self._nbytes = sum(len(idx) * width for _i, idx, _l, _o, width in self.specs)
        return self._nbytes

    def part_bytes(self) -> list[int]:
        """Bytes each part digests, in order (the digest pool's split)."""
        return [len(idx) * width for _i, idx, _l, _o, width in self.specs]


#: What :func:`digest_parts` selects of a side, by (include_kv, include_states, the
#: draft's own kinds, windows): the distinct (kind, draft's own list) keys; per selected
#: buffer its item view, its key's position, its item length and window; and per key the
#: bytes one index of it digests over all its buffers. Built once per side and selection.
_Template = tuple[list[tuple[IndexKind, bool]],
                  list[tuple[np.ndarray[Any, Any], int, int, int, int]], list[int]]
_templates: weakref.WeakKeyDictionary[AllocatedSide, dict[Any, _Template]] = (
    weakref.WeakKeyDictionary())


def _items(side: AllocatedSide, buf: BufferLayout) -> np.ndarray[Any, Any]:
    """The buffer as an (items, item_len) uint8 array over the pool memory."""
    return side.buffer_array(buf).reshape(buf.items, buf.item_len)


def _run(idx: np.ndarray[Any, Any]) -> tuple[int, int] | None:
    """(first, count) when ``idx`` is one ascending run of consecutive items, else None."""
    n = len(idx)
    if n == 0:
        return (0, 0)
    first = int(idx[0])
    if int(idx[-1]) - first + 1 != n:
        return None
    return (first, n) if n == 1 or bool((np.diff(idx) == 1).all()) else None


def _python_digest(part: Part) -> bytes:
    """One part's digest through python-xxhash (the helper's 16 little-endian bytes): one
    ascending run in place, any other list gathered with one vectorised ``take``."""
    items, idx, item_len, off, width = part
    run = _run(idx)
    in_place = run is not None and run[0] >= 0 and run[0] + run[1] <= len(items)
    rows = (items[run[0]:run[0] + run[1]] if in_place and run is not None
            else np.take(items, idx, axis=0))
    if (off, width) != (0, item_len):
        rows = rows[:, off:off + width]
    # A slice of a C-contiguous array's rows is contiguous: digested in place.
    value = int(xxhash.xxh3_128_intdigest(np.ascontiguousarray(rows).data))
    return value.to_bytes(DIGEST_BYTES, "little")


def _template(side: AllocatedSide, include_kv: bool, include_states: bool,
              draft: IndexLists | None,
              windows: Sequence[tuple[int, int] | None] | None) -> _Template:
    """What :func:`digest_parts` selects of ``side`` (cached per side and selection)."""
    key = (include_kv, include_states, frozenset(draft) if draft is not None else None,
           tuple(windows) if windows is not None else None)
    per_side = _templates.setdefault(side, {})
    cached = per_side.get(key)
    if cached is not None:
        return cached
    keys: list[tuple[IndexKind, bool]] = []
    rows: list[tuple[np.ndarray[Any, Any], int, int, int, int]] = []
    widths: list[int] = []
    flat = -1
    for comp in side.layout.components:
        wanted = include_kv if comp.state_type is None else include_states
        if not wanted:
            flat += len(comp.buffers)
            continue
        for buf in comp.buffers:
            flat += 1
            list_key = (buf.index_kind, own_draft_list(draft, comp.pool, buf.index_kind))
            if list_key not in keys:
                keys.append(list_key)
                widths.append(0)
            window = windows[flat] if windows is not None else None
            off, width = window if window is not None else (0, buf.item_len)
            at = keys.index(list_key)
            rows.append((_items(side, buf), at, buf.item_len, off, width))
            widths[at] += width
    per_side[key] = (keys, rows, widths)
    return keys, rows, widths


def digest_parts(side: AllocatedSide, indices: IndexLists, *, include_kv: bool = True,
                 include_states: bool = True, draft: IndexLists | None = None,
                 windows: Sequence[tuple[int, int] | None] | None = None) -> DigestParts:
    """The parts :func:`request_digests` digests, one per selected buffer, in its order.

    ``windows``: per flat buffer, the (offset, width) of each item that moves
    (:func:`kvbeam.pools.plan.side_windows`: paged pools at different TP places), or None
    for whole items; digests cover exactly the moved bytes.
    """
    keys, rows, widths = _template(side, include_kv, include_states, draft, windows)
    # contiguous int64: the compiled helper reads each list in place
    lists = [np.ascontiguousarray(list_for(indices, draft, "draft" if own else "target", kind),
                                  dtype=np.int64)
             for kind, own in keys]
    return DigestParts([(items, lists[at], item_len, off, width)
                        for items, at, item_len, off, width in rows],
                       sum(len(lst) * w for lst, w in zip(lists, widths, strict=True)))


def request_digests(side: AllocatedSide, indices: IndexLists, *, include_kv: bool = True,
                    include_states: bool = True, draft: IndexLists | None = None,
                    windows: Sequence[tuple[int, int] | None] | None = None) -> bytes:
    """XXH3-128 of each selected buffer's items, in the order of ``indices``: 16
    little-endian bytes per buffer, as the digest record carries them.

    ``indices`` must be the lists actually moved (after pairing, see
    :func:`kvbeam.pools.plan.pair_index_lists`), so both sides digest the same items.
    Buffers follow :attr:`SideLayout.flat_buffers`, filtered like the plan; the
    draft's buffers use ``draft``'s list of their kind where it has one. On the
    calling thread; :class:`kvbeam.pools.digest_pool.DigestPool` computes the same
    bytes on several.
    """
    return digest_many(digest_parts(side, indices, include_kv=include_kv,
                                    include_states=include_states, draft=draft,
                                    windows=windows))


def split_digests(digests: bytes) -> list[bytes]:
    """A request's digests, one 16-byte digest per buffer (reports, tests)."""
    return [digests[i:i + DIGEST_BYTES] for i in range(0, len(digests), DIGEST_BYTES)]


def _load_helper() -> tuple[Any, str]:
    """The compiled helper module and its vector unit, or None and why it is not used."""
    try:
        module = importlib.import_module("kvbeam.pools._xxh3")
        return module, (f"compiled XXH3-128 ({module.VECTOR}), one call per request "
                        f"({module.VECTOR_CHOICE})")
    except (ImportError, AttributeError) as exc:  # not built (no <xxhash.h>), or stale
        return None, (f"python-xxhash, one call per buffer (the compiled helper did not "
                      f"load: {type(exc).__name__}: {exc})")


_HELPER, _HELPER_WHY = _load_helper()
#: True when :func:`digest_many` uses the compiled helper (every part's hashing then
#: runs with the GIL released, however small).
COMPILED = _HELPER is not None


def digester() -> str:
    """How this process digests: the compiled helper, or python-xxhash and why."""
    return _HELPER_WHY


def digest_many(parts: DigestParts, *, compiled: bool | None = None,
                release_gil: bool | None = None) -> bytes:
    """The parts' digests, 16 little-endian bytes each, in order. ``compiled``: None takes
    the helper where it loaded; True requires it (RuntimeError without it); False uses
    python-xxhash (tests compare).

    ``release_gil`` (the helper only): whether other threads may run while it hashes;
    None: when the parts hold :data:`RELEASE_GIL_BYTES` or more. A thread that released
    the GIL in a busy daemon may wait up to the interpreter's switch interval (5 ms) to
    take it back, much longer than a small request's digests take (63 us on the host), so
    the digest pool's threads release it and its inline jobs do not."""
    use = _HELPER is not None if compiled is None else compiled
    if not use:
        return b"".join(_python_digest(part) for part in parts.specs)
    if _HELPER is None:
        raise RuntimeError(f"the compiled digest helper is not available: {_HELPER_WHY}")
    if release_gil is None:
        release_gil = parts.nbytes >= RELEASE_GIL_BYTES
    out: bytes = _HELPER.digest_parts(parts.specs, release_gil)
    return out
