"""The cores without pools (``--pools engine`` before an attach) and across use/drop."""

from __future__ import annotations

import threading
import time

import pytest

from kvbeam.errors import NoEngineAttached
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.server.core.decode_driver import DecodeDriver
from kvbeam.server.state.lifecycle import Deadlines, TransferTable
from kvbeam.server.state.peers import Peers
from kvbeam.states import FailureReason, TransferState
from tests.core_fakes import FakeDecode, prefill_core, slot_lists, wait_for
from tests.fixtures import UNIFIED_TARGET, layout
from tests.unit.test_core_decode import FakePrefill, QueueExecutor


def _decode() -> DecodeDriver:
    return DecodeDriver(table=TransferTable(Deadlines()), peers=Peers(), prefill=FakePrefill(),
                      io=QueueExecutor(), integrity=True, handoff_lease_s=30.0,
                      clock=time.monotonic)


def test_a_decode_core_without_pools_refuses_then_serves_then_drops() -> None:
    core = _decode()
    with pytest.raises(NoEngineAttached, match="no engine attached"):
        _ = core.layout
    lay = layout()
    core.use_pools(UNIFIED_TARGET, lay, AllocatedSide(lay))
    assert core.slots.size == UNIFIED_TARGET.num_req_slots
    res = core.reserve("r1", 300, "127.0.0.1:1")
    core.drop_pools("engine (pid 7) detached")
    snap = core.table.get("r1")
    assert snap is not None and snap.state is TransferState.FAILED
    assert snap.reason is FailureReason.SHUTDOWN and "pid 7" in snap.detail
    assert core.slots.slot_of("r1") is None and res.slot == 0
    with pytest.raises(NoEngineAttached, match=r"no engine attached \(engine \(pid 7\)"):
        _ = core.pools


def test_a_prefill_core_drop_fails_its_requests_and_tells_decode() -> None:
    core, fake = prefill_core()
    assert isinstance(fake, FakeDecode)
    fake.hold["127.0.0.1:9"] = gate = threading.Event()  # the handshake hangs
    core.send("s1", 300, "127.0.0.1:9", [], True, indices=slot_lists(core, 0, 300))
    core.drop_pools("engine gone")
    gate.set()
    snap = core.table.get("s1")
    assert snap is not None and snap.state is TransferState.FAILED
    assert "engine gone" in snap.detail
    # Decode is told if the pair's channel is open by then, else the Abort finds none
    # (the request never connected: decode granted it nothing); either way it was tried.
    assert wait_for(lambda: "s1" in fake.aborts + fake.untold)
    with pytest.raises(NoEngineAttached):
        core.send("s2", 300, "127.0.0.1:9", [], True, indices=slot_lists(core, 0, 300))
    assert core.table.get("s2") is None  # refused before the table saw it
