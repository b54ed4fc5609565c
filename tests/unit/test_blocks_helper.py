"""The compiled blocks helper (transport/_blocks.c) against the numpy paths it replaced.

Every function runs beside its numpy oracle on generated inputs: a write's blocks
checked against both sides' regions and sliced (``prepare``), the TCP stream's frames
and iovecs (``stream``, compared byte for byte by gathering the memory each iovec
names), a received frame's descriptors checked (``check_descs``).
"""

from __future__ import annotations

import ctypes
import itertools
import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from kvbeam.errors import RegionError
from kvbeam.transport import Blocks, core
from kvbeam.transport.regions import RegionTable
from kvbeam.transport.tcp import iov, wire
from tests import tcp_blocking

_blocks = pytest.importorskip("kvbeam.transport._blocks")


@pytest.fixture
def numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy path, as where the helper was not built."""
    monkeypatch.setattr(core, "COMPILED", False)


def test_the_helper_is_built_and_used() -> None:
    """CI installs a C compiler: the helper must load, and match the wire's constants."""
    assert core.COMPILED and core.blocks_helper() is _blocks
    assert "compiled" in core.preparer()
    assert (wire.HEADER.size, wire.END, wire.WRITEV, wire.FLAG_NOTIFY) \
        == (_blocks.HEADER_BYTES, _blocks.KIND_END, _blocks.KIND_WRITEV, _blocks.FLAG_NOTIFY)


def _table(rng: np.random.Generator, n: int, name: str) -> tuple[RegionTable, list[int]]:
    """``n`` regions with gaps between them, keys 1..n; and their starts."""
    starts, lengths, at = [], [], 1 << 20
    for _ in range(n):
        starts.append(at)
        lengths.append(int(rng.integers(1, 4096)) * 16)
        at += lengths[-1] + int(rng.integers(0, 3)) * 4096  # a gap, or none
    return RegionTable([(s, n_, k + 1) for k, (s, n_) in enumerate(zip(starts, lengths,
                                                                          strict=True))],
                       name), starts


def _inside(rng: np.random.Generator, table: RegionTable, count: int,
            outside: float) -> tuple[np.ndarray, np.ndarray]:
    """``count`` (address, length) pairs inside the table's regions, some (``outside``)
    not: past an end, in a gap, before the first region, a length that wraps."""
    starts, ends, _ = table.arrays
    pick = rng.integers(0, len(starts), count)
    addrs, lengths = [], []
    for i in pick.tolist():
        size = int(ends[i] - starts[i])
        off = int(rng.integers(0, size + 1))
        length = int(rng.integers(0, size - off + 1))
        if rng.random() < outside:
            addr, length = [(int(ends[i]), 1), (int(starts[i]) + off, size - off + 1),
                            (int(starts[0]) - 1, 1), (int(ends[i]) - 1, 2 ** 64 - 1),
                            (0, 0)][int(rng.integers(0, 5))]
            addrs.append(addr)
            lengths.append(length)
            continue
        addrs.append(int(starts[i]) + off)
        lengths.append(length)
    return np.array(addrs, dtype=np.uint64), np.array(lengths, dtype=np.uint64)


@settings(max_examples=200, deadline=None)
@given(seed=hs.integers(0, 2 ** 32 - 1), count=hs.integers(0, 60),
       outside=hs.sampled_from([0.0, 0.0, 0.05, 0.3]),
       slice_bytes=hs.sampled_from([1, 7, 512, 4096, 1 << 20]))
def test_prepare_matches_the_numpy_path(seed: int, count: int, outside: float,
                                        slice_bytes: int) -> None:
    rng = np.random.default_rng(seed)
    local, _ = _table(rng, int(rng.integers(1, 6)), "local")
    remote, _ = _table(rng, int(rng.integers(1, 6)), "remote")
    src, lengths = _inside(rng, local, count, outside)
    dst, dst_lengths = _inside(rng, remote, count, outside)
    lengths = np.minimum(lengths, dst_lengths)  # a block fits both sides' pick, or not
    blocks = Blocks(src, dst, lengths)

    def both() -> list[object]:
        out: list[object] = []
        for compiled in (True, False):
            core.COMPILED = compiled
            try:
                p = core.prepare(9, blocks, True, slice_bytes, local, remote)
                out.append([a.tolist() for a in (p.src, p.dst, p.lengths, p.lkeys, p.rkeys)])
            except RegionError as exc:
                out.append(str(exc))
        return out

    saved = core.COMPILED
    try:
        compiled, numpy_ = both()
    finally:
        core.COMPILED = saved
    assert compiled == numpy_


def _gather(stream: iov.Vectors) -> bytes:
    """The bytes a stream's iovecs name, in order."""
    rows = stream._iov.tolist()
    return b"".join(ctypes.string_at(int(a), int(n)) for a, n in rows)


@settings(max_examples=100, deadline=None)
@given(seed=hs.integers(0, 2 ** 32 - 1), count=hs.integers(0, 40),
       max_vec=hs.sampled_from([1, 3, 16, wire.MAX_VEC]), notify=hs.booleans(),
       transfer_id=hs.sampled_from([0, 1, 0xFFFF_FFFF]))
def test_stream_matches_the_numpy_path(seed: int, count: int, max_vec: int, notify: bool,
                                       transfer_id: int) -> None:
    rng = np.random.default_rng(seed)
    memory = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    base = memory.ctypes.data
    offs = rng.integers(0, 1 << 15, count).astype(np.uint64)
    src = np.uint64(base) + offs
    lengths = rng.integers(0, 1 << 15, count).astype(np.uint64)
    dst = rng.integers(0, 2 ** 63, count, dtype=np.uint64)
    saved = (core.COMPILED, wire.MAX_VEC)
    try:
        wire.MAX_VEC = max_vec
        core.COMPILED = True
        compiled = wire.transfer_stream(transfer_id, src, dst, lengths, notify)
        core.COMPILED = False
        numpy_ = wire.transfer_stream(transfer_id, src, dst, lengths, notify)
    finally:
        core.COMPILED, wire.MAX_VEC = saved
    assert compiled.total == numpy_.total == len(_gather(numpy_))
    assert _gather(compiled) == _gather(numpy_)


@settings(max_examples=200, deadline=None)
@given(seed=hs.integers(0, 2 ** 32 - 1), count=hs.integers(1, 50),
       outside=hs.sampled_from([0.0, 0.05, 0.3]))
def test_check_descs_matches_the_region_lookup(seed: int, count: int, outside: float) -> None:
    rng = np.random.default_rng(seed)
    table, _ = _table(rng, int(rng.integers(1, 6)), "writable")
    addrs, lengths = _inside(rng, table, count, outside)
    raw = bytearray(np.stack([addrs, lengths], axis=1).astype("<u8").tobytes())
    starts, ends, _ = table.arrays
    ok, ok_bytes, rest = _blocks.check_descs(raw, starts, ends)
    want = next((i for i, (a, n) in enumerate(zip(addrs.tolist(), lengths.tolist(),
                                                  strict=True))
                 if not table.contains(a, n)), count)
    assert ok == want
    assert ok_bytes == int(lengths[:ok].sum(dtype=np.uint64))
    assert rest == int(lengths[ok:].sum(dtype=np.uint64))
    if ok == count:
        table.lookup(addrs, lengths)  # the numpy check agrees
    else:
        with pytest.raises(RegionError):
            table.lookup(addrs, lengths)


def test_malformed_arguments_are_value_errors() -> None:
    """The transport builds these: a wrong one is a bug, refused before any work."""
    u64 = np.zeros(2, dtype=np.uint64)
    table = (u64, u64, np.zeros(2, dtype=np.uint32))
    with pytest.raises(ValueError, match="unsigned"):
        _blocks.prepare(np.zeros(2, dtype=np.float64), u64, u64, 64, table, table)
    with pytest.raises(ValueError, match="slice_bytes"):
        _blocks.prepare(u64, u64, u64, 0, table, table)
    with pytest.raises(ValueError, match="differ"):
        _blocks.prepare(u64, u64[:1], u64, 64, table, table)
    with pytest.raises(ValueError, match="keys"):
        _blocks.prepare(u64, u64, u64, 64, (u64, u64, np.zeros(1, dtype=np.uint32)), table)
    with pytest.raises(ValueError, match="max_vec"):
        _blocks.stream(1, True, u64, u64, u64, 0)
    with pytest.raises(ValueError, match="whole descriptors"):
        _blocks.check_descs(bytearray(17), u64, u64)


def test_received_descriptors_land_through_partial_reads(numpy_path: None) -> None:
    """A stream made of rows built elsewhere (:meth:`iov.Vectors.from_iov`, as the
    receiver lands a frame's descriptors) resumes inside the row where a read stopped."""
    del numpy_path  # the rows are built here; only the resuming is under test
    rng = np.random.default_rng(3)
    payload = rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    target = bytearray(len(payload) + 64)
    base = ctypes.addressof(ctypes.c_char.from_buffer(target))
    cuts = [0, 5, 70_000, 70_001, 250_000, len(payload)]
    rows = bytearray(b"".join(struct.pack("<QQ", base + lo + 32, hi - lo)
                              for lo, hi in itertools.pairwise(cuts)))
    a, b = socket.socketpair()
    b.settimeout(5.0)
    stream = iov.Vectors.from_iov(rows, len(payload))
    calls: list[int] = []

    def send() -> None:  # in pieces that end inside rows: each read is partial
        for lo in range(0, len(payload), 30_001):
            a.sendall(payload[lo:lo + 30_001])
            time.sleep(0.01)

    sender = threading.Thread(target=send)
    sender.start()
    tcp_blocking.move_all(stream, b, reading=True, progress=lambda: calls.append(1))
    sender.join(5)
    assert len(calls) >= len(payload) // 30_001  # reads stopped inside rows, resumed there
    assert stream.done == stream.total == len(payload)
    assert bytes(target[32:32 + len(payload)]) == payload
    assert bytes(target[:32]) == bytes(32) == bytes(target[32 + len(payload):])
    a.close()
    b.close()
