"""Per-request index maps: which items of each buffer a request of length L occupies.

Every function is vectorised (numpy ``arange`` arithmetic), so a 128k-token
request costs a handful of array operations, not a Python loop per token.
These functions are also the definition of the SWA index mapping whose
fingerprint the handshake compares (:func:`swa_index_mapping_fingerprint`).
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import numpy.typing as npt

from kvbeam.errors import PlanError
from kvbeam.pools.spec import PoolSpec
from kvbeam.pools.types import IndexKind

IndexArray = npt.NDArray[np.int64]
#: The dtype of every index list, compared with ``==`` on the request path
#: (a numpy call costs microseconds in a daemon, a dtype comparison does not).
INT64 = np.dtype(np.int64)
C128 = 128


def _empty() -> IndexArray:
    return np.zeros(0, dtype=np.int64)


def kv_pages(spec: PoolSpec, slot: int, seq_len: int) -> IndexArray:
    """Full-KV pages of the request: slot ``s`` owns pages ``[s * P, (s + 1) * P)``."""
    n = -(-seq_len // spec.page_size)
    return slot * spec.max_pages_per_req + np.arange(n, dtype=np.int64)


def full_to_swa_pages(spec: PoolSpec, slot: int | IndexArray, page: IndexArray) -> IndexArray:
    """The paged full-to-SWA index mapping: request page ``p`` -> SWA page ``s * K + p % K``.

    ``K`` is :attr:`PoolSpec.swa_pages_per_request`; a window never spans more than
    ``K`` pages, so live pages never collide.
    """
    k = spec.swa_pages_per_request
    return np.asarray(slot, dtype=np.int64) * k + page % k


def swa_window_pages(spec: PoolSpec, slot: int, seq_len: int) -> IndexArray:
    """SWA pages covering the window, the window start floored to a page: ``max(0, L - window)``."""
    if seq_len <= 0:
        return _empty()
    first = max(0, seq_len - spec.sliding_window) // spec.page_size
    last = -(-seq_len // spec.page_size)
    return full_to_swa_pages(spec, slot, np.arange(first, last, dtype=np.int64))


def ring_rows(spec: PoolSpec, slot: int | IndexArray, pos: IndexArray) -> IndexArray:
    """Unified-KV ring mapping: slot ``s``, position ``pos`` -> row ``s * ring + pos % ring``."""
    ring = spec.ring_size
    return np.asarray(slot, dtype=np.int64) * ring + pos % ring


def swa_ring_rows(spec: PoolSpec, slot: int, seq_len: int) -> IndexArray:
    """Ring rows of the window's positions ``[max(0, L - window), L)``."""
    pos = np.arange(max(0, seq_len - spec.sliding_window), seq_len, dtype=np.int64)
    return ring_rows(spec, slot, pos)


def req_slot(spec: PoolSpec, slot: int, seq_len: int) -> IndexArray:
    """``[slot]``: one item per request (the C4 compression-state ring)."""
    return np.array([slot], dtype=np.int64) if seq_len > 0 else _empty()


def c128_state(spec: PoolSpec, slot: int, seq_len: int) -> IndexArray:
    """The C128 compression-state item holding position ``L - 1``.

    Empty when ``L == 0`` or ``L % 128 == 0`` (the state was just compressed away).
    Online C128 keeps one state per request: ``[slot]``. Offline, a request owns
    ``ring / 128`` items: ``slot * (ring / 128) + ((L - 1) % ring) // 128``.
    """
    if seq_len <= 0 or seq_len % C128 == 0:
        return _empty()
    if spec.online_c128:
        return np.array([slot], dtype=np.int64)
    ring = spec.c128_ring_size
    item = slot * (ring // C128) + ((seq_len - 1) % ring) // C128
    return np.array([item], dtype=np.int64)


_INDEX_FUNCTIONS = {
    IndexKind.KV_PAGES: kv_pages,
    IndexKind.SWA_PAGES: swa_window_pages,
    IndexKind.SWA_RING_ROWS: swa_ring_rows,
    IndexKind.REQ_SLOT: req_slot,
    IndexKind.C128_STATE: c128_state,
}


def request_indices(spec: PoolSpec, slot: int, seq_len: int) -> dict[IndexKind, IndexArray]:
    """Every index list a request (``slot``, ``seq_len``) moves, by index kind.

    The draft pool shares the target's allocator, so the draft component uses the
    indices of the target's component of its type: callers pass the target spec.
    """
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < spec.num_req_slots:
        raise PlanError(
            f"request slot {slot!r} out of range: this pool has {spec.num_req_slots} slots "
            f"(valid 0..{spec.num_req_slots - 1})"
        )
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise PlanError(f"sequence length must be a non-negative integer (got {seq_len!r})")
    if seq_len > spec.max_context_len:
        raise PlanError(
            f"sequence length {seq_len} exceeds max_context_len {spec.max_context_len}"
        )
    return {kind: fn(spec, slot, seq_len) for kind, fn in _INDEX_FUNCTIONS.items()}


def expected_lengths(spec: PoolSpec, seq_len: int) -> dict[IndexKind, int]:
    """How many indices each kind's list holds for a request of ``seq_len`` tokens.

    The lengths of the slot-based lists, which do not depend on the slot: what an
    engine's own lists must match (:mod:`kvbeam.pools.engine_indices`). A fresh dict
    (the caller may keep or change it) of lengths cached per (spec, length).
    """
    return dict(_lengths(spec, seq_len))


@functools.lru_cache(maxsize=4096)
def _lengths(spec: PoolSpec, seq_len: int) -> tuple[tuple[IndexKind, int], ...]:
    # Every request checks its engine's lists against these: building the five lists
    # (numpy) each time cost about 4% of a small request's CPU on each daemon.
    return tuple((kind, len(idx)) for kind, idx in request_indices(spec, 0, seq_len).items())


def swa_index_mapping_fingerprint(spec: PoolSpec) -> str:
    """A stable fingerprint of the full-to-SWA index mapping, comparable across processes.

    sglang requires target and draft to share the *same mapping object*; across
    processes we compare what the mapping does instead. The fingerprint is the
    SHA-256 of the mode, its parameters and the mapping evaluated for slots 0 and
    1 over two full periods (so the slot stride and the wrap-around both count).
    Paged mode evaluates :func:`full_to_swa_pages`; unified mode :func:`ring_rows`.
    """
    slots = np.array([[0], [1]], dtype=np.int64)
    if spec.unified_kv:
        period = spec.ring_size
        table = ring_rows(spec, slots, np.arange(2 * period, dtype=np.int64))
        desc = f"unified-ring|ring={period}"
    else:
        period = spec.swa_pages_per_request
        table = full_to_swa_pages(spec, slots, np.arange(2 * period, dtype=np.int64))
        desc = f"paged|page_size={spec.page_size}|pages_per_req={period}"
    digest = hashlib.sha256(b"kvbeam.swa_index_mapping.v1|" + desc.encode())
    digest.update(np.ascontiguousarray(table, dtype="<i8").tobytes())
    return "sha256:" + digest.hexdigest()[:16]
