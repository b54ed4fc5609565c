"""The compiled list codec (proto/_frames.c) against the numpy path.

Engine frames with generated lists are encoded and decoded on both paths: the same
bytes, the same lists, the same refusals (a value outside 0..2^32-1, a malformed or
truncated list section, naming the same field); so are the daemons' packed lists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from kvbeam.errors import FrameError, ProtocolError
from kvbeam.pools.types import IndexKind
from kvbeam.proto import engine_frames as ef

_frames = pytest.importorskip("kvbeam.proto._frames")


@pytest.fixture
def numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy path, as where the helper was not built."""
    monkeypatch.setattr(ef, "COMPILED", False)


def _both(fn: Callable[[], Any]) -> list[Any]:
    """``fn()`` on the compiled path, then on numpy's: its result or its refusal."""
    out: list[Any] = []
    saved = ef.COMPILED
    try:
        for compiled in (True, False):
            ef.COMPILED = compiled
            try:
                out.append(fn())
            except (FrameError, ProtocolError) as exc:
                out.append(("refused", exc.field, str(exc)))
    finally:
        ef.COMPILED = saved
    return out


def test_the_helper_is_built_and_used() -> None:
    assert ef.COMPILED and "compiled" in ef.codec()


def _lists(rng: np.random.Generator, bad: bool) -> tuple[dict[IndexKind, Any],
                                                         dict[IndexKind, Any]]:
    """Target and draft lists of random kinds, as numpy int64 arrays, Python lists or
    tuples; with ``bad``, sometimes a value outside 0..2^32-1."""
    out: list[dict[IndexKind, Any]] = [{}, {}]
    for pool in (0, 1):
        for kind in IndexKind:
            if rng.random() < 0.5:
                continue
            values = rng.integers(0, 2 ** 32, int(rng.integers(0, 40)), dtype=np.int64)
            if bad and len(values) and rng.random() < 0.3:
                values[int(rng.integers(0, len(values)))] = rng.choice([-1, 2 ** 32])
            shape = rng.integers(0, 3)
            out[pool][kind] = (values if shape == 0 else values.tolist() if shape == 1
                               else tuple(values.tolist()))
    return out[0], out[1]


def _as_arrays(lists: dict[IndexKind, Any]) -> dict[str, list[int]]:
    return {k.value: np.asarray(v).tolist() for k, v in lists.items()}


@settings(max_examples=200, deadline=None)
@given(seed=hs.integers(0, 2 ** 32 - 1), bad=hs.booleans())
def test_frames_encode_and_decode_alike(seed: int, bad: bool) -> None:
    rng = np.random.default_rng(seed)
    target, draft = _lists(rng, bad)
    frames: list[ef.EngineFrame] = [
        ef.Reserve("r", 128, "10.0.0.1:7000", target, draft, int(rng.integers(0, 3))),
        ef.Send("s", 64, "10.0.0.2:7000", True, target, draft)]
    for frame in frames:
        encoded = _both(functools.partial(ef.encode, frame))
        assert encoded[0] == encoded[1]
        if isinstance(encoded[0], tuple):
            continue
        assert isinstance(encoded[0], bytes)
        decoded = _both(functools.partial(ef.decode, encoded[0][4:]))
        lists = [(_as_arrays(d.indices or {}), _as_arrays(d.draft or {}))
                 for d in decoded]
        assert lists[0] == lists[1] == (_as_arrays(target), _as_arrays(draft))


@settings(max_examples=200, deadline=None)
@given(seed=hs.integers(0, 2 ** 32 - 1), cut=hs.integers(0, 200), flip=hs.integers(0, 200),
       value=hs.integers(0, 255))
def test_malformed_lists_are_refused_alike(seed: int, cut: int, flip: int, value: int) -> None:
    """A frame cut short, or with a byte of its lists changed: both paths decode it the
    same, or refuse it naming the same field."""
    rng = np.random.default_rng(seed)
    target, draft = _lists(rng, False)
    data = bytearray(ef.encode(ef.Reserve("r", 128, "10.0.0.1:7000", target,
                                          draft))[4:])
    head = 4 + 1 + 4 + 2 + len("10.0.0.1:7000")  # version..rid, seq_len, the address
    if flip < len(data) - head:
        data[head + flip] = value
    data = data[:max(head, len(data) - cut)]
    got = _both(lambda: ef.decode(bytes(data)))
    if isinstance(got[0], tuple):
        assert got[0] == got[1]
    else:
        assert not isinstance(got[1], tuple)
        assert (_as_arrays(got[0].indices), _as_arrays(got[0].draft)) == (
            _as_arrays(got[1].indices), _as_arrays(got[1].draft))


def test_lists_the_helper_does_not_take_go_the_numpy_way(numpy_path: None) -> None:
    """A strided array, a float list, a list of 256 lists: the helper answers None, and
    the Python path encodes or refuses them."""
    del numpy_path
    strided = np.arange(10, dtype=np.int64)[::2]
    assert _frames.pack_lists([(0, 0, strided)]) is None
    assert _frames.pack_lists([(0, 0, [1.0])]) is None
    assert _frames.pack_lists([(0, 0, [])] * 256) is None
    assert _frames.pack_lists([(0, 0, [2 ** 32])]) is None
    assert _frames.pack_lists([(0, 0, np.array([-1], dtype=np.int64))]) is None
    assert _frames.pack_lists([(0, 0, [1, 2]), (1, 3, np.array([7], dtype=np.int64))]) == (
        b"\x02" + b"\x00\x00\x02\x00\x00\x00" + b"\x01\x00\x00\x00\x02\x00\x00\x00"
        + b"\x01\x03\x01\x00\x00\x00" + b"\x07\x00\x00\x00")
    with pytest.raises(ValueError, match="not \\(pool, kind, values\\)"):
        _frames.pack_lists([(0, 0)])
    assert _frames.unpack_lists(b"\x01\x02\x00\x00\x00\x00\x00", 0, 64, 10, 5) is None  # pool 2


@settings(max_examples=150, deadline=None)
@given(seed=hs.integers(0, 2 ** 32 - 1), negative=hs.booleans(), mixed=hs.booleans())
def test_the_daemons_packed_lists_decode_alike(seed: int, negative: bool, mixed: bool) -> None:
    """A grant's lists (protocol 7: packed little-endian int64s; ``mixed``: one list as
    plain ``indices``) through the compiled codec and through numpy: the same lists, or
    the same refusal of a negative index."""
    from kvbeam.pools.types import INDEX_KINDS
    from kvbeam.proto.transfer_codec import grant_indices_from_proto, indices_to_proto
    rng = np.random.default_rng(seed)
    target = {k: rng.integers(0, 2 ** 40, int(rng.integers(0, 30)), dtype=np.int64)
              for k in INDEX_KINDS}
    draft = {k: rng.integers(0, 9, int(rng.integers(1, 5)), dtype=np.int64)
             for k in INDEX_KINDS if rng.random() < 0.3}
    if negative:
        victim = target[INDEX_KINDS[int(rng.integers(0, len(INDEX_KINDS)))]]
        if len(victim):
            victim[int(rng.integers(0, len(victim)))] = -int(rng.integers(1, 2 ** 40))
    lists = indices_to_proto(target, draft, packed=True)
    if mixed:
        lists[0] = indices_to_proto({INDEX_KINDS[0]: target[INDEX_KINDS[0]]})[0]
    got = _both(functools.partial(grant_indices_from_proto, lists, "indices"))
    if got[0][0] == "refused" or got[1][0] == "refused":
        assert got[0] == got[1]
        return
    for a, b in zip(got[0], got[1], strict=True):
        assert _as_arrays(a) == _as_arrays(b)
    assert _as_arrays(got[0][0]) == _as_arrays(target)
