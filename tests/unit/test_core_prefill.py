"""Prefill's gRPC-free core with fake links and a fake decode side: the races it fixes."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import pytest

from kvbeam.errors import DuplicateRequest
from kvbeam.server.core.prefill import PrefillCore
from kvbeam.states import TransferState
from tests.core_fakes import FakeLink, prefill_core, wait_for

ADDR = "127.0.0.1:9"


def _link(core: PrefillCore, address: str = ADDR) -> FakeLink:
    """The fake link of the core's connection to ``address``, once it is connected."""
    assert wait_for(lambda: core.peers.by_address(address) is not None)
    conn = core.peers.by_address(address)
    assert conn is not None
    return cast(FakeLink, conn.link)


def test_core_modules_do_not_import_grpc() -> None:
    code = ("import sys, kvbeam.server.core, kvbeam.server.core.prefill, "
            "kvbeam.server.core.decode, kvbeam.server.peers; "
            "print('grpc' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_single_chunk_request_succeeds_once_its_write_completes() -> None:
    core, _fake = prefill_core(integrity=False)
    core.send("r", 0, 300, ADDR, [], True)
    link = _link(core)
    assert wait_for(lambda: len(link.writes) == 1)
    assert core.status("r").state is TransferState.TRANSFERRING
    tid, notify = link.writes[0]
    assert notify
    core.on_event(link.completion(tid))
    assert core.status("r").state is TransferState.SUCCESS
    done, total = core.bytes_of("r")
    assert done == total > 0
    core.periodic()
    assert not core.known("r")


def test_decodes_late_verdict_is_logged_after_the_success_record_was_pruned(
        caplog: pytest.LogCaptureFixture) -> None:
    core, _fake = prefill_core(integrity=False)
    core.send("r", 0, 300, ADDR, [], True)
    link = _link(core)
    assert wait_for(lambda: len(link.writes) == 1)
    core.on_event(link.completion(link.writes[0][0]))
    core.periodic()
    assert not core.known("r")  # pruned: decode's integrity verdict comes after that
    with caplog.at_level(logging.ERROR, logger="kvbeam.server.core.prefill"):
        st = core.abort("r", from_peer=True, detail="decode integrity check failed: x")
    assert st.state is TransferState.SUCCESS
    assert ("request r: decode reports a failure after this side ended: decode integrity "
            "check failed: x") in caplog.text


def test_record_is_pruned_after_a_drain_timeout_even_when_writes_complete_late() -> None:
    core, fake = prefill_core(drain_s=0.1, integrity=False)
    core.send("r", 0, 300, ADDR, [], True)
    link = _link(core)
    assert wait_for(lambda: len(link.writes) == 1)
    # Abort: the write never completes, so the drain times out and the sweep releases
    # the link (the Abort itself answered without waiting that long).
    st = core.abort("r", from_peer=False, detail="test")
    assert st.state is TransferState.FAILED
    core.periodic()  # notes when it failed
    time.sleep(0.15)
    core.periodic()  # its writes are past drain_s
    assert wait_for(lambda: link.released)
    # The released link's cancelled write now completes, late, as failed.
    core.on_event(link.completion(link.writes[0][0], ok=False))
    core.periodic()
    assert not core.known("r"), "the record leaked after a drain timeout"
    assert fake.aborts.count("r") <= 1


def test_decode_that_aborted_is_not_told_again_when_a_write_completes_during_the_drain(
        ) -> None:
    core, fake = prefill_core(integrity=False)
    core.send("r", 0, 300, ADDR, [], True)
    link = _link(core)
    assert wait_for(lambda: len(link.writes) == 1)
    with ThreadPoolExecutor(1) as pool:
        # Decode fails the request and asks prefill to drain (Abort from_peer) ...
        answer = pool.submit(core.abort, "r", from_peer=True, detail="decode timed out")
        assert wait_for(lambda: core.status("r").state is TransferState.FAILED)
        assert not answer.done()  # ... which waits for the write in flight
        core.on_event(link.completion(link.writes[0][0], ok=False))
        assert answer.result(5).state is TransferState.FAILED
    core.io.submit(lambda: None).result()
    assert fake.aborts.count("r") == 0, "decode asked, yet was told again"


def test_two_failure_paths_racing_tell_decode_once() -> None:
    sys_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: widen any race
    try:
        core, fake = prefill_core(integrity=False)
        n = 40
        for i in range(n):
            core.send(f"r{i}", i % 4, 300, ADDR, [], True)
        link = _link(core)
        conn = core.peers.by_address(ADDR)
        assert conn is not None
        assert wait_for(lambda: len(link.writes) == n)
        barrier = threading.Barrier(2)

        def completion(tid: int) -> None:
            barrier.wait()
            core.on_event(link.completion(tid, ok=False))

        def lost() -> None:
            barrier.wait()
            core.on_peer_lost(conn, "link died", gone=False)

        with ThreadPoolExecutor(2) as pool:
            for tid, _ in list(link.writes):
                barrier.reset()
                a = pool.submit(completion, tid)
                b = pool.submit(lost)
                a.result()
                b.result()
        assert wait_for(lambda: len(fake.aborts) >= n)
        core.io.submit(lambda: None).result()  # queued aborts have run
        dupes = {r: fake.aborts.count(r) for r in set(fake.aborts) if fake.aborts.count(r) > 1}
        assert not dupes, f"decode told more than once: {dupes}"
        assert sorted(set(fake.aborts)) == sorted(f"r{i}" for i in range(n))
    finally:
        sys.setswitchinterval(sys_interval)


def test_a_hanging_handshake_holds_one_worker_not_the_others() -> None:
    core, fake = prefill_core(workers=2, integrity=False)
    stuck = threading.Event()
    fake.hold["10.0.0.2:1"] = stuck
    try:
        for i in range(6):  # more requests to the stuck peer than there are workers
            core.send(f"b{i}", i % 4, 300, "10.0.0.2:1", [], True)
        for i in range(4):
            core.send(f"a{i}", i, 300, ADDR, [], True)
        link = _link(core)
        assert wait_for(lambda: len(link.writes) == 4, 3), "requests to A queued behind B"
        assert fake.connects.count("10.0.0.2:1") == 1  # one handshake for all six
        assert all(core.status(f"b{i}").state is TransferState.BOOTSTRAPPING for i in range(6))
    finally:
        stuck.set()
    b_link = _link(core, "10.0.0.2:1")
    assert wait_for(lambda: len(b_link.writes) == 6)


def test_a_chunk_after_the_request_ended_is_answered_with_its_status() -> None:
    # The request fails between its chunks (here an abort; in the RDMA control
    # partition a lost peer): the engine's next chunk, final or not, is not a reuse of
    # its id (no DuplicateRequest) but is told how it ended, before and after the sweep
    # forgets its record. A final chunk sent twice stays a duplicate.
    core, _fake = prefill_core(drain_s=0.0, integrity=False)
    core.send("late", 0, 1000, ADDR, [(0, 256)], False)
    link = _link(core)
    assert wait_for(lambda: len(link.writes) == 1)
    for tid, _ in link.writes:
        core.on_event(link.completion(tid))
    core.abort("late", from_peer=False, detail="engine cancelled", wait_s=0.0)
    assert core.status("late").state is TransferState.FAILED
    assert core.send("late", 0, 1000, ADDR, [(256, 700)], False).state is TransferState.FAILED
    core.periodic()
    assert "late" not in core._out  # forgotten: the answer comes from the table
    st = core.send("late", 0, 1000, ADDR, [], True)
    assert st.state is TransferState.FAILED and "engine cancelled" in st.detail, st

    core.send("twice", 0, 1000, ADDR, [], True)
    assert wait_for(lambda: len(link.writes) == 2)
    core.on_event(link.completion(link.writes[-1][0]))
    assert core.status("twice").state is TransferState.SUCCESS
    with pytest.raises(DuplicateRequest):
        core.send("twice", 0, 1000, ADDR, [], True)


def test_chunks_of_one_request_post_in_order_and_succeed_after_the_final() -> None:
    core, _fake = prefill_core(integrity=False)
    core.send("c", 0, 1000, ADDR, [(0, 256)], False)
    core.send("c", 0, 1000, ADDR, [(256, 700)], False)
    core.send("c", 0, 1000, ADDR, [], True)
    link = _link(core)
    assert wait_for(lambda: len(link.writes) == 3)
    assert [notify for _tid, notify in link.writes] == [False, False, True]
    for tid, _ in link.writes:
        assert core.status("c").state is TransferState.TRANSFERRING
        core.on_event(link.completion(tid))
    assert core.status("c").state is TransferState.SUCCESS
