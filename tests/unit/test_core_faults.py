"""The decode core's test-only corruption hook picks an item the request moved."""

from __future__ import annotations

import numpy as np

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.plan import list_for
from kvbeam.server.faults import FaultHooks
from tests.engine_lists import random_lists
from tests.fixtures import PAGED_DRAFT, PAGED_TARGET, layout


def test_after_landing_corrupts_an_item_of_the_list_that_moved_draft_lists_included() -> None:
    lay = layout(PAGED_TARGET, PAGED_DRAFT)
    rng = np.random.default_rng(3)
    # Short lists (a fraction of each pool): an item picked from the wrong list is
    # almost never one of the moved ones.
    target = random_lists(PAGED_TARGET, lay, 64, rng)
    draft = random_lists(PAGED_TARGET, lay, 64, rng, pool="draft")
    side, before = AllocatedSide(lay), AllocatedSide(lay)
    side.fill_pattern(5)
    before.fill_pattern(5)
    pools_hit = set()
    for seed in range(40):
        FaultHooks(corrupt_landed=1.0, seed=seed).after_landing("r", side, target, draft)
        changed = []
        for comp in lay.components:
            for buf in comp.buffers:
                now = side.buffer_array(buf).reshape(buf.items, buf.item_len)
                was = before.buffer_array(buf).reshape(buf.items, buf.item_len)
                for item in np.flatnonzero((now != was).any(axis=1)):
                    changed.append((comp.pool, buf.name, int(item)))
                    moved = list_for(target, draft, comp.pool, buf.index_kind)
                    assert int(item) in moved.tolist(), (seed, buf.name, int(item))
                now[:] = was  # undo, so the next seed's flip is the only difference
        assert len(changed) == 1, (seed, changed)
        pools_hit.add(changed[0][0])
    assert pools_hit == {"target", "draft"}
