"""What the TCP and verbs transport tests share: buffer size, fill byte, plans, expectations."""

from __future__ import annotations

import mmap

import numpy as np

from kvbeam.transport import Blocks

#: Bytes in each test buffer.
N = 4 << 20
#: The destination's fill: bytes no block writes must still hold it afterwards.
FILL = 0xEE


def plan(src: int, dst: int, rows: list[tuple[int, int, int]]) -> Blocks:
    """Blocks from (source offset, destination offset, length) rows and the two base addresses."""
    a = np.array(rows, dtype=np.uint64).reshape(-1, 3)
    return Blocks(a[:, 0] + np.uint64(src), a[:, 1] + np.uint64(dst), a[:, 2].copy())


def expected_after(source: mmap.mmap, rows: list[tuple[int, int, int]]) -> np.ndarray:
    """The destination buffer as it must be after the rows were written into a FILL buffer."""
    out = np.full(N, FILL, dtype=np.uint8)
    s = np.frombuffer(source, dtype=np.uint8)
    for so, do, n in rows:
        out[do:do + n] = s[so:so + n]
    return out
