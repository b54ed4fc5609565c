"""The compiled WR poster on the host (no RDMA device): the chain it builds, what it refuses.

``kvbeam.transport.verbs._post`` is built at install (setup.py; ``make setup``, or
``.venv/bin/python setup.py build_ext --inplace``), where Debian's libibverbs-dev is installed
(the Makefile's system-deps). These tests need it built: a missing build fails them, it does
not skip them. Posting itself needs a device: tests/rdma/test_poster_rdma.py.
"""

from __future__ import annotations

import importlib
import logging
import socket
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from kvbeam.errors import RegionError, TransportError
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.core import Prepared, prepare
from kvbeam.transport.options import MAX_CHAIN, TransportOptions
from kvbeam.transport.regions import RegionTable
from kvbeam.transport.verbs import chain
from kvbeam.transport.verbs.chain import (
    DESC_DTYPE,
    MAX_WR_BYTES,
    SEND_SIGNALED,
    WR_RDMA_WRITE,
    WR_RDMA_WRITE_WITH_IMM,
    Poster,
    build,
    check_descriptors,
)

U64 = np.uint64


@pytest.fixture(scope="module")
def helper() -> ModuleType:
    module, why = chain.compiled_helper()
    assert module is not None, (f"the compiled WR poster is not built ({why}): run "
                                "`.venv/bin/python setup.py build_ext --inplace` (libibverbs-dev)")
    return module


def prepared(n: int, notify: bool, transfer_id: int = 0x01020304, length: int = 4096) -> Prepared:
    i = np.arange(n, dtype=np.uint64)
    return Prepared(transfer_id, notify, U64(0x10000) + i * U64(length),
                    U64(0x900000) + i * U64(length), np.full(n, length, np.uint64),
                    np.arange(n, dtype=np.uint32) + np.uint32(100),
                    np.arange(n, dtype=np.uint32) + np.uint32(200))


@pytest.mark.parametrize(("n", "notify", "every", "a", "b"),
                         [(10, True, 4, 0, 11), (10, True, 4, 3, 9), (8, False, 64, 0, 8),
                          (0, True, 4, 0, 1), (300, True, 64, 256, 301)])
def test_compiled_chain_is_the_descriptors_linked_in_order(
        helper: ModuleType, n: int, notify: bool, every: int, a: int, b: int) -> None:
    batch = build(prepared(n, notify), 9, every, (0xAAAA0000, 0xBB))
    got = helper.chain_fields(batch.descs, a, b)
    want = []
    for row in batch.descs[a:b].tolist():
        wr_id, raddr, addr, length, lkey, rkey, imm, opcode, flags, num_sge = row
        sge = (addr, length, lkey) if num_sge else (0, 0, 0)
        want.append((wr_id, opcode, flags, imm, raddr, rkey, num_sge, *sge))
    assert got == want  # walked through each ibv_send_wr's next pointer: b - a WRs, in order
    if notify and b == n + 1:
        marker = got[-1]
        assert marker[1] == WR_RDMA_WRITE_WITH_IMM and marker[6] == 0
        assert marker[3] == socket.htonl(0x01020304) and marker[4:6] == (0xAAAA0000, 0xBB)
        assert marker[2] == SEND_SIGNALED  # the last WR is always signalled
    signalled = [i for i, row in enumerate(got) if row[2] & SEND_SIGNALED]
    assert signalled == [p - a for p in batch.signal_pos if a <= p < b]


def test_helper_layout_matches_chain(helper: ModuleType) -> None:
    assert DESC_DTYPE.itemsize == helper.DESC_SIZE
    assert {k: v[1] for k, v in (DESC_DTYPE.fields or {}).items()} == helper.DESC_OFFSETS
    assert (helper.WR_RDMA_WRITE, helper.WR_RDMA_WRITE_WITH_IMM, helper.SEND_SIGNALED,
            helper.MAX_CHAIN) == (WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM, SEND_SIGNALED, MAX_CHAIN)


def _descs(n: int = 4) -> np.ndarray[Any, np.dtype[np.void]]:
    return build(prepared(n, True), 1, 2, (0x5000, 7)).descs.copy()


@pytest.mark.parametrize(("field", "value", "match"), [
    ("opcode", 2, "opcode 2"),  # IBV_WR_SEND: not a write
    ("opcode", 4, "opcode 4"),  # IBV_WR_RDMA_READ
    ("send_flags", 1, "flags 1"),  # IBV_SEND_FENCE
    ("send_flags", 8, "flags 8"),  # IBV_SEND_INLINE: the provider would copy from addr itself
    ("num_sge", 2, "2 SGE"),
    ("num_sge", 0, "0 SGE"),  # a data WR without its SGE
    ("length", 0, "0 bytes"),
])
def test_a_bad_descriptor_is_refused_in_python_and_in_c(
        helper: ModuleType, field: str, value: int, match: str) -> None:
    descs = _descs()
    descs[field][1] = value
    with pytest.raises(TransportError, match=rf"WR 1 of 5: .*{match}.*nothing was posted"):
        check_descriptors(descs)
    with pytest.raises(ValueError, match=r"WR descriptor 1: .*nothing was posted"):
        helper.chain_fields(descs, 0, 5)
    with pytest.raises(TypeError, match=r"expected a pyverbs\.qp\.QP, got object"):
        helper.post(object(), descs, 0, 5)  # on a real QP: tests/rdma/test_poster_rdma.py


def test_a_marker_with_an_sge_or_bytes_is_refused(helper: ModuleType) -> None:
    descs = _descs()
    descs["length"][4] = 8
    with pytest.raises(TransportError, match="WR 4 of 5: opcode 1, 0 SGE"):
        check_descriptors(descs)
    with pytest.raises(ValueError, match="WR descriptor 4"):
        helper.chain_fields(descs, 4, 5)


def test_an_unsignalled_last_wr_is_refused() -> None:
    descs = _descs()
    descs["send_flags"][4] = 0
    with pytest.raises(TransportError, match="last of 5 WRs is not signalled"):
        check_descriptors(descs)


@pytest.mark.parametrize(("a", "b"), [(-1, 3), (0, 0), (3, 2), (0, 6), (5, 6)])
def test_a_slice_outside_the_batch_is_refused(helper: ModuleType, a: int, b: int) -> None:
    descs = _descs()
    with pytest.raises(ValueError, match=rf"WRs \[{a}, {b}\) of 5 descriptors"):
        helper.chain_fields(descs, a, b)


def test_foreign_buffers_are_refused(helper: ModuleType) -> None:
    with pytest.raises(ValueError, match="not aligned 48-byte descriptors"):
        helper.chain_fields(b"\0" * 50, 0, 1)
    with pytest.raises(ValueError, match="not aligned 48-byte descriptors"):
        helper.chain_fields(memoryview(bytearray(97))[1:], 0, 2)  # misaligned start
    with pytest.raises(TransportError, match="not kvbeam's"):
        check_descriptors(np.zeros(3, np.uint64))
    strided = np.zeros(8, DESC_DTYPE)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        helper.chain_fields(strided, 0, 2)


@pytest.mark.parametrize("length", [0, MAX_WR_BYTES + 1, 1 << 32])
def test_block_lengths_outside_one_wr_are_refused_at_build(length: int) -> None:
    p = prepared(3, False)
    p.lengths[2] = length
    with pytest.raises(TransportError, match=rf"block 2 of the write is {length} bytes"):
        build(p, 1, 64, (0, 0))


def test_addresses_outside_registered_regions_never_become_descriptors() -> None:
    local = RegionTable([(0x10000, 1 << 20, 5)], "local")
    remote = RegionTable([(0x900000, 1 << 20, 6)], "remote")
    ok = prepare(1, Blocks(np.array([0x10000], U64), np.array([0x900000], U64),
                           np.array([4096], U64)), True, 1 << 20, local, remote)
    assert build(ok, 1, 64, (0x900000, 6)).n == 2
    for src, dst in [(0x10000 + (1 << 20) - 8, 0x900000), (0x10000, 0x900000 + (1 << 20) - 8),
                     (0x8000, 0x900000)]:
        with pytest.raises(RegionError, match="nothing was posted"):
            prepare(1, Blocks(np.array([src], U64), np.array([dst], U64), np.array([4096], U64)),
                    True, 1 << 20, local, remote)


def test_max_chain_beyond_the_helper_is_refused_at_configuration() -> None:
    assert TransportOptions(max_chain=MAX_CHAIN).max_chain == MAX_CHAIN
    with pytest.raises(ValueError, match="max_chain must be in"):
        TransportOptions(max_chain=MAX_CHAIN + 1)
    with pytest.raises(ValueError, match="poster must be one of auto, compiled, pyverbs"):
        TransportOptions(poster="raw")


def test_poster_kinds_and_the_fallback(helper: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Poster("auto").kind == "compiled" and Poster("auto").why == ""
    assert Poster("compiled").kind == "compiled"
    forced = Poster("pyverbs")
    assert forced.kind == "pyverbs" and "forced" in forced.why
    # A helper that cannot be loaded: auto falls back, compiled refuses to start.
    monkeypatch.setattr(chain, "_helper", None)
    monkeypatch.setattr(chain, "_helper_why", "ImportError: no _post module")
    fallback = Poster("auto")
    assert fallback.kind == "pyverbs" and fallback.why == "ImportError: no _post module"
    with pytest.raises(TransportError, match="compiled WR poster was requested but cannot be "
                                             "loaded: ImportError: no _post module"):
        Poster("compiled")


def test_a_stale_helper_layout_is_not_loaded(monkeypatch: pytest.MonkeyPatch,
                                             helper: ModuleType) -> None:
    stale = ModuleType("kvbeam.transport.verbs._post")
    stale.__dict__.update(helper.__dict__)
    stale.DESC_SIZE = 40  # type: ignore[attr-defined]
    monkeypatch.setattr(chain, "_helper", False)
    monkeypatch.setattr(importlib, "import_module", lambda name: stale)
    module, why = chain.compiled_helper()
    assert module is None and "stale build" in why


def test_an_unrecognised_qp_falls_back_under_auto_and_is_refused_under_compiled(
        helper: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    class NotAQP:
        def __init__(self) -> None:
            self.posted: list[Any] = []

        def post_send(self, wr: Any) -> None:
            self.posted.append(wr)

    batch = build(prepared(3, True), 1, 64, (0x5000, 7))
    qp = NotAQP()
    with caplog.at_level(logging.WARNING, logger="kvbeam.transport.verbs.chain"):
        Poster("auto").post(qp, batch, 0, 4)
    assert len(qp.posted) == 1  # one chain through pyverbs SendWR objects
    assert "does not recognise this QP" in caplog.text
    with pytest.raises(TransportError, match=r"cannot post to this QP: expected a pyverbs\.qp"):
        Poster("compiled").post(NotAQP(), batch, 0, 4)


def test_the_helpers_read_pyverbs_objects_only_as_the_release_they_mirror(
        helper: ModuleType) -> None:
    """Both verbs helpers (_post.c, _dmabuf.c) read pyverbs objects at offsets that hold
    for one rdma-core release; they read the loaded one from its libibverbs' file name
    (Debian 12: rdma-core 44.0, libibverbs.so.1.14.44.0) before they read any field of a
    pyverbs object (tests/rdma/test_poster_rdma.py posts through a real QP)."""
    import pyverbs.device  # noqa: F401  (loads libibverbs, as the RDMA transport does)

    from kvbeam.transport.verbs import _dmabuf  # type: ignore[attr-defined]

    assert helper.PYVERBS_LAYOUT_RELEASE == "44.0"
    assert helper.pyverbs_release() == _dmabuf.pyverbs_release() == "44.0"
    assert helper.pyverbs_release("/usr/lib/libibverbs.so.1.15.50.0") == "50.0"
    assert helper.pyverbs_release("/usr/lib/libibverbs.so.1") == ""  # not a release's file
    with pytest.raises(TypeError, match=r"expected a pyverbs\.qp\.QP, got object"):
        helper.qp_ready(object())  # a type name is checked before anything else
