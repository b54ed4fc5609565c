"""Faults where RDMA is irrelevant, on loopback with separate daemon processes.

A peer killed (SIGKILL) or frozen (SIGSTOP) at each point of a request's life, a
stalled scheduler, and floods of Reserve and Send: every case ends in a bounded
Failed (or, after Success, changes nothing), leaks no slot or in-flight entry, and
leaves the surviving daemon serving. The RDMA variants (partition, QP error) run in
the soft-RoCE harness (tests/rdma/).
"""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.errors import Busy
from kvbeam.scheduler import run_request
from kvbeam.states import FailureReason, TransferState
from tests.daemon_helpers import DECODE_SLOTS, free_slots, pair, rss_kib, start
from tests.waiting import wait_until

S, F = TransferState.SUCCESS, TransferState.FAILED


def test_prefill_killed_with_a_reservation_pending() -> None:
    """Decode reserved; prefill dies before it sends: decode, pairing with prefill for the
    reservation (decode-initiated pairing), learns it at once, not at its deadline; the
    slot returns."""
    decode = start("decode")
    try:
        prefill = start("prefill")
        with KvbeamClient(decode.address) as d:
            d.reserve("pending", 2000, prefill.address)
            prefill.kill()
            st = d.wait("pending", 20)
            # Unreachable when the kill beat decode's Connect, failed when it came after
            # the pair's channel opened; never the bootstrap deadline (4 s in these tests:
            # TIMEOUT, "no progress in Bootstrapping for 4.0 s").
            assert st.state is F and st.reason in (FailureReason.PEER_UNREACHABLE,
                                                   FailureReason.PEER_FAILED), st
            assert free_slots(d) == DECODE_SLOTS
    finally:
        decode.stop()


def test_decode_frozen_during_the_handshake_then_killed() -> None:
    """Prefill's handshake meets a frozen decode: Failed within the RPC deadline, no hang."""
    with pair() as (_prefill, decode, p, d):
        assert run_request(p, d, "warm", 100, 0).ok  # the pair is known and verified
        os.kill(decode.proc.pid, signal.SIGSTOP)
        try:
            p.send("frozen", 1, 3000, decode.address)
            st = p.wait("frozen", 30)
            assert st.state is F and st.reason in (FailureReason.PEER_UNREACHABLE,
                                                   FailureReason.TIMEOUT,
                                                   FailureReason.PEER_FAILED), st
            # Ended by one of the short deadlines these tests configure (the RPC's 2 s,
            # Bootstrapping's 4 s): not by the peer channel's heartbeat silence (over
            # 10 s), nor a hang.
            assert re.search(r"no answer within 2 s \(deadline exceeded\)"
                             r"|no progress in Bootstrapping for 4\.0 s", st.detail), st
        finally:
            os.kill(decode.proc.pid, signal.SIGKILL)
        assert p.healthy()
        decode2 = start("decode")
        try:
            with KvbeamClient(decode2.address) as d2:
                assert run_request(p, d2, "elsewhere", 3000, 1).ok
        finally:
            decode2.stop()


def test_after_success_a_dying_peer_changes_nothing() -> None:
    """Bytes that landed stay landed: decode keeps Success (and its slot until Release)
    when prefill dies, and prefill keeps Success when decode dies."""
    with pair() as (prefill, decode, p, d):
        r = run_request(p, d, "landed", 5000, 2, release=False)
        assert r.ok, r
        prefill.kill()
        time.sleep(2.0)  # four heartbeat periods: a lost peer would have been noticed
        assert d.status("landed").state is S
        assert d.release("landed").state is S
        assert free_slots(d) == DECODE_SLOTS
    with pair() as (prefill, decode, p, d):
        assert run_request(p, d, "landed2", 5000, 2).ok
        decode.kill()
        time.sleep(2.0)
        assert p.status("landed2").state is S
        assert p.healthy()


def test_stalled_scheduler_between_chunks_times_out_on_both_sides() -> None:
    """The scheduler sends one chunk and never the rest: WaitingForInput's deadline ends it."""
    with pair() as (prefill, decode, p, d):
        d.reserve("stalled", 4000, prefill.address)
        p.send("stalled", 3, 4000, decode.address, final=False, chunks=[(0, 512)])
        dst, pst = d.wait("stalled", 30), p.wait("stalled", 30)
        assert dst.state is F and pst.state is F
        assert FailureReason.TIMEOUT in (dst.reason, pst.reason), (dst, pst)
        # The deadline that ended it is one these tests configure (WaitingForInput 4 s,
        # Transferring 6 s), named by both sides, not another, longer one.
        for st in (dst, pst):
            assert re.search(r"no progress in (WaitingForInput for 4|Transferring for 6)"
                             r"\.0 s", st.detail), (dst, pst)
        assert free_slots(d) == DECODE_SLOTS
        assert run_request(p, d, "next", 4000, 3).ok


def test_reserve_answers_while_its_prefill_is_frozen() -> None:
    """Reserve offers the reservation to prefill (protocol 2), but a frozen prefill must not
    make Reserve outlast the scheduler's own deadline (5 s), even with a long RPC timeout."""
    with pair(decode_extra=["--rpc-timeout-s", "8"]) as (prefill, _decode, p, d):
        assert run_request(p, d, "warm", 100, 0).ok  # decode now has a link to prefill
        os.kill(prefill.proc.pid, signal.SIGSTOP)
        try:
            d.reserve("while-frozen", 100, prefill.address)  # raises on its 5 s deadline
        finally:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        d.abort("while-frozen")


def test_reserve_flood_is_resource_exhausted_without_memory_growth() -> None:
    # The held reservations must outlive the flood (5,000 Reserves: seconds on a loaded
    # machine), or their lease frees the slots and the flood gets them.
    with pair(decode_extra=["--deadline-bootstrap-s", "600"]) as (prefill, decode, _p, d):
        for i in range(DECODE_SLOTS):
            d.reserve(f"hold-{i}", 100, prefill.address)

        def flood(n: int, tag: str) -> int:
            busy = 0
            with KvbeamClient(decode.address) as c:
                for i in range(n):
                    try:
                        c.reserve(f"{tag}-{i}", 100, prefill.address)
                    except Busy:
                        busy += 1
            return busy

        with ThreadPoolExecutor(4) as pool:  # warm up gRPC's and Python's allocators
            assert sum(pool.map(flood, [250] * 4, [f"w{i}" for i in range(4)])) == 1000
        before = rss_kib(decode.proc.pid)
        with ThreadPoolExecutor(8) as pool:
            busy = sum(pool.map(flood, [500] * 8, [f"f{i}" for i in range(8)]))
        after = rss_kib(decode.proc.pid)
        assert busy == 4000  # every one refused, none queued
        assert after - before < 16 * 1024, (before, after)  # KiB: no per-call growth
        assert decode.proc.poll() is None
        for i in range(DECODE_SLOTS):
            d.abort(f"hold-{i}")
        # A scheduler's abort frees the slot once prefill has confirmed it stopped
        # writing (a round trip to prefill), not when Abort returns.
        assert wait_until(lambda: free_slots(d) == DECODE_SLOTS, 10), free_slots(d)


def test_send_flood_past_max_inflight_is_resource_exhausted() -> None:
    """Prefill takes at most --max-inflight requests; the rest are refused at once."""
    with pair(prefill_extra=["--max-inflight", "4"]) as (_prefill, decode, p, d):
        os.kill(decode.proc.pid, signal.SIGSTOP)  # every accepted Send hangs in its handshake
        try:
            def send(i: int) -> bool:
                try:
                    p.send(f"flood-{i}", i % 8, 100, decode.address)
                    return True
                except Busy:
                    return False

            with ThreadPoolExecutor(8) as pool:
                accepted = sum(pool.map(send, range(40)))
            assert 1 <= accepted <= 4, accepted
        finally:
            os.kill(decode.proc.pid, signal.SIGCONT)
        # the accepted ones end (Failed or, with decode back, whatever decode decides)
        assert wait_until(lambda: _live_count(p) == 0, 30)
        assert run_request(p, d, "after-flood", 200, 0).ok


def _live_count(p: KvbeamClient) -> int:
    live = 0
    for i in range(40):
        try:
            if not p.status(f"flood-{i}").terminal:
                live += 1
        except Exception:  # never created (refused): not live
            continue
    return live


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_sigkill_mid_chunks_frees_everything_on_the_survivor(victim: str) -> None:
    """Killed between chunks: one chunk written, the final one not sent yet."""
    prefill, decode = start("prefill"), start("decode")
    try:
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            d.reserve("mid", 6000, prefill.address)
            p.send("mid", 4, 6000, decode.address, final=False, chunks=[(0, 1024)])
            assert wait_until(lambda: d.status("mid").state is TransferState.TRANSFERRING, 10)
            assert not p.status("mid").terminal
            (prefill if victim == "prefill" else decode).kill()
            survivor = d if victim == "prefill" else p
            st = survivor.wait("mid", 20)
            # Noticed at once, by the loss of the victim's connections, not at a
            # deadline (TIMEOUT: "no progress in ...").
            assert st.state is F and st.reason is FailureReason.PEER_FAILED, st
            assert survivor.healthy()
            if victim == "prefill":
                assert free_slots(d) == DECODE_SLOTS
    finally:
        prefill.stop()
        decode.stop()
