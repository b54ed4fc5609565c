"""Prefill's gRPC-free core with fake links and a fake decode side: the races it fixes.

Most tests drive the core through a queue executor (nothing runs until the test runs
it, the digests run inline): the test chooses each interleaving, with no threads and no
sleeps. Those that race real threads (a drain waited for while a completion comes) keep
a thread-pool executor and poll."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest

from kvbeam.errors import DuplicateRequest
from kvbeam.pools.digest import DigestParts
from kvbeam.pools.digest_pool import DigestJob, DigestPool
from kvbeam.server.core.prefill import GRANT_RENEW_S
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.core.prefill_record import RecordStager
from kvbeam.server.state.peers import PeerConn
from kvbeam.states import TransferState, TransferStatus
from tests.core_fakes import FakeDecode, FakeLink, prefill_core, slot_lists, wait_for
from tests.fake_clock import FakeClock
from tests.unit.test_core_decode import QueueExecutor

ADDR = "127.0.0.1:9"


def _link(core: PrefillDriver, address: str = ADDR) -> FakeLink:
    """The fake link of the core's connection to ``address``, once it is connected."""
    assert wait_for(lambda: core.peers.by_address(address) is not None)
    conn = core.peers.by_address(address)
    assert conn is not None
    return cast(FakeLink, conn.link)


class PoolJobDigests(DigestPool):
    """Digests computed at once on the calling thread, handed back as a digest pool's job
    (not ``inline``): prefill writes a first attempt's digest record as its own write
    after the data, as with digest threads, yet no thread runs."""

    def __init__(self) -> None:
        super().__init__(0, inline_below=0)

    def start(self, parts: DigestParts) -> DigestJob:
        job = super().start(parts)
        job.inline = False
        return job


def _queued(*, record_apart: bool = False,
            **kw: Any) -> tuple[PrefillDriver, FakeDecode, QueueExecutor]:
    """A prefill core (:func:`prefill_core`, ``kw``) on a queue executor, digests inline.
    ``record_apart``: a first attempt's final chunk is two writes, its data and then its
    digest record (:class:`PoolJobDigests`); else the record is the data's last block."""
    io = QueueExecutor()
    core, fake = prefill_core(io=io, digest_threads=0, **kw)
    if record_apart:
        core.digest_pool = PoolJobDigests()
    return core, fake, io


def _conn_link(core: PrefillDriver, address: str = ADDR) -> FakeLink:
    """The fake link of the core's connection to ``address`` (it must be connected)."""
    conn = core.peers.by_address(address)
    assert conn is not None, f"no connection to {address}"
    return cast(FakeLink, conn.link)


def _sweep_clock(core: PrefillDriver) -> FakeClock:
    """The driver's clock, which the sweep (:meth:`PrefillDriver.periodic`) reads when
    writes are past ``drain_s``: moved by the test instead of sleeping (from the
    table's time, which is the real one here)."""
    clock = FakeClock(time.monotonic())
    core.clock = clock
    return clock


def test_core_modules_do_not_import_grpc() -> None:
    code = ("import sys, kvbeam.server.core, kvbeam.server.core.prefill, "
            "kvbeam.server.core.decode, kvbeam.server.state.peers; "
            "print('grpc' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_single_chunk_request_succeeds_once_its_write_completes() -> None:
    core, _fake, io = _queued(integrity=False)
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    assert core.status("r").state is TransferState.BOOTSTRAPPING and len(io.queue) == 1
    io.run_all()  # the handshake, then the step: BeginWrite and the write
    link = _conn_link(core)
    assert len(link.writes) == 1
    assert core.status("r").state is TransferState.TRANSFERRING
    tid, notify = link.writes[0]
    assert notify
    core.on_event(link.completion(tid))
    assert core.status("r").state is TransferState.SUCCESS
    facts = core.facts_of("r")
    done, total = facts.bytes_done, facts.bytes_total
    assert done == total > 0
    core.periodic()
    assert not core.known("r") and not io.queue
    assert core.facts_of("r") == facts  # kept by the table once the core forgot it


def test_a_record_with_no_free_staging_slot_fails_its_request_with_the_reason() -> None:
    # One staging slot: the first request's digest record holds it while its writes are
    # in flight, so the second's step, booked on the loop, is refused: that request
    # fails with the reason and nothing of it is posted; the first is untouched.
    core, _fake, io = _queued(integrity=True)
    core.core.records = RecordStager(1)
    core.send("a", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    io.run_all()
    link = _conn_link(core)
    posted = len(link.writes)
    assert posted >= 1 and core.status("a").state is TransferState.TRANSFERRING
    core.send("b", 300, ADDR, [], True, indices=slot_lists(core, 1, 300))
    io.run_all()
    st = core.status("b")
    assert st.state is TransferState.FAILED, st
    assert "no free digest-record staging slot" in st.detail, st
    assert len(link.writes) == posted and core.core.in_flight("b") == 0
    assert core.status("a").state is TransferState.TRANSFERRING


def test_the_engine_hears_of_transferring_once_the_write_is_posted() -> None:
    """The move to Transferring is the table's before the plan, its observers' (the
    engine's push) only once the chunk's writes were handed to the link: the push is not
    on the bytes' way. Success follows as usual."""
    seen: list[tuple[TransferState, int]] = []
    holder: list[PrefillDriver] = []

    def observe(snap: TransferStatus) -> None:
        conn = holder[0].peers.by_address(ADDR) if holder else None
        writes = len(cast(FakeLink, conn.link).writes) if conn is not None else 0
        seen.append((snap.state, writes))

    core, _fake, io = _queued(integrity=False, on_change=observe)
    holder.append(core)
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    io.run_all()
    link = _conn_link(core)
    assert len(link.writes) == 1
    assert core.status("r").state is TransferState.TRANSFERRING
    assert seen == [(TransferState.BOOTSTRAPPING, 0), (TransferState.TRANSFERRING, 1)]
    core.on_event(link.completion(link.writes[0][0]))
    assert seen[-1] == (TransferState.SUCCESS, 1)


def test_decodes_late_verdict_is_logged_after_the_success_record_was_pruned(
        caplog: pytest.LogCaptureFixture) -> None:
    core, _fake, io = _queued(integrity=False)
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    io.run_all()
    link = _conn_link(core)
    assert len(link.writes) == 1
    core.on_event(link.completion(link.writes[0][0]))
    core.periodic()
    assert not core.known("r")  # pruned: decode's integrity verdict comes after that
    with caplog.at_level(logging.ERROR, logger="kvbeam.server.core.prefill"):
        st = core.abort("r", from_peer=True, detail="decode integrity check failed: x")
    assert st.state is TransferState.SUCCESS
    assert ("request r: decode reports a failure after this side ended: decode integrity "
            "check failed: x") in caplog.text
    assert not io.queue  # nothing to tell decode


def test_record_is_pruned_after_a_drain_timeout_even_when_writes_complete_late(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's clock is moved past ``drain_s`` (no sleep); the Abort's caller has no
    time left (``wait_s=0``), so it answers at once. Decode is told exactly once: when
    the sweep released the link (its writes can no longer read the source)."""
    core, fake, io = _queued(drain_s=0.1, integrity=False)
    clock = _sweep_clock(core)
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    io.run_all()
    link = _conn_link(core)
    assert len(link.writes) == 1
    # Abort: the write never completes, so the drain times out and the sweep releases
    # the link (the Abort itself answered without waiting that long).
    st = core.abort("r", from_peer=False, detail="test", wait_s=0.0)
    assert st.state is TransferState.FAILED
    assert not io.queue  # the write may still read the source: decode is not told yet
    core.periodic()  # notes when it failed
    assert not io.queue
    clock.advance(0.15)
    core.periodic()  # its writes are past drain_s
    assert not link.released and len(io.queue) == 1  # the release, on the executor
    io.run_all()
    assert link.released and fake.aborts == ["r"]  # released: now decode is told
    # The released link's cancelled write now completes, late, as failed.
    core.on_event(link.completion(link.writes[0][0], ok=False))
    core.periodic()
    assert not core.known("r"), "the record leaked after a drain timeout"
    io.run_all()
    assert fake.aborts == ["r"]


def test_decode_that_aborted_is_not_told_again_when_a_write_completes_during_the_drain(
        ) -> None:
    core, fake = prefill_core(integrity=False)
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
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
            core.send(f"r{i}", 300, ADDR, [], True, indices=slot_lists(core, i % 4, 300))
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
    """While the handshake with a stuck peer (B) is under way, every other job on the
    executor runs: B's other requests join that handshake and return (none blocks a
    worker or starts a second one), and requests to A are written."""
    core, fake, io = _queued(integrity=False)
    stuck = "10.0.0.2:1"
    real = fake.connect
    handshakes: list[str] = []
    meanwhile: list[tuple[int, int, set[TransferState]]] = []

    def hanging(address: str) -> PeerConn:
        if address == stuck:  # B does not answer yet: the other jobs run meanwhile
            handshakes.append(address)
            io.run_all()
            meanwhile.append((len(io.queue), len(_conn_link(core).writes),
                              {core.status(f"b{i}").state for i in range(6)}))
        return real(address)

    fake.connect = hanging  # type: ignore[method-assign]
    for i in range(6):  # more requests to the stuck peer than a pool has workers
        core.send(f"b{i}", 300, stuck, [], True, indices=slot_lists(core, i % 4, 300))
    for i in range(4):
        core.send(f"a{i}", 300, ADDR, [], True, indices=slot_lists(core, i, 300))
    assert len(io.queue) == 10
    io.run_all()  # B's first step handshakes (hanging): the other nine run inside it
    assert handshakes == [stuck]  # one handshake for all six
    # Within it: no job left, A's four written, B's six still Bootstrapping.
    assert meanwhile == [(0, 4, {TransferState.BOOTSTRAPPING})], "requests to A queued behind B"
    assert len(_conn_link(core, stuck).writes) == 6
    assert fake.connects.count(stuck) == 1 and not io.queue


def test_a_chunk_after_the_request_ended_is_answered_with_its_status() -> None:
    # The request fails between its chunks (here an abort; in the RDMA control
    # partition a lost peer): the engine's next chunk, final or not, is not a reuse of
    # its id (no DuplicateRequest) but is told how it ended, before and after the sweep
    # forgets its record. A final chunk sent twice stays a duplicate.
    core, fake, io = _queued(drain_s=0.0, integrity=False)
    core.send("late", 1000, ADDR, [(0, 256)], False, indices=slot_lists(core, 0, 1000))
    io.run_all()
    link = _conn_link(core)
    assert len(link.writes) == 1
    for tid, _ in link.writes:
        core.on_event(link.completion(tid))
    core.abort("late", from_peer=False, detail="engine cancelled", wait_s=0.0)
    assert core.status("late").state is TransferState.FAILED
    assert core.send("late", 1000, ADDR, [(256, 700)], False,
                     indices=slot_lists(core, 0, 1000)).state is TransferState.FAILED
    assert len(io.queue) == 1  # only the Abort to decode: the chunk started no step
    core.periodic()
    assert "late" not in core.core._out  # forgotten: the answer comes from the table
    st = core.send("late", 1000, ADDR, [], True, indices=slot_lists(core, 0, 1000))
    assert st.state is TransferState.FAILED and "engine cancelled" in st.detail, st

    core.send("twice", 1000, ADDR, [], True, indices=slot_lists(core, 0, 1000))
    io.run_all()
    assert len(link.writes) == 2 and fake.aborts == ["late"]
    core.on_event(link.completion(link.writes[-1][0]))
    assert core.status("twice").state is TransferState.SUCCESS
    with pytest.raises(DuplicateRequest):
        core.send("twice", 1000, ADDR, [], True, indices=slot_lists(core, 0, 1000))
    assert not io.queue


def test_chunks_of_one_request_post_in_order_and_succeed_after_the_final() -> None:
    """A step writes what is ready when it runs: a chunk alone is one write; chunks
    that queued meanwhile are one write too (the newest covers the others), the final
    one's notified."""
    clock = FakeClock()
    core, _fake, io = _queued(integrity=False, clock=clock)
    core.send("c", 1000, ADDR, [(0, 256)], False, indices=slot_lists(core, 0, 1000))
    io.run_all()
    link = _conn_link(core)
    assert [notify for _tid, notify in link.writes] == [False]
    clock.advance(GRANT_RENEW_S)  # a stale grant: the step asks again, on the executor
    core.send("c", 1000, ADDR, [(256, 700)], False, indices=slot_lists(core, 0, 1000))
    core.send("c", 1000, ADDR, [], True, indices=slot_lists(core, 0, 1000))
    assert len(io.queue) == 1  # one step for the two chunks: it takes the newest
    io.run_all()
    assert [notify for _tid, notify in link.writes] == [False, True]
    for tid, _ in link.writes:
        assert core.status("c").state is TransferState.TRANSFERRING
        core.on_event(link.completion(tid))
    assert core.status("c").state is TransferState.SUCCESS


def test_a_decodes_connect_and_a_send_to_it_share_one_handshake() -> None:
    """Decode's Connect (decode-initiated pairing) and a Send's step that names the same
    decode, at once: one handshake, whose connection both get (no second link that would
    replace the first)."""
    core, fake = prefill_core(integrity=False)
    gate = fake.hold[ADDR] = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(core.connect_back, ADDR, "")
        assert wait_for(lambda: fake.connects == [ADDR])  # its handshake under way
        # Its step waits for the same handshake.
        core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 1, 300))
        time.sleep(0.1)
        gate.set()
        conn = asked.result(10)
    assert wait_for(lambda: core.status("r").state is TransferState.TRANSFERRING
                    or core.status("r").state is TransferState.SUCCESS)
    assert fake.connects == [ADDR] and core.peers.by_address(ADDR) is conn
    assert core.connect_back(ADDR, conn.instance_id) is conn  # connected: no handshake
    assert fake.connects == [ADDR]


def test_an_abort_waiting_for_a_drain_is_woken_by_the_last_completion() -> None:
    """The driver's Abort waits off the loop on an event the core sets once the request's
    writes drained; a waiter whose bound passed stops watching, and nothing is kept."""
    core, _fake, io = _queued(integrity=False)
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    io.run_all()
    link = _conn_link(core)
    [(tid, _notify)] = link.writes
    rec = core.core._out["r"]
    waiting = core.core.watch_drain(rec.ref)
    gave_up = core.core.watch_drain(rec.ref)
    assert waiting is not None and gave_up is not None and not waiting.is_set()
    core.core.unwatch_drain(rec.ref, gave_up)
    core.on_event(link.completion(tid))
    assert waiting.is_set() and not gave_up.is_set()
    assert not core.core._drain_waiters, "a drained request's waiters were kept"
    assert core.core.watch_drain(rec.ref) is None  # drained: nothing to wait for
