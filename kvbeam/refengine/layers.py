"""One token through one block, reading and writing only kvbeam's buffers.

A block is attention + MLP. Attention covers the sliding window (KV rows in the
unified ring or the paged SWA pages) and, for C4 and C128 layers, the compressed
entries (one row per group of 4 or 128 tokens in the layer's compressed-KV pages).
The compression state of the unfinished group lives in the state buffers; a group
is compressed when its last token arrives, from the rows the state buffers hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvbeam.pools.spec import PoolSpec
from kvbeam.refengine.allocator import Allocation
from kvbeam.refengine.memory import LayerViews
from kvbeam.refengine.model import C4_SPAN, C128, LayerWeights, ModelShape, Rope, rms


@dataclass
class Where:
    """The addressing of one request in one pool: spec, allocation and model shape."""

    spec: PoolSpec
    alloc: Allocation
    shape: ModelShape
    rope: Rope

    def swa_rows(self, pos: np.ndarray) -> torch.Tensor:
        """Row of each position in a layer's SWA view (ring row, or SWA page row)."""
        if self.spec.unified_kv:
            ring = np.asarray(self.alloc.ring, dtype=np.int64)
            return torch.from_numpy(ring[pos % self.spec.ring_size])
        ps = self.spec.page_size
        pages = np.array([self.alloc.swa_pages[int(p)] for p in pos // ps], dtype=np.int64)
        return torch.from_numpy(pages * ps + pos % ps)

    def group_rows(self, ratio: int, groups: np.ndarray) -> torch.Tensor:
        """Row of each compressed group in a compressed view (page id from KV_PAGES)."""
        ps = self.spec.page_size
        first = groups * ratio
        pages = np.asarray(self.alloc.kv_pages, dtype=np.int64)[first // ps]
        return torch.from_numpy(pages * (ps // ratio) + (first % ps) // ratio)


def _attend(q: torch.Tensor, keys: torch.Tensor, kpos: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Single-KV-head attention: ``q`` ``[H, hd]`` (rotated) over ``keys`` ``[S, hd]``."""
    k = rope(keys, kpos)
    w = torch.softmax(q @ k.T / math.sqrt(keys.shape[-1]), dim=-1)
    return w @ keys


def _gate(values: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Softmax-gated sum over rows, per dimension (DSV4-style compression)."""
    return (torch.softmax(scores, dim=0) * values).sum(0)


def _compress_c4(lw: LayerWeights, v: LayerViews, w: Where, a: torch.Tensor, p: int) -> None:
    """Record position ``p`` in the C4 state rings; compress the group ending at ``p``."""
    assert v.c4_state is not None and v.c4_idx_state is not None
    assert lw.wcv is not None and lw.wcs is not None and lw.ape is not None
    assert lw.wiv is not None and lw.wis is not None and lw.iape is not None
    ring = w.spec.c4_ring_size
    st, ist = v.c4_state[w.alloc.c4_item], v.c4_idx_state[w.alloc.c4_item]
    st[p % ring, 0], st[p % ring, 1] = a @ lw.wcv, a @ lw.wcs
    ist[p % ring, 0], ist[p % ring, 1] = a @ lw.wiv, a @ lw.wis
    if (p + 1) % 4:
        return
    g = p // 4
    # Overlapping windows: group g reads the previous group's rows too (8 slots).
    pos = np.arange(max(0, 4 * g - 4), 4 * g + 4)
    slots = torch.from_numpy(pos - (4 * g - 4))
    rows = torch.from_numpy(pos % ring)
    row = w.group_rows(4, np.array([g]))
    assert v.ckv is not None and v.idx is not None and len(slots) <= C4_SPAN
    v.ckv[row] = _gate(st[rows, 0], st[rows, 1] + lw.ape[slots]).to(v.ckv.dtype)
    v.idx[row] = _gate(ist[rows, 0], ist[rows, 1] + lw.iape[slots]).to(v.idx.dtype)


def _compress_c128(lw: LayerWeights, v: LayerViews, w: Where, a: torch.Tensor, p: int) -> None:
    """Record position ``p`` in the C128 state; compress the group ending at ``p``."""
    assert v.c128_state is not None and v.ckv is not None
    assert lw.wcv is not None and lw.wcs is not None and lw.ape is not None
    val, score = a @ lw.wcv, a @ lw.wcs
    st = v.c128_state[w.alloc.c128_item]
    if w.spec.online_c128:
        # (running max, running sum, weighted value sum), per dimension; the slot's
        # positional bias enters as the row arrives (offline: when the group is gated).
        score = score + lw.ape[p % C128]
        if p % C128 == 0:
            st[0], st[1], st[2] = score, torch.ones_like(score), val
        else:
            m = torch.maximum(st[0], score)
            old, new = torch.exp(st[0] - m), torch.exp(score - m)
            st[1], st[2], st[0] = st[1] * old + new, st[2] * old + val * new, m
    else:
        st[p % C128, 0], st[p % C128, 1] = val, score
    if (p + 1) % C128:
        return
    comp = st[2] / st[1] if w.spec.online_c128 else _gate(st[:, 0], st[:, 1] + lw.ape)
    v.ckv[w.group_rows(C128, np.array([p // C128]))] = comp.to(v.ckv.dtype)


def _compressed(lw: LayerWeights, v: LayerViews, w: Where, a: torch.Tensor, p: int,
                q: torch.Tensor) -> torch.Tensor | None:
    """Attention over the visible compressed entries (C4: the indexer's top-k of them)."""
    r = lw.ratio
    n = (p + 1) // r
    if n == 0:
        return None
    assert v.ckv is not None
    groups = np.arange(n)
    rows = w.group_rows(r, groups)
    keys = v.ckv[rows].float()
    # On the pools' device: the indexer's top-k below picks from it with device indices.
    kpos = torch.from_numpy(groups * r + r - 1).to(keys.device)
    if r == 4:
        assert v.idx is not None and lw.wiq is not None
        scores = v.idx[rows].float() @ (a @ lw.wiq)
        sel = torch.topk(scores, min(w.shape.c4_topk, n)).indices
        keys, kpos = keys[sel], kpos[sel]
    return _attend(q, keys, kpos, w.rope)


def block_step(lw: LayerWeights, v: LayerViews, w: Where, x: torch.Tensor, p: int, *,
               scratch: list[torch.Tensor] | None = None, pool_end: int = -1) -> torch.Tensor:
    """Run token hidden ``x`` at position ``p`` through one block; return the new hidden.

    The token's KV row is written to the pool and read back with the window. With
    ``scratch`` (the draft's speculative chain), positions after ``pool_end`` live in
    that list instead of the pool: speculative rows never overwrite moved state.
    """
    s, hd = w.shape, lw.head_dim
    a = rms(x)
    q = w.rope((a @ lw.wq).view(s.heads, hd), torch.tensor([p]))
    kv = a @ lw.wkv
    start = max(0, p - w.spec.sliding_window + 1)
    if scratch is None:
        v.swa[w.swa_rows(np.array([p]))] = kv.to(v.swa.dtype)
        pool_end = p
    else:
        scratch.append(kv.to(v.swa.dtype).float())
    pos = np.arange(start, pool_end + 1)
    keys = v.swa[w.swa_rows(pos)].float()
    if scratch:
        keys = torch.cat([keys, torch.stack(scratch)])
    out = _attend(q, keys, torch.arange(start, start + len(keys)), w.rope)
    if lw.ratio and scratch is None:
        (_compress_c4 if lw.ratio == 4 else _compress_c128)(lw, v, w, a, p)
    if lw.ratio:
        extra = _compressed(lw, v, w, a, p, q)
        if extra is not None:
            out = out + extra
    x = x + out.reshape(-1) @ lw.wo
    return x + torch.nn.functional.gelu(rms(x) @ lw.w1) @ lw.w2
