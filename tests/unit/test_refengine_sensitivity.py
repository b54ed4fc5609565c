"""The proof can fail: every component of the moved state changes the continuation.

Each case moves the prefill state into a fresh decode engine with one fault: a
component (or one kind of buffer) left out of the copy, or its rows landing one ring
position off (window position ``j``'s row stored where ``j + 1`` belongs). The decode
pools start zeroed, not random, so a fault shows as different tokens or draft
proposals, not as NaN. The prompt (250 tokens) leaves a C4 group and a C128 group
unfinished: both complete inside the continuation, from the moved state.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvbeam.errors import PlanError
from kvbeam.refengine.configs import tiny_config
from kvbeam.refengine.engine import Continuation
from kvbeam.refengine.run import SplitRun, make_prompt

K = 24
LENGTH = 250

# (fault, name): component names, buffer kinds (``c4_state``) or buffer patterns.
# ``draft`` marks faults that may only change the draft's proposals.
UNIFIED = [
    ("skip", "kv", False),                      # main KV: C4 KV, C4 indexer, C128 KV pages
    ("skip", "c4_kv", False),
    ("skip", "c4_indexer", False),
    ("skip", "c128_kv", False),
    ("skip", "target.swa", False),              # unified: the C4 compression states
    ("skip", "c4_state", False),
    ("shift", "c4_state", False),
    ("skip", "c4_indexer_state", False),
    ("shift", "c4_indexer_state", False),
    ("skip", "target.swa_ring", False),         # SWA_RING
    ("shift", "target.swa_ring", False),
    ("skip", "target.c128_state", False),       # C128_STATE
    ("shift", "c128_state", False),
    ("skip", "draft.swa_ring", True),           # the draft component
    ("shift", "draft.swa_ring", True),
]
PAGED = [
    ("skip", "kv", False),
    ("skip", "target.swa", False),              # paged: SWA pages and C4 states
    ("skip", "target.layer*.swa", False),       # the SWA pages alone
    ("shift", "target.layer*.swa", False),
    ("skip", "c4_state", False),
    ("shift", "c4_state", False),
    ("skip", "c4_indexer_state", False),
    ("shift", "c4_indexer_state", False),
    ("skip", "target.c128_state", False),
    ("shift", "c128_state", False),
    ("skip", "draft.swa", True),
    ("shift", "draft.swa", True),
]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_SPLITS: dict[tuple[bool, bool], tuple[SplitRun, Continuation]] = {}


def _split(unified: bool, online: bool = False) -> tuple[SplitRun, Continuation]:
    """One prefill per config for the whole module, and its fault-free continuation."""
    key = (unified, online)
    if key not in _SPLITS:
        split = SplitRun(tiny_config(unified=unified, online_c128=online),
                         make_prompt(LENGTH, 512))
        _SPLITS[key] = (split, split.decode(K, garbage=False))
    return _SPLITS[key]


def _check(unified: bool, fault: str, name: str, draft_only: bool,
           online: bool = False) -> None:
    split, clean = _split(unified, online)
    faults: tuple[str, ...] = (name,)
    faulty = (split.decode(K, garbage=False, skip=faults) if fault == "skip"
              else split.decode(K, garbage=False, shift=faults))
    assert faulty.tokens != clean.tokens or faulty.proposals != clean.proposals, (
        f"{fault} {name} made no difference")
    if draft_only:
        # The draft never changes the target's tokens (greedy verification)...
        assert faulty.tokens == clean.tokens
        torch.testing.assert_close(faulty.logits, clean.logits)
        # ...but its state shows in what it proposes.
        assert faulty.proposals != clean.proposals


@pytest.mark.parametrize(("fault", "name", "draft_only"), UNIFIED,
                         ids=[f"{f}-{n}" for f, n, _ in UNIFIED])
def test_unified_component_counts(fault: str, name: str, draft_only: bool) -> None:
    _check(True, fault, name, draft_only)


@pytest.mark.parametrize(("fault", "name", "draft_only"), PAGED,
                         ids=[f"{f}-{n}" for f, n, _ in PAGED])
def test_paged_component_counts(fault: str, name: str, draft_only: bool) -> None:
    _check(False, fault, name, draft_only)


def test_online_c128_state_counts() -> None:
    _check(True, "skip", "target.c128_state", False, online=True)


def test_a_fault_that_names_nothing_is_refused() -> None:
    split, _ = _split(True)
    with pytest.raises(PlanError, match="names no component"):
        split.decode(1, skip=("target.swa",), shift=("no_such_buffer",))


def test_the_clean_copy_into_zeroed_pools_matches_the_garbage_one() -> None:
    # The faults above start from zeroed pools; without a fault, the start does not matter.
    split, clean = _split(True)
    assert split.decode(K).tokens == clean.tokens
