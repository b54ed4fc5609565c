"""The proof can fail: every component of the moved state changes the continuation.

Each case moves the prefill state into a fresh decode engine with one fault
(:func:`~kvbeam.refengine.faults.component_faults`): a component (or one kind of
buffer) left out of the copy, or its rows landing one ring position off (window
position ``j``'s row stored where ``j + 1`` belongs). The decode pools start zeroed,
not random, so a fault shows as different tokens or draft proposals, not as NaN.
The prompt (250 tokens) leaves a C4 group and a C128 group unfinished: both
complete inside the continuation, from the moved state.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbeam.errors import PlanError
from kvbeam.pools.layout import build_side_layout
from kvbeam.refengine.configs import tiny_config
from kvbeam.refengine.engine import Continuation
from kvbeam.refengine.faults import Fault, component_faults, sensitivity
from kvbeam.refengine.run import SplitRun, make_prompt, torch_threads

K = 24
LENGTH = 250
CONFIGS = {
    "unified": tiny_config(unified=True),
    "paged": tiny_config(unified=False),
    "unified-online": tiny_config(unified=True, online_c128=True),
}
CASES = [(mode, f) for mode, cfg in CONFIGS.items() for f in component_faults(cfg)]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Keep the shared cores usable."""
    with torch_threads(1):
        yield


_SPLITS: dict[str, tuple[SplitRun, Continuation]] = {}


def _split(mode: str) -> tuple[SplitRun, Continuation]:
    """One prefill per config for the whole module, and its fault-free continuation."""
    if mode not in _SPLITS:
        split = SplitRun(CONFIGS[mode], make_prompt(LENGTH, 512))
        _SPLITS[mode] = (split, split.decode(K, garbage=False))
    return _SPLITS[mode]


def test_every_component_has_a_fault() -> None:
    for mode, cfg in CONFIGS.items():
        names = {f.name for f in component_faults(cfg)}
        assert {c.name for c in build_side_layout(cfg).components} <= names, mode
    assert {"c4_state", "c4_indexer_state", "c128_state"} <= {f.name for _, f in CASES}


@pytest.mark.parametrize(("mode", "fault"), CASES, ids=[f"{m}-{f.action}-{f.name}"
                                                        for m, f in CASES])
def test_component_counts(mode: str, fault: Fault) -> None:
    split, clean = _split(mode)
    (effect,) = sensitivity(split, K, [fault], clean)
    assert effect.changed, f"{fault} made no difference ({effect})"
    assert effect.max_logit_diff > 0 or fault.draft_only
    if fault.draft_only:
        # The draft never changes the target's tokens (greedy verification), but its
        # state shows in what it proposes.
        assert effect.tokens_changed == 0 and effect.max_logit_diff == 0
        assert effect.proposals_changed > 0


def test_a_fault_that_names_nothing_is_refused() -> None:
    split, _ = _split("unified")
    with pytest.raises(PlanError, match="names no component"):
        split.decode(1, shift=("no_such_buffer",))


def test_the_clean_copy_into_zeroed_pools_matches_the_garbage_one() -> None:
    # The faults start from zeroed pools; without a fault, the start does not matter.
    split, clean = _split("unified")
    assert split.decode(K).tokens == clean.tokens
