"""The digest pool computes exactly what the one-thread digests compute, in order."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest import (
    DigestParts,
    digest_many,
    digest_parts,
    request_digests,
    split_digests,
)
from kvbeam.pools.digest_pool import DigestPool, split_parts
from kvbeam.pools.indices import request_indices
from kvbeam.pools.types import IndexKind
from tests.fixtures import UNIFIED_TARGET, layout


def _side(seed: int) -> AllocatedSide:
    side = AllocatedSide(layout())
    side.fill_pattern(seed)
    return side


@pytest.mark.parametrize("threads", [0, 1, 2, 3, 8])
def test_the_pool_gives_the_inline_digests_in_the_buffers_order(threads: int) -> None:
    side = _side(1)
    idx = request_indices(UNIFIED_TARGET, 1, 700)
    scattered = dict(idx)  # a gathered list too, not only runs digested in place
    scattered[IndexKind.KV_PAGES] = idx[IndexKind.KV_PAGES][::-1].copy()
    with DigestPool(threads, inline_below=0) as pool:
        for lists in (idx, scattered):
            for kv, states in ((True, True), (True, False), (False, True)):
                want = request_digests(side, lists, include_kv=kv, include_states=states)
                job = pool.digests(side, lists, include_kv=kv, include_states=states)
                assert job.result(timeout=30) == want
                assert job.done()
        # Distinct buffers give distinct digests: a reordering would show.
        got = pool.digests(side, idx).result(timeout=30)
        assert len(set(split_digests(got))) > 1 and got == request_digests(side, idx)


def test_one_flipped_byte_changes_exactly_its_buffers_digest() -> None:
    side = _side(2)
    idx = request_indices(UNIFIED_TARGET, 0, 700)
    with DigestPool(2) as pool:
        before = pool.digests(side, idx).result(timeout=30)
        bufs = side.layout.flat_buffers
        ring = next(i for i, b in enumerate(bufs) if b.name.endswith("swa_ring"))
        row = int(idx[IndexKind.SWA_RING_ROWS][3])
        side.buffer_array(bufs[ring])[row * bufs[ring].item_len + 1] ^= 0x40
        after = pool.digests(side, idx).result(timeout=30)
    assert [i for i, (a, b) in enumerate(zip(split_digests(before), split_digests(after),
                                             strict=True)) if a != b] == [ring]


def test_split_keeps_every_part_once_in_order_and_at_most_the_groups_asked() -> None:
    rng = np.random.default_rng(0)
    items = np.zeros((64, 16), dtype=np.uint8)
    for trial in range(50):
        n = int(rng.integers(0, 40))
        parts = DigestParts.of([(items, np.arange(int(rng.integers(0, 64))), None)
                                for _ in range(n)])
        groups = int(rng.integers(1, 9))
        out = split_parts(parts, groups)
        assert [p for g in out for p in g.specs] == parts.specs, trial
        assert len(out) <= groups and all(len(g) for g in out), trial
    # About equal bytes: eight equal parts in four groups are four pairs.
    equal = DigestParts.of([(items, np.arange(8), None)] * 8)
    assert [len(g) for g in split_parts(equal, 4)] == [2, 2, 2, 2]


def test_a_part_that_fails_fails_the_job_with_its_error() -> None:
    """An index outside its buffer (the lists are checked before, but a digest must
    not turn a bad index into a wrong answer) re-raises from result()."""
    side = _side(3)
    idx = dict(request_indices(UNIFIED_TARGET, 0, 700))
    idx[IndexKind.KV_PAGES] = np.array([0, 10**9], dtype=np.int64)
    for threads in (0, 2):
        with DigestPool(threads) as pool, pytest.raises(IndexError):
            pool.digests(side, idx).result(timeout=30)


def test_jobs_from_several_threads_at_once_each_get_their_own_digests() -> None:
    sides = [_side(s) for s in (4, 5, 6)]
    lists = [request_indices(UNIFIED_TARGET, s, 500 + 100 * s) for s in range(3)]
    want = [request_digests(side, idx) for side, idx in zip(sides, lists, strict=True)]
    got: list[bytes | None] = [None] * 3
    with DigestPool(2) as pool:
        def run(i: int) -> None:
            got[i] = pool.digests(sides[i], lists[i]).result(timeout=60)

        callers = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(60)
    assert got == want


def test_parts_are_one_per_selected_buffer() -> None:
    side = _side(7)
    idx = request_indices(UNIFIED_TARGET, 0, 300)
    assert len(digest_parts(side, idx)) == len(side.layout.flat_buffers)
    parts = digest_parts(side, idx)
    assert parts.nbytes == sum(parts.part_bytes()) > 0
    assert b"".join(digest_many(parts[i:i + 1]) for i in range(len(parts))) \
        == request_digests(side, idx)


def test_a_negative_thread_count_is_refused() -> None:
    with pytest.raises(ValueError, match="digest threads must be >= 0, got -1"):
        DigestPool(-1)


def test_the_pool_threads_carry_its_name_in_the_os_too() -> None:
    """Per-thread CPU (top -H, the bench's split) can tell the digests apart."""
    import sys
    import threading as th
    from pathlib import Path

    from kvbeam.pools.digest_pool import THREAD_NAME

    with DigestPool(1) as pool:
        names = pool._executor.submit(  # type: ignore[union-attr]
            lambda: (th.current_thread().name,
                     Path(f"/proc/self/task/{th.get_native_id()}/comm").read_text().strip()
                     if sys.platform.startswith("linux") else THREAD_NAME)).result(30)
    # The OS keeps 15 bytes: "kvbeam-digest_0" whole.
    assert names[0].startswith(THREAD_NAME) and names[1] == names[0][:15]


def test_a_small_job_runs_on_the_calling_thread_and_a_large_one_on_the_pool() -> None:
    """A 700-token request here is under INLINE_BELOW_BYTES: done on return, no pool
    thread started; with the bound at 0 the same job goes to the pool, same digests."""
    side = _side(3)
    idx = request_indices(UNIFIED_TARGET, 0, 700)
    want = request_digests(side, idx)
    with DigestPool(2) as pool:
        job = pool.digests(side, idx)
        assert job.done() and job.result(timeout=0) == want
        assert pool._executor is not None and not pool._executor._threads
    with DigestPool(2, inline_below=0) as pool:
        assert pool.digests(side, idx).result(timeout=30) == want
        assert pool._executor is not None and pool._executor._threads
