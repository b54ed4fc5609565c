"""The reference model's weights: a tiny DeepSeek-V4-shaped transformer with random weights.

The model is a test instrument, not DeepSeek-V4's math: one KV row per token per
layer (shared key and value, as in DSV4's MQA-style attention), rotary positions
applied when a row is READ (so a row stored at the wrong ring position changes the
result), softmax-gated group compression with a per-slot positional bias (DSV4's
``ape``: so a compression-state row out of place changes the compressed entry), a
C4 indexer choosing the top-k compressed entries, and a NextN draft layer.

All weights are float32 and drawn from one seeded generator: two processes that build
``ReferenceModel(config, seed)`` hold bit-identical weights. They are drawn on the CPU and
then moved to ``device`` (``cuda`` for a GPU engine), so every device holds the same ones;
the model computes wherever its weights and its pools are.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvbeam.errors import ConfigError
from kvbeam.pools.spec import PoolSpec, SideConfig

#: C4 compression reads the previous group too (overlapping windows, as DSV4's C4).
C4_SPAN = 8
C128 = 128


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the reference model that the pool config does not fix."""

    hidden: int = 64
    heads: int = 2
    vocab: int = 512
    mlp: int = 128
    #: Compressed entries a C4 layer attends to (chosen by its indexer).
    c4_topk: int = 16
    #: Scale of the random weights; > 1 makes the residual stream follow attention closely.
    gain: float = 1.6
    rope_base: float = 500.0
    #: Scale of the compression's per-slot score bias: large, so the gate favours
    #: particular slots and a row one slot off changes the compressed entry.
    ape_scale: float = 4.0


@dataclass
class LayerWeights:
    """One attention + MLP block; the compression weights exist when ``ratio > 0``."""

    ratio: int
    head_dim: int
    wq: torch.Tensor
    wkv: torch.Tensor
    wo: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    # compression (value and score projections, positional score bias per group slot)
    wcv: torch.Tensor | None = None
    wcs: torch.Tensor | None = None
    ape: torch.Tensor | None = None
    # C4 indexer (query, key value/score projections and their bias)
    wiq: torch.Tensor | None = None
    wiv: torch.Tensor | None = None
    wis: torch.Tensor | None = None
    iape: torch.Tensor | None = None


@dataclass
class DraftWeights:
    """The NextN (MTP) draft: projections of (target hidden, next-token embedding), then blocks."""

    proj_h: torch.Tensor
    proj_e: torch.Tensor
    layers: list[LayerWeights]


class ReferenceModel:
    """Random weights for a side config's target (and draft, when the config has one)."""

    def __init__(self, config: SideConfig, seed: int = 0, shape: ModelShape | None = None,
                 device: str = "cpu") -> None:
        self.config = config
        self.device = str(device)
        self.shape = shape or ModelShape()
        s = self.shape
        self.gen = torch.Generator().manual_seed(seed)
        self.embed = self._rand(s.vocab, s.hidden, scale=1.0)
        self.head = self._rand(s.hidden, s.vocab)
        spec = config.target
        self.layers = [self._layer(spec, r) for r in spec.compression_ratios]
        # Positions reach max_context_len plus the draft's speculative chain.
        reach = spec.max_context_len + spec.num_draft_tokens + 2
        dims = {spec.head_dim} | ({config.draft.head_dim} if config.draft else set())
        self.rope = {hd: Rope(hd, self.shape.rope_base, reach) for hd in dims}
        self.draft: DraftWeights | None = None
        if config.draft is not None:
            _check_draft(spec, config.draft)
            self.draft = DraftWeights(
                proj_h=self._rand(s.hidden, s.hidden),
                proj_e=self._rand(s.hidden, s.hidden),
                layers=[self._layer(config.draft, 0) for _ in config.draft.compression_ratios],
            )
        if self.device != "cpu":
            self._move()

    def _move(self) -> None:
        """Every weight and table to ``self.device`` (drawn on the CPU: the same values)."""
        def to(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device)

        self.embed, self.head = to(self.embed), to(self.head)
        layers = [*self.layers, *(self.draft.layers if self.draft is not None else [])]
        for lw in layers:
            for f in dataclasses.fields(lw):
                value = getattr(lw, f.name)
                if isinstance(value, torch.Tensor):
                    setattr(lw, f.name, to(value))
        if self.draft is not None:
            self.draft.proj_h, self.draft.proj_e = to(self.draft.proj_h), to(self.draft.proj_e)
        for rope in self.rope.values():
            rope.cos, rope.sin = to(rope.cos), to(rope.sin)

    def _rand(self, *size: int, scale: float | None = None) -> torch.Tensor:
        fan_in = size[0]
        sc = self.shape.gain / math.sqrt(fan_in) if scale is None else scale
        return torch.randn(*size, generator=self.gen, dtype=torch.float32) * sc

    def _layer(self, spec: PoolSpec, ratio: int) -> LayerWeights:
        s, hd = self.shape, spec.head_dim
        lw = LayerWeights(
            ratio=ratio, head_dim=hd,
            wq=self._rand(s.hidden, s.heads * hd), wkv=self._rand(s.hidden, hd),
            wo=self._rand(s.heads * hd, s.hidden), w1=self._rand(s.hidden, s.mlp),
            w2=self._rand(s.mlp, s.hidden),
        )
        if ratio:
            span = C4_SPAN if ratio == 4 else C128
            lw.wcv, lw.wcs = self._rand(s.hidden, hd), self._rand(s.hidden, hd)
            lw.ape = self._rand(span, hd, scale=s.ape_scale)
        if ratio == 4:
            ihd = spec.indexer_head_dim
            lw.wiq, lw.wiv = self._rand(s.hidden, ihd), self._rand(s.hidden, ihd)
            lw.wis, lw.iape = self._rand(s.hidden, ihd), self._rand(C4_SPAN, ihd, scale=s.ape_scale)
        return lw

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of a final hidden state."""
        return rms(h) @ self.head


def _check_draft(target: PoolSpec, draft: PoolSpec) -> None:
    """The draft shares the target's SWA index lists, so its window geometry must match."""
    if any(r != 0 for r in draft.compression_ratios):
        raise ConfigError("reference engine: draft layers must be SWA-only (ratio 0)")
    for name in ("unified_kv", "sliding_window", "page_size"):
        if getattr(draft, name) != getattr(target, name):
            raise ConfigError(f"reference engine: draft.{name} must equal target.{name}")
    if target.unified_kv and draft.ring_size != target.ring_size:
        raise ConfigError("reference engine: draft ring size must equal the target's")
    if not target.unified_kv and draft.swa_pages_per_request != target.swa_pages_per_request:
        raise ConfigError("reference engine: draft swa_pages_per_req must equal the target's")


def rms(x: torch.Tensor) -> torch.Tensor:
    """RMS normalisation over the last dimension (no learned scale)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Rope:
    """Rotary position tables for one head size, precomputed for every reachable position."""

    def __init__(self, head_dim: int, base: float, positions: int) -> None:
        self.half = head_dim // 2
        inv = base ** (-torch.arange(self.half, dtype=torch.float32) / max(self.half, 1))
        ang = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
        self.cos, self.sin = torch.cos(ang), torch.sin(ang)

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (``[n, hd]``, or ``[heads, hd]`` with one position) by ``pos``."""
        h = self.half
        cos, sin = self.cos[pos], self.sin[pos]
        x1, x2 = x[..., :h], x[..., h:2 * h]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., 2 * h:]], dim=-1)
