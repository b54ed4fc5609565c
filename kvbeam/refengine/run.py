"""Colocated versus prefill -> transfer -> decode: the comparison the demo and tests print.

:func:`compare` runs one prompt twice: once in a single engine (prompt and
continuation, no transfer) and once split, prefill in one engine, the state moved
by ``transfer`` into a second engine's garbage-filled pools at that engine's own
indices, and the continuation decoded there. ``transfer`` is in-process
:func:`~kvbeam.refengine.copy.copy_state` by default; the daemon integration and
``kvbeam demo`` pass one that goes through kvbeam's daemons instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.plan import IndexLists
from kvbeam.pools.spec import SideConfig
from kvbeam.refengine.copy import copy_state
from kvbeam.refengine.engine import Continuation, Engine
from kvbeam.refengine.memory import SideMemory, fill_garbage
from kvbeam.refengine.model import ModelShape, ReferenceModel

#: ``transfer(src_lists, dst_lists, seq_len)``: move one request's state.
Transfer = Callable[[IndexLists, IndexLists, int], None]


def make_prompt(length: int, vocab: int, seed: int = 1) -> list[int]:
    """A reproducible random prompt."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, length)]


def colocated(config: SideConfig, prompt: list[int], k: int, seed: int = 0,
              shape: ModelShape | None = None, allocator_seed: int = 7) -> Continuation:
    """Prompt and continuation in one engine, no transfer: the reference result."""
    model = ReferenceModel(config, seed, shape)
    eng = Engine(model, AllocatedSide(build_side_layout(config)), allocator_seed)
    eng.prefill("r", prompt)
    return eng.decode("r", k)


@dataclass
class Comparison:
    """Both runs of one prompt and how they compare."""

    seq_len: int
    reference: Continuation
    moved: Continuation

    @property
    def tokens_equal(self) -> bool:
        """Continued tokens identical."""
        return self.reference.tokens == self.moved.tokens

    @property
    def proposals_equal(self) -> bool:
        """Draft proposals identical (vacuously true without a draft)."""
        return self.reference.proposals == self.moved.proposals

    @property
    def max_logit_diff(self) -> float:
        """Largest absolute logit difference over the continuation."""
        return float((self.reference.logits - self.moved.logits).abs().max())

    @property
    def equal(self) -> bool:
        """Tokens and proposals identical and logits within float tolerance."""
        return (self.tokens_equal and self.proposals_equal
                and torch.allclose(self.reference.logits, self.moved.logits,
                                   rtol=1e-4, atol=1e-4))

    def table(self) -> str:
        """Tokens side by side, one row per continued token."""
        lines = [f"prompt {self.seq_len} tokens; step | colocated | moved | equal"]
        for i, (a, b) in enumerate(zip(self.reference.tokens, self.moved.tokens, strict=True)):
            lines.append(f"{i:4d} | {a:9d} | {b:5d} | {'yes' if a == b else 'NO'}")
        lines.append(f"tokens equal: {self.tokens_equal}; draft proposals equal: "
                     f"{self.proposals_equal}; max logit diff {self.max_logit_diff:.3g}")
        return "\n".join(lines)


def compare(config: SideConfig, prompt: list[int], k: int, *,
            transfer: Transfer | None = None,
            prefill_side: SideMemory | None = None, decode_side: SideMemory | None = None,
            seed: int = 0, shape: ModelShape | None = None) -> Comparison:
    """Run ``prompt`` colocated and split (prefill -> ``transfer`` -> decode); compare.

    ``prefill_side`` / ``decode_side`` default to freshly allocated pools; the decode
    side is filled with random bytes first, so a byte the transfer misses is garbage.
    """
    layout = build_side_layout(config)
    src = prefill_side or AllocatedSide(layout)
    dst = decode_side or AllocatedSide(layout)
    fill_garbage(dst, seed=99)
    model = ReferenceModel(config, seed, shape)
    pre, dec = Engine(model, src, allocator_seed=11), Engine(model, dst, allocator_seed=23)
    result = pre.prefill("r", prompt)
    dst_lists = dec.adopt("r", result.seq_len, result.first_token)
    if transfer is None:
        copy_state(src, result.index_lists, dst, dst_lists, config)
    else:
        transfer(result.index_lists, dst_lists, result.seq_len)
    moved = dec.decode("r", k)
    return Comparison(len(prompt), colocated(config, prompt, k, seed, shape), moved)
