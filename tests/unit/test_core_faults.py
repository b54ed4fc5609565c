"""The test-only fault hooks: armed only by --enable-fault-injection, entering a daemon
only as decorators of its driver (:func:`~kvbeam.server.faults.arm`); the decode
corruption hook picks an item the request moved."""

from __future__ import annotations

import argparse
import ast
import logging
import re
import time
from pathlib import Path
from typing import cast

import numpy as np
import pytest

import kvbeam.server
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest_pool import DigestPool
from kvbeam.pools.plan import list_for
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.core.prefill_driver import Writer
from kvbeam.server.faults import (
    BREAK_LINK_ENV,
    CORRUPT_LANDED_ENV,
    ENABLE_FLAG,
    CorruptingCheck,
    FaultHooks,
    FaultyWriter,
    arm,
    build_faults,
)
from kvbeam.server.settings import add_daemon_arguments, env_help, resolve
from kvbeam.server.state.lifecycle import Deadlines, TransferTable
from kvbeam.server.state.peers import Peers
from kvbeam.transport import Blocks
from tests.core_fakes import FakeLink, fake_conn, prefill_core
from tests.engine_lists import random_lists
from tests.fixtures import PAGED_DRAFT, PAGED_TARGET, UNIFIED_TARGET, layout
from tests.unit.test_core_decode import FakePrefill, QueueExecutor

#: A name in code that is about faults: ``faults``, ``fault_x``, ``x.faults``,
#: ``FaultHooks`` (``default``, ``DefaultSelector`` are not).
FAULT_NAME = re.compile(r"(?:^|[_.])faults?(?:[_.]|$)|Fault")


def _fault_names(path: Path) -> set[str]:
    """The names in ``path``'s code (imports, identifiers, attributes, arguments; not
    docstrings or comments) that are about faults."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
        if isinstance(node, ast.alias):
            names.add(node.name)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg | ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
    return {n for n in names if FAULT_NAME.search(n)}


def test_no_driver_core_or_servicer_refers_to_a_fault() -> None:
    """Faults enter a daemon in one place, the runtime's start (:func:`arm`): no module
    of kvbeam.server.core, the adapters (api), the peer side or the engine side imports
    the fault module or names a fault in its code. The runtime, which arms them, is what
    the check does find."""
    root = Path(kvbeam.server.__file__).parent
    drivers = [*sorted((root / "core").glob("*.py")), *sorted((root / "api").glob("*.py")),
               *sorted((root / "peers").glob("*.py")), *sorted((root / "engines").glob("*.py"))]
    assert len(drivers) > 30 and all(path.exists() for path in drivers)
    assert {path.name: found for path in drivers if (found := _fault_names(path))} == {}
    assert {"kvbeam.server.faults", "build_faults", "faults"} <= _fault_names(root / "runtime.py")


class RecordingWriter(Writer):
    """The plain writer, remembering what each write was asked to post."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, int]] = []  # (transfer id, first, first dst)

    def write(self, request_id: str, conn: object, transfer_id: int, blocks: Blocks, *,
              notify: bool, first: bool) -> None:
        self.calls.append((transfer_id, first, int(blocks.dst[0])))


def test_the_faulty_writer_runs_a_steps_faults_before_its_first_write_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hooks = FaultHooks(write_delay_s=5.0, break_links=1)
    seen: list[str] = []
    monkeypatch.setattr(hooks, "slow_wire", lambda: seen.append("slow"))
    monkeypatch.setattr(hooks, "break_link", lambda rid, _link: seen.append(f"break {rid}"))
    inner = RecordingWriter()
    writer = FaultyWriter(inner, hooks)
    assert writer.may_block and not Writer().may_block  # a step that sleeps: executor only
    assert not FaultyWriter(Writer(), FaultHooks()).may_block
    conn = fake_conn("127.0.0.1:9", AllocatedSide(layout()))
    blocks = Blocks(np.array([1], np.uint64), np.array([4096], np.uint64),
                    np.array([8], np.uint64))
    for k in range(3):
        writer.write("r", conn, 70 + k, blocks, notify=True, first=k == 0)
    assert seen == ["slow", "break r"]  # once, before the first write
    assert inner.calls == [(70, True, 4096), (71, False, 4096), (72, False, 4096)]
    assert cast(FakeLink, conn.link).writes == []  # the inner writer is the one that posts


def test_the_faulty_writer_encodes_the_armed_records_wrong_and_others_as_they_are() -> None:
    plain, digests = Writer(), bytes(16)
    writer = FaultyWriter(plain, FaultHooks(corrupt_record_field="slot",
                                            corrupt_record_prefix="req-"))
    assert writer.record("req-1", 7, 3, digests, 0) == plain.record("req-1", 7, 4, digests, 0)
    assert writer.record("other", 7, 3, digests, 0) == plain.record("other", 7, 3, digests, 0)
    assert plain.record("req-1", 7, 3, digests, 0) != plain.record("req-1", 7, 4, digests, 0)


def test_arm_decorates_prefills_writer_and_decodes_landing_check() -> None:
    prefill, _fake = prefill_core(workers=1)
    hooks = FaultHooks(corrupt_landed=1.0)
    plain = prefill.writer
    arm(prefill, hooks)
    assert isinstance(prefill.writer, FaultyWriter) and prefill.writer.inner is plain
    pool = DigestPool(0)
    lay = layout()
    decode = DecodeDriver(table=TransferTable(Deadlines()), peers=Peers(),
                          prefill=FakePrefill(), io=QueueExecutor(), integrity=True,
                          handoff_lease_s=30.0, digest_pool=pool, clock=time.monotonic)
    decode.use_pools(UNIFIED_TARGET, lay, AllocatedSide(lay))
    arm(decode, hooks)
    assert isinstance(decode.checker, CorruptingCheck) and decode.checker.hooks is hooks
    assert decode.digest_pool is pool and decode.checker.integrity


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
