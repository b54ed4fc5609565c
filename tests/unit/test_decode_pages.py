"""Decode's owner book: the compiled claims (pools/_owners.c) against the numpy path.

Random claims and releases go to two books, one on each path; every claim must be
entered or refused alike (the same message), and every item owned by the same request.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from kvbeam.errors import BadIndexList
from kvbeam.pools.types import IndexKind
from kvbeam.server.core import decode_pages
from kvbeam.server.core.decode_pages import PageBook

_owners = pytest.importorskip("kvbeam.pools._owners")

KINDS = (IndexKind.KV_PAGES, IndexKind.SWA_PAGES, IndexKind.REQ_SLOT)


@pytest.fixture
def numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy path, as where the helper was not built."""
    monkeypatch.setattr(decode_pages, "COMPILED", False)


def test_the_helper_is_built_and_used() -> None:
    assert decode_pages.COMPILED and "compiled" in decode_pages.claims()


def _claim(book: PageBook, compiled: bool, rid: str, lists: dict[IndexKind, np.ndarray],
           draft: dict[IndexKind, np.ndarray], draft_pool: bool) -> str:
    saved = decode_pages.COMPILED
    decode_pages.COMPILED = compiled
    try:
        book.claim(rid, lists, draft, draft_pool=draft_pool)
        return "ok"
    except BadIndexList as exc:
        return str(exc)
    finally:
        decode_pages.COMPILED = saved


def _owned(book: PageBook) -> dict[tuple[str, str, int], str]:
    """Every owned item: (pool, kind, index) -> request id."""
    names = book._names  # the test compares the books' whole state
    out = {}
    for (pool, kind), owners in book._owners.items():
        for i in np.flatnonzero(owners).tolist():
            out[(pool, kind.value, i)] = names[int(owners[i])]
    return out


@settings(max_examples=150, deadline=None)
@given(seed=hs.integers(0, 2 ** 32 - 1), steps=hs.integers(1, 30), draft_pool=hs.booleans())
def test_claims_and_releases_match_the_numpy_path(seed: int, steps: int,
                                                  draft_pool: bool) -> None:
    rng = np.random.default_rng(seed)
    books = {True: PageBook(), False: PageBook()}
    live: list[str] = []
    for step in range(steps):
        if live and rng.random() < 0.35:
            rid = live.pop(int(rng.integers(0, len(live))))
            for compiled, book in books.items():
                saved = decode_pages.COMPILED
                decode_pages.COMPILED = compiled
                try:
                    book.release(rid)
                finally:
                    decode_pages.COMPILED = saved
            continue
        rid = f"r{step}"
        span = int(rng.choice([16, 64, 5000]))  # small pools, and one that grows the arrays
        lists = {k: rng.choice(span, int(rng.integers(0, 12)), replace=False).astype(np.int64)
                 for k in KINDS if rng.random() < 0.8}
        draft = {k: rng.choice(span, int(rng.integers(1, 6)), replace=False).astype(np.int64)
                 for k in KINDS if rng.random() < 0.3}
        got = {compiled: _claim(book, compiled, rid, lists, draft, draft_pool)
               for compiled, book in books.items()}
        assert got[True] == got[False]
        if got[True] == "ok":
            live.append(rid)
        assert _owned(books[True]) == _owned(books[False])
        assert len(books[True]) == len(books[False]) == len(live)


def test_a_refused_claim_enters_nothing_and_names_both_requests() -> None:
    book = PageBook()
    book.claim("a", {IndexKind.KV_PAGES: np.array([3, 4], dtype=np.int64)}, {},
               draft_pool=False)
    before = _owned(book)
    with pytest.raises(BadIndexList, match=r"request b: KV_PAGES index 4 at position 2 is "
                                           r"held by live request a"):
        book.claim("b", {IndexKind.KV_PAGES: np.array([900, 7, 4], dtype=np.int64),
                         IndexKind.REQ_SLOT: np.array([1], dtype=np.int64)}, {},
                   draft_pool=False)
    assert _owned(book) == before  # nothing of b, not even its REQ_SLOT item
    book.release("a")
    book.claim("b", {IndexKind.KV_PAGES: np.array([900, 7, 4], dtype=np.int64)}, {},
               draft_pool=False)
    assert _owned(book) == {("target", "KV_PAGES", i): "b" for i in (900, 7, 4)}


def test_lists_the_helper_cannot_read_in_place_take_the_numpy_path() -> None:
    """A strided list (not C-contiguous) is claimed and freed all the same."""
    book = PageBook()
    strided = np.arange(20, dtype=np.int64)[::2]
    book.claim("a", {IndexKind.KV_PAGES: strided}, {}, draft_pool=False)
    assert set(_owned(book)) == {("target", "KV_PAGES", i) for i in range(0, 20, 2)}
    book.release("a")
    assert _owned(book) == {}


def test_malformed_arguments_are_value_errors() -> None:
    owners = [np.zeros(4, dtype=np.int64)]
    with pytest.raises(ValueError, match="handle 0"):
        _owners.claim(owners, [np.array([1], dtype=np.int64)], 0)
    with pytest.raises(ValueError, match="negative"):
        _owners.claim(owners, [np.array([-1], dtype=np.int64)], 1)
    with pytest.raises(ValueError, match="int64"):
        _owners.claim(owners, [np.array([1], dtype=np.int32)], 1)
    with pytest.raises(ValueError, match="1 owner buffers for 2 lists"):
        _owners.claim(owners, [np.array([1], dtype=np.int64)] * 2, 1)
    frozen = np.zeros(4, dtype=np.int64)
    frozen.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        _owners.claim([frozen], [np.array([1], dtype=np.int64)], 1)
