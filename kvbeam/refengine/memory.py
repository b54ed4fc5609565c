"""The engine's view of kvbeam's pools: typed tensors over exactly the buffers kvbeam moves.

The engine never owns KV memory of its own: every row it writes or reads lives in a
buffer of a side object (kvbeam's :class:`~kvbeam.pools.allocate.AllocatedSide`, or an
engine's shared-memory pools) reached through ``buffer_view``. Anything with a
``layout`` and a ``buffer_view`` fits (:class:`SideMemory`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvbeam.errors import ConfigError
from kvbeam.pools.layout import BufferLayout, SideLayout
from kvbeam.pools.spec import PoolSpec

C128 = 128


class SideMemory(Protocol):
    """A side's pools: its layout and a byte view of each buffer (no copy)."""

    @property
    def layout(self) -> SideLayout:
        """The side's layout (buffers in positional order)."""
        ...

    def buffer_view(self, buf: BufferLayout) -> torch.Tensor:
        """The buffer's bytes as a ``uint8`` tensor sharing the pool memory."""
        ...


def _dtype(name: str) -> torch.dtype:
    if name not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"reference engine: KV dtype {name!r} unsupported (bf16, fp16, fp32)")
    dt = getattr(torch, name)
    assert isinstance(dt, torch.dtype)
    return dt


@dataclass
class LayerViews:
    """One layer's buffers as typed views; ``None`` where the layer has no such buffer.

    - ``swa``: ``[rows, head_dim]`` KV rows: unified ring rows, or paged SWA pages
      flattened to rows (``page * page_size + offset``).
    - ``ckv``: compressed KV rows ``[page * (page_size / ratio) + row, head_dim]``.
    - ``idx``: C4 indexer rows, same addressing, ``indexer_head_dim`` wide.
    - ``c4_state`` / ``c4_idx_state``: ``[item, ring, 2, width]`` float32 (value, score).
    - ``c128_state``: offline ``[item, 128, 2, head_dim]``; online ``[item, 3, head_dim]``
      (running max, running sum, weighted value sum).
    """

    swa: torch.Tensor
    ckv: torch.Tensor | None = None
    idx: torch.Tensor | None = None
    c4_state: torch.Tensor | None = None
    c4_idx_state: torch.Tensor | None = None
    c128_state: torch.Tensor | None = None


def _find(side: SideMemory, name: str) -> BufferLayout | None:
    for b in side.layout.flat_buffers:
        if b.name == name:
            return b
    return None


def layer_views(side: SideMemory, pool: str, spec: PoolSpec) -> list[LayerViews]:
    """Typed views of every layer of ``pool`` (``target`` or ``draft``) in ``side``."""
    dt = _dtype(spec.dtype)
    hd = spec.head_dim

    def view(name: str, dtype: torch.dtype, *shape: int) -> torch.Tensor | None:
        buf = _find(side, name)
        if buf is None:
            return None
        return side.buffer_view(buf).view(dtype).view(*shape)

    out = []
    for i, ratio in enumerate(spec.compression_ratios):
        pre = f"{pool}.layer{i}"
        swa = view(f"{pre}.swa_ring" if spec.unified_kv else f"{pre}.swa", dt, -1, hd)
        if swa is None:
            raise ConfigError(f"reference engine: side has no SWA buffer for {pre}")
        lv = LayerViews(swa=swa)
        if ratio:
            lv.ckv = view(f"{pre}.c{ratio}_kv", dt, -1, hd)
        if ratio == 4:
            ihd, ring = spec.indexer_head_dim, spec.c4_ring_size
            lv.idx = view(f"{pre}.c4_indexer", dt, -1, ihd)
            lv.c4_state = view(f"{pre}.c4_state", torch.float32, -1, ring, 2, hd)
            lv.c4_idx_state = view(f"{pre}.c4_indexer_state", torch.float32, -1, ring, 2, ihd)
        if ratio == C128:
            shape = (-1, 3, hd) if spec.online_c128 else (-1, C128, 2, hd)
            lv.c128_state = view(f"{pre}.c128_state", torch.float32, *shape)
        out.append(lv)
    return out


def fill_garbage(side: SideMemory, seed: int) -> None:
    """Overwrite every buffer of ``side`` with random bytes (a decode engine's fresh pools)."""
    gen = torch.Generator().manual_seed(seed)
    for buf in side.layout.flat_buffers:
        v = side.buffer_view(buf)
        v.copy_(torch.randint(0, 256, (v.numel(),), dtype=torch.uint8, generator=gen))


def fill_zeros(side: SideMemory) -> None:
    """Zero every buffer of ``side`` (finite, plausible contents: no NaN to give a fault away)."""
    for buf in side.layout.flat_buffers:
        side.buffer_view(buf).zero_()
