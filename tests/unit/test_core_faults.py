"""The test-only fault hooks: armed only by --enable-fault-injection; the decode core's
corruption hook picks an item the request moved."""

from __future__ import annotations

import argparse
import logging

import numpy as np
import pytest

from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.plan import list_for
from kvbeam.server.faults import (
    BREAK_LINK_ENV,
    CORRUPT_LANDED_ENV,
    ENABLE_FLAG,
    FaultHooks,
    build_faults,
)
from kvbeam.server.settings import add_daemon_arguments, env_help, resolve
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


def test_fault_variables_arm_nothing_without_the_flag(caplog: pytest.LogCaptureFixture) -> None:
    env = {BREAK_LINK_ENV: "1", CORRUPT_LANDED_ENV: "1", "KVBEAM_FAULT_TYPO": "x"}
    assert build_faults(False, env) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"{name} is set but fault injection is off (no {ENABLE_FLAG}): ignored"
        for name in sorted(env)]
    caplog.clear()
    hooks = build_faults(True, env)
    assert hooks is not None and hooks.armed and hooks.break_links == 1
    first = caplog.records[0]
    assert first.levelno == logging.WARNING and "FAULT INJECTION ENABLED" in first.getMessage()


def test_the_flag_has_no_environment_variable() -> None:
    """Only the command line arms faults: no KVBEAM_* variable turns the flag on."""
    parser = argparse.ArgumentParser()
    add_daemon_arguments(parser)
    env = {"KVBEAM_CONFIG": "x.yaml", "KVBEAM_ENABLE_FAULT_INJECTION": "true",
           "ENABLE_FAULT_INJECTION": "true", "": "true"}
    assert not resolve("prefill", parser.parse_args([]), env).enable_fault_injection
    assert resolve("prefill", parser.parse_args([ENABLE_FLAG]), env).enable_fault_injection
    assert ENABLE_FLAG in parser.format_help() and "KVBEAM_ENABLE_FAULT" not in env_help()
