"""Colocated versus prefill -> transfer -> decode: the comparison the demo and tests print.

:func:`compare` runs one prompt twice: once in a single engine (prompt and
continuation, no transfer) and once split, prefill in one engine, the state moved
by ``transfer`` into a second engine's garbage-filled pools at that engine's own
indices, and the continuation decoded there. ``transfer`` is in-process
:func:`~kvbeam.refengine.copy.copy_state` by default; the daemon integration and
``kvbeam demo`` pass one that goes through kvbeam's daemons instead.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.plan import IndexLists
from kvbeam.pools.spec import SideConfig
from kvbeam.refengine.copy import copy_state
from kvbeam.refengine.engine import Continuation, Engine
from kvbeam.refengine.memory import SideMemory, fill_garbage, fill_zeros
from kvbeam.refengine.model import ModelShape, ReferenceModel

#: ``transfer(src_lists, dst_lists, seq_len)``: move one request's state.
Transfer = Callable[[IndexLists, IndexLists, int], None]
#: ``corrupt(decode_side, dst_lists)``: tamper with the moved state before decoding.
Corrupt = Callable[[SideMemory, IndexLists], None]

PREFILL_ALLOCATOR_SEED, DECODE_ALLOCATOR_SEED, COLOCATED_ALLOCATOR_SEED = 11, 23, 7


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads (the model is tiny: threads only add overhead)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_prompt(length: int, vocab: int, seed: int = 1) -> list[int]:
    """A reproducible random prompt."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, length)]


def colocated(config: SideConfig, prompt: list[int], k: int, seed: int = 0,
              shape: ModelShape | None = None, device: str = "cpu") -> Continuation:
    """Prompt and continuation in one engine, no transfer: the reference result."""
    model = ReferenceModel(config, seed, shape, device)
    eng = Engine(model, AllocatedSide(build_side_layout(config), device),
                 COLOCATED_ALLOCATOR_SEED)
    eng.prefill("r", prompt)
    return eng.decode("r", k)


class SplitRun:
    """One prefill; then any number of transfers into fresh decode engines, faults optional."""

    def __init__(self, config: SideConfig, prompt: list[int], *, seed: int = 0,
                 shape: ModelShape | None = None, prefill_side: SideMemory | None = None,
                 device: str = "cpu") -> None:
        self.config = config
        self.device = device
        self.model = ReferenceModel(config, seed, shape, device)
        self.side = prefill_side or AllocatedSide(build_side_layout(config), device)
        self.engine = Engine(self.model, self.side, PREFILL_ALLOCATOR_SEED)
        self.result = self.engine.prefill("r", prompt)

    def decode(self, k: int, *, transfer: Transfer | None = None,
               decode_side: SideMemory | None = None, garbage: bool = True,
               skip: Collection[str] = (), shift: Collection[str] = (),
               corrupt: Corrupt | None = None) -> Continuation:
        """Move the state into a fresh decode engine and continue ``k`` tokens there.

        The decode pools start as random bytes (``garbage``) or zeros (finite, so a
        fault shows as different tokens rather than NaN). ``skip``/``shift`` go to
        :func:`copy_state` (ignored with a custom ``transfer``).
        """
        dst = decode_side or AllocatedSide(build_side_layout(self.config), self.device)
        if garbage:
            fill_garbage(dst, seed=99)
        else:
            fill_zeros(dst)
        dec = Engine(self.model, dst, DECODE_ALLOCATOR_SEED)
        r = self.result
        dst_lists = dec.adopt("r", r.seq_len, r.first_token)
        if transfer is None:
            copy_state(self.side, r.index_lists, dst, dst_lists, self.config,
                       skip=skip, shift=shift)
        else:
            transfer(r.index_lists, dst_lists, r.seq_len)
        if corrupt is not None:
            corrupt(dst, dst_lists)
        return dec.decode("r", k)


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
        if self.moved.proposals:
            lines.append(f"draft tokens accepted: colocated {sum(self.reference.accepted)}, "
                         f"moved {sum(self.moved.accepted)} "
                         f"(of {sum(map(len, self.moved.proposals))} proposed)")
        return "\n".join(lines)


def compare(config: SideConfig, prompt: list[int], k: int, *,
            transfer: Transfer | None = None,
            prefill_side: SideMemory | None = None, decode_side: SideMemory | None = None,
            seed: int = 0, shape: ModelShape | None = None, garbage: bool = True,
            device: str = "cpu") -> Comparison:
    """Run ``prompt`` colocated and split (prefill -> ``transfer`` -> decode); compare.

    ``prefill_side`` / ``decode_side`` default to freshly allocated pools on ``device``
    (an engine's attached pools, or its device KV when it stages, otherwise); the
    decode side is filled with random bytes first (``garbage``; zeros without), so a
    byte the transfer misses is garbage. Both runs compute on ``device``.
    """
    split = SplitRun(config, prompt, seed=seed, shape=shape, prefill_side=prefill_side,
                     device=device)
    moved = split.decode(k, transfer=transfer, decode_side=decode_side, garbage=garbage)
    return Comparison(len(prompt), colocated(config, prompt, k, seed, shape, device), moved)
