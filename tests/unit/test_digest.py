"""Integrity digests agree exactly when the moved bytes agree."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvbeam.pools import digest
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest import (
    DigestParts,
    digest_many,
    digest_parts,
    request_digests,
    split_digests,
)
from kvbeam.pools.indices import request_indices
from kvbeam.pools.plan import pair_index_lists
from kvbeam.pools.types import IndexKind
from tests.copy_helpers import copy_plan
from tests.fixtures import UNIFIED_TARGET, layout


def test_digests_match_after_a_copy_and_catch_one_flipped_byte() -> None:
    src, dst = AllocatedSide(layout()), AllocatedSide(layout())
    src.fill_pattern(1)
    dst.fill_pattern(2)
    s_idx = request_indices(UNIFIED_TARGET, 1, 700)
    d_idx = request_indices(UNIFIED_TARGET, 3, 700)
    before = request_digests(dst, d_idx)
    copy_plan(src, dst, s_idx, d_idx)
    sent = request_digests(src, s_idx)
    landed = request_digests(dst, d_idx)
    assert sent == landed != before
    # flip one byte inside a moved SWA ring row
    ring = next(b for b in dst.layout.flat_buffers if b.name.endswith("swa_ring"))
    row = int(d_idx[IndexKind.SWA_RING_ROWS][5])
    view = dst.buffer_array(ring)
    view[row * ring.item_len] ^= 1
    assert request_digests(dst, d_idx) != sent


def test_prefix_pairing_digests_the_tail() -> None:
    src, dst = AllocatedSide(layout()), AllocatedSide(layout())
    src.fill_pattern(3)
    s_idx = request_indices(UNIFIED_TARGET, 0, 1000)
    d_idx = dict(request_indices(UNIFIED_TARGET, 2, 1000))
    d_idx[IndexKind.KV_PAGES] = d_idx[IndexKind.KV_PAGES][1:]
    s_pair, d_pair = pair_index_lists(s_idx, d_idx)
    assert len(s_pair[IndexKind.KV_PAGES]) == len(d_idx[IndexKind.KV_PAGES])
    copy_plan(src, dst, s_idx, d_idx)
    assert request_digests(src, s_pair) == request_digests(dst, d_pair)


def test_in_place_runs_digest_like_a_gather() -> None:
    """Contiguous lists are digested in place; the result equals gathering every item."""
    import xxhash

    side = AllocatedSide(layout())
    side.fill_pattern(5)
    base = request_indices(UNIFIED_TARGET, 1, 700)
    changes: list[tuple[str, Callable[[np.ndarray], np.ndarray]]] = [
        ("as is", lambda a: a), ("reversed", lambda a: a[::-1].copy()),
        ("one item", lambda a: a[:1]), ("empty", lambda a: a[:0]),
        ("gap", lambda a: np.concatenate((a[:2], a[3:])) if len(a) > 3 else a)]
    for name, change in changes:
        idx = {k: change(v) for k, v in base.items()}
        expected = []
        for comp in side.layout.components:
            for buf in comp.buffers:
                items = side.buffer_array(buf).reshape(buf.items, buf.item_len)
                gathered = np.take(items, idx[buf.index_kind], axis=0)
                value = xxhash.xxh3_128_intdigest(np.ascontiguousarray(gathered).data)
                expected.append(value.to_bytes(16, "little"))  # as the record carries it
        got = request_digests(side, idx)
        assert split_digests(got) == expected and got == b"".join(expected), name




def test_the_compiled_helper_and_python_xxhash_give_the_same_digests() -> None:
    """The compiled helper (pools/_xxh3.c) and python-xxhash agree part for part: whole
    items and TP head windows, runs, gaps, repeats, reversed and empty lists. CI builds
    the helper, so it must have loaded here."""
    assert digest.COMPILED, digest.digester()
    from kvbeam.pools import _xxh3  # type: ignore[attr-defined]

    # The loop kept is the one that timed faster at import (AVX2 only where the CPU has it).
    assert _xxh3.VECTOR in ("sse2", "avx2") and _xxh3.VECTOR_CHOICE.startswith(_xxh3.VECTOR)
    assert _xxh3.VECTOR_CHOICE in digest.digester()
    side = AllocatedSide(layout())
    side.fill_pattern(9)
    base = request_indices(UNIFIED_TARGET, 1, 700)
    rng = np.random.default_rng(3)
    lists = [base, {k: v[::-1].copy() for k, v in base.items()},
             {k: np.repeat(v, 2) for k, v in base.items()},
             {k: rng.permutation(v) for k, v in base.items()},
             {k: v[:0] for k, v in base.items()}]
    for idx in lists:
        parts = digest_parts(side, idx)
        windowed = DigestParts.of([(items, i, (3, items.shape[1] // 2))
                                   for items, i, _l, _o, _w in parts.specs])
        for chosen in (parts, windowed):
            one = digest_many(chosen, compiled=True)
            assert len(one) == 16 * len(chosen)
            assert one == digest_many(chosen, compiled=False)
            # part for part: each part alone gives its 16 bytes of the whole
            assert split_digests(one) == [digest_many(chosen[i:i + 1], compiled=False)
                                          for i in range(len(chosen))]


def test_the_helper_builds_and_digests_alike_without_its_avx2_loop(tmp_path: Path) -> None:
    """The build aarch64 gets (GH200, GB200: no AVX2 loop, the baseline alone), made here
    with KVBEAM_XXH3_BASELINE_ONLY where no cross compiler is at hand: it compiles with
    -Werror, references no AVX2 code, keeps the baseline loop and digests as python-xxhash
    does."""
    gcc = shutil.which("gcc")
    if gcc is None or not Path("/usr/include/xxhash.h").exists():
        pytest.skip("no gcc or <xxhash.h> here (the compiled helper is optional)")
    root = Path(__file__).resolve().parents[2] / "pools"
    out = tmp_path / f"_xxh3{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-std=c11", "-Wall", "-Werror",
                    "-DKVBEAM_XXH3_BASELINE_ONLY", f"-I{sysconfig.get_paths()['include']}",
                    f"-I{root}", str(root / "_xxh3.c"), str(root / "_xxh3_avx2.c"), "-o",
                    str(out)], check=True, capture_output=True, text=True)
    assert "avx2" not in subprocess.run(["nm", "-D", str(out)], capture_output=True,
                                        text=True, check=True).stdout.lower()
    spec = importlib.util.spec_from_file_location("_xxh3", out)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.VECTOR == "sse2", module.VECTOR
    assert "the baseline build (no AVX2 build" in module.VECTOR_CHOICE, module.VECTOR_CHOICE
    side = AllocatedSide(layout())
    side.fill_pattern(4)
    parts = digest_parts(side, request_indices(UNIFIED_TARGET, 2, 500))
    assert module.digest_parts(parts.specs, False) == digest_many(parts, compiled=False)


def test_the_compiled_helper_refuses_what_lies_outside_a_buffer() -> None:
    """An item number outside its buffer, or a window outside its item, is refused
    before a byte is read, naming the part and the item."""
    side = AllocatedSide(layout())
    items, idx, *_ = digest_parts(side, request_indices(UNIFIED_TARGET, 1, 700)).specs[0]
    for bad in (len(items), -1):
        outside = DigestParts.of([(items, np.array([0, bad], np.int64), None)])
        with pytest.raises(IndexError, match=f"digest part 0: item {bad} \\(position 1\\)"):
            digest_many(outside, compiled=True)
    width = int(items.shape[1])
    with pytest.raises(ValueError, match="window"):
        digest_many(DigestParts.of([(items, idx, (width - 1, 2))]), compiled=True)
    with pytest.raises(ValueError, match="int64"):
        digest_many(DigestParts.of([(items, idx.astype(np.int32), None)]), compiled=True)


def test_the_compiled_helper_releases_the_gil_only_when_told() -> None:
    """Another thread, ready to run as the call starts, runs during a released call and
    only after a held one (the digest pool's threads release it; inline jobs keep it:
    digest_many says why). With the switch interval far longer than the test, the GIL
    changes hands only where its holder waits or lets it go: what the other thread saw
    of the call (ended or not), not a time, tells the two apart."""
    import sys
    import threading

    assert digest.COMPILED, digest.digester()
    big = np.ones((4096, 64 << 10), dtype=np.uint8)  # 256 MiB: tens of ms to hash
    part = DigestParts.of([(big, np.arange(len(big), dtype=np.int64), None)])
    digest_many(part, compiled=True)  # pages touched once

    def ran_during_the_call(release: bool) -> bool:
        """Whether the other thread, waiting only for the GIL, ran before the call ended."""
        ended, seen, go = [False], [], threading.Event()

        def waiter() -> None:
            go.wait()
            seen.append(ended[0])  # needs the GIL

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1000.0)  # the GIL is handed over only where it is let go
        try:
            thread = threading.Thread(target=waiter)
            thread.start()  # back once the waiter let the GIL go: in go.wait()
            go.set()  # it is woken, and needs only the GIL now
            digest_many(part, compiled=True, release_gil=release)
            ended[0] = True
        finally:
            sys.setswitchinterval(interval)
        thread.join()  # the GIL goes to the waiter here, if it did not before
        return seen == [False]

    # Released: the waiter runs while the call hashes, once the OS gives it a core
    # (tries on a loaded host, where it may not before the call ends).
    assert any(ran_during_the_call(True) for _ in range(10)), "it never ran in a released call"
    # Held: never before the call ended.
    assert not any(ran_during_the_call(False) for _ in range(3)), "it ran in a held call"
