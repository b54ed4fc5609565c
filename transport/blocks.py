"""The unit of work handed to a transport: a batch of (source, destination, length) blocks.

Planning (``kvbeam.pools.plan``) produces blocks as absolute addresses: the source
address in the local process and the destination address in the peer process.
Keeping them as three parallel numpy arrays lets the planner stay vectorised and
lets the transport check bounds for a whole batch at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

AddressArray = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class Blocks:
    """Parallel arrays: block ``i`` copies ``lengths[i]`` bytes from ``src[i]`` to ``dst[i]``."""

    src: AddressArray
    dst: AddressArray
    lengths: AddressArray

    def __post_init__(self) -> None:
        if not (len(self.src) == len(self.dst) == len(self.lengths)):
            raise ValueError(
                f"Blocks arrays differ in length: src={len(self.src)}, "
                f"dst={len(self.dst)}, lengths={len(self.lengths)}"
            )

    def __len__(self) -> int:
        return len(self.src)

    @functools.cached_property
    def total_bytes(self) -> int:
        """Sum of all block lengths (summed once: a write's path asks several times)."""
        return int(self.lengths.sum(dtype=np.uint64)) if len(self.lengths) else 0

    @staticmethod
    def empty() -> Blocks:
        """A batch with no blocks."""
        z = np.zeros(0, dtype=np.uint64)
        return Blocks(z, z.copy(), z.copy())

    @staticmethod
    def concat(parts: list[Blocks]) -> Blocks:
        """Join batches in order."""
        if not parts:
            return Blocks.empty()
        return Blocks(  # one call per array (unsafe: what astype(np.uint64) would do)
            np.concatenate([p.src for p in parts], dtype=np.uint64, casting="unsafe"),
            np.concatenate([p.dst for p in parts], dtype=np.uint64, casting="unsafe"),
            np.concatenate([p.lengths for p in parts], dtype=np.uint64, casting="unsafe"),
        )

    def slice(self, lo: int, hi: int) -> Blocks:
        """Blocks ``[lo, hi)`` (views of these arrays)."""
        return Blocks(self.src[lo:hi], self.dst[lo:hi], self.lengths[lo:hi])

    def split(self, max_length: int) -> Blocks:
        """Split blocks longer than ``max_length`` into slices of at most ``max_length`` bytes.

        Vectorised: the number of slices per block is computed with array maths, so
        a plan with many small blocks and no long ones costs one comparison.
        """
        if max_length <= 0:
            raise ValueError(f"max_length must be positive, got {max_length}")
        if len(self) == 0 or int(self.lengths.max()) <= max_length:
            return self
        m = np.uint64(max_length)
        pieces = (self.lengths + m - np.uint64(1)) // m
        pieces = np.maximum(pieces, np.uint64(1))
        owner = np.repeat(np.arange(len(self)), pieces.astype(np.int64))
        first = np.concatenate(([0], np.cumsum(pieces.astype(np.int64))[:-1]))
        k = (np.arange(len(owner)) - np.repeat(first, pieces.astype(np.int64))).astype(np.uint64)
        offset = k * m
        lengths = np.minimum(self.lengths[owner] - offset, m)
        return Blocks(self.src[owner] + offset, self.dst[owner] + offset, lengths)
