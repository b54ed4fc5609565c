"""Prefill and decode daemons over RDMA (soft-RoCE): the real path, end to end.

Each daemon is its own process with DSV4 target and draft pools from the shipped
configs; writes are RDMA WRITEs through pyverbs and decode reports Success only
after the WRITE WITH IMMEDIATE arrived and every moved buffer's XXH3-128 matched
prefill's digests. Under TCG a daemon start still costs tens of seconds (imports,
filling and registering its pools), so pairs are shared per module where the tests
allow it, and a test that needs a daemon of its own reuses the shared peer it can.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.errors import Busy
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.mailbox import record_size
from kvbeam.pools.spec import load_side_config
from kvbeam.procs import DaemonProcess
from kvbeam.scheduler import drive, run_request
from kvbeam.server.faults import CORRUPT_LANDED_ENV, ENABLE_FLAG, SEED_ENV
from kvbeam.states import FailureReason, TransferState
from tests.daemon_helpers import STARTUP_S, pair, spawn, start, start_both
from tests.fixtures import shipped_config
from tests.metrics_helpers import delta, scrape, settle, succeeded_once_more, value
from tests.rdma.conftest import RdmaDevice
from tests.waiting import wait_until

pytestmark = pytest.mark.rdma
F = TransferState.FAILED
Pair = tuple[DaemonProcess, DaemonProcess, KvbeamClient, KvbeamClient]


#: Decode's words for a peer whose process went: its peer channel's socket closed or
#: reset under it (server/peers/channel.py), as a SIGKILLed prefill's does at once.
CHANNEL_EOF = re.compile(r"^peer channel to prefill (?P<instance>\S+) at \S+ lost: "
                         r"(the peer closed the connection|receive failed: |send failed: )")
#: The shared pairs serve /metrics, so any test can check what the data plane counted.
METRICS = ["--metrics", "127.0.0.1:0"]


def _pair(paged: bool) -> Iterator[Pair]:
    with pair(paged=paged, transport="rdma", decode_extra=METRICS,
              prefill_extra=METRICS) as running:
        assert running[0].transport == running[1].transport == "rdma"
        yield running


@pytest.fixture(scope="module")
def unified(rdma_device: RdmaDevice) -> Iterator[Pair]:
    yield from _pair(paged=False)


@pytest.fixture(scope="module")
def paged(rdma_device: RdmaDevice) -> Iterator[Pair]:
    yield from _pair(paged=True)


def test_metrics_count_rdma_bytes_wrs_and_arrivals(unified: Pair) -> None:
    prefill, decode, p, d = unified
    p0, d0 = scrape(prefill.metrics), scrape(decode.metrics)
    assert run_request(p, d, "metered", 4096, 1, timeout=60, release=False).ok
    # Decode keeps the request's books until Release; prefill forgets them soon after
    # Success (its status then says 0), so decode's figure is the plan's byte total.
    total = d.status("metered").bytes_total
    assert total > 0

    p1 = settle(prefill.metrics, succeeded_once_more(p0), 30)
    d1 = settle(decode.metrics, succeeded_once_more(d0), 30)
    # The wire also carried the request's digest record (protocol 5), into decode's
    # mailbox: the plan's bytes and one record.
    record = record_size(len(build_side_layout(
        load_side_config(shipped_config("prefill"))).flat_buffers))
    assert delta(p1, p0, "kvbeam_transport_sent_bytes_total") == total + record
    assert delta(p1, p0, "kvbeam_transport_sent_blocks_total") > 0
    assert delta(p1, p0, "kvbeam_transport_posted_wrs_total") > 0  # slices + the IMM marker
    assert value(p1, "kvbeam_transport_inflight_wrs") == 0
    assert value(p1, "kvbeam_transport_inflight_writes") == 0
    assert delta(p1, p0, "kvbeam_request_bytes_total") == total
    assert not [k for k in p1 if k[0] == "kvbeam_transport_link_failures_total"]
    assert delta(d1, d0, "kvbeam_transport_notifications_total") == 1
    assert delta(d1, d0, "kvbeam_request_bytes_total") == total
    assert ("kvbeam_transport_received_bytes_total", ()) not in d1  # RDMA: invisible here
    assert delta(d1, d0, "kvbeam_slots_reserved") == 1
    d.release("metered")
    held = value(scrape(decode.metrics), "kvbeam_slots_reserved")
    assert held == value(d0, "kvbeam_slots_reserved")


def _fifty(pair: Pair, prefix: str) -> None:
    prefill, decode, _, _ = pair
    rng = random.Random(prefix)
    lens = [rng.randint(1, 32768) for _ in range(50)]
    results = drive(prefill.address, decode.address, lens, source_slots=8, concurrency=8,
                    timeout=120, prefix=prefix)
    bad = [r for r in results if not r.ok]
    assert not bad, bad
    assert "XXH3-128 mismatch" not in decode.output
    assert "verified and connected (rdma)" in decode.output


def test_fifty_concurrent_requests_unified(unified: Pair) -> None:
    _fifty(unified, "uni")


def test_fifty_concurrent_requests_paged(paged: Pair) -> None:
    _fifty(paged, "pag")


def test_reserve_when_full_and_abort_frees(unified: Pair) -> None:
    prefill, _, _, d = unified
    for i in range(16):
        d.reserve(f"full-{i}", 64, prefill.address)
    with pytest.raises(Busy):
        d.reserve("full-x", 64, prefill.address)
    for i in range(16):
        assert d.abort(f"full-{i}").state is F
    assert wait_until(lambda: _reserve_ok(d, prefill.address), 10)


def _reserve_ok(d: KvbeamClient, prefill: str) -> bool:
    try:
        d.reserve(f"probe-{time.monotonic_ns()}", 64, prefill)
    except Busy:
        return False
    return True


def test_abort_from_either_side_mid_transfer(unified: Pair) -> None:
    prefill, decode, p, d = unified
    # prefill side: a chunk is written, then the request is aborted on prefill
    d.reserve("mid-p", 4096, prefill.address)
    p.send("mid-p", 1, 4096, decode.address, final=False, chunks=[(0, 1024)])
    assert wait_until(lambda: d.status("mid-p").state is TransferState.TRANSFERRING, 30)
    p.abort("mid-p", "engine cancelled")
    st = d.wait("mid-p", 30)
    assert st.state is F and st.reason is FailureReason.PEER_FAILED
    # decode side: aborted on decode while prefill is mid-request; prefill learns it
    d.reserve("mid-d", 4096, prefill.address)
    p.send("mid-d", 2, 4096, decode.address, final=False, chunks=[(0, 1024)])
    assert wait_until(lambda: d.status("mid-d").state is TransferState.TRANSFERRING, 30)
    d.abort("mid-d", "scheduler gave up")
    pst = p.wait("mid-d", 30)
    assert pst.state is F and "scheduler gave up" in pst.detail
    assert run_request(p, d, "after-aborts", 2048, 3, timeout=60).ok


def test_kill_prefill_then_decode_restart(rdma_device: RdmaDevice) -> None:
    # The second prefill starts with the pair (start-ups overlap); it serves only after
    # the first one is killed.
    spare = spawn("prefill", transport="rdma")
    try:
        prefill, decode = start_both(transport="rdma")
    except BaseException:
        spare.proc.kill()
        raise
    try:
        with KvbeamClient(decode.address) as d, KvbeamClient(prefill.address) as p:
            assert run_request(p, d, "warm", 1000, 0, timeout=60).ok
            d.reserve("victim", 8000, prefill.address)
            p.send("victim", 0, 8000, decode.address, final=False, chunks=[(0, 512)])
            assert wait_until(lambda: d.status("victim").state is TransferState.TRANSFERRING, 30)
            prefill.kill()
            st = d.wait("victim", 30)
            # Noticed at once, by prefill's peer channel closing with its process (EOF or
            # a reset on its socket), not by the channel's heartbeat silence (11 s here:
            # "peer stopped answering heartbeats") nor at the Transferring deadline
            # (TIMEOUT: "no progress in Transferring").
            assert st.state is F and st.reason is FailureReason.PEER_FAILED, str(st)
            eof = CHANNEL_EOF.search(st.detail)
            assert eof and eof["instance"] == prefill.instance_id, st.detail
            for i in range(16):  # every slot back
                d.reserve(f"back-{i}", 10, "127.0.0.1:1")
            for i in range(16):  # and free again for the second half
                d.abort(f"back-{i}")
        # now decode dies with a request in flight from a new prefill; prefill fails, and a
        # restarted decode on the same address handshakes again and serves
        prefill.stop()
        prefill = spare.ready(STARTUP_S)
        address = decode.address
        with KvbeamClient(prefill.address) as p:
            with KvbeamClient(decode.address) as d:
                d.reserve("doomed", 8000, prefill.address)
                p.send("doomed", 1, 8000, decode.address, final=False, chunks=[(0, 512)])
                assert wait_until(
                    lambda: d.status("doomed").state is TransferState.TRANSFERRING, 30)
            decode.kill()
            pst = p.wait("doomed", 30)
            assert pst.state is F
            decode = start("decode", transport="rdma", listen=address)
            with KvbeamClient(decode.address) as d:
                assert run_request(p, d, "reborn", 4096, 2, timeout=60).ok
    finally:
        if spare.proc.poll() is None and spare.proc is not prefill.proc:
            spare.proc.kill()
            spare.proc.wait(10)
        prefill.stop()
        decode.stop()


def test_mismatched_pair_is_refused_before_any_qp_connects(unified: Pair, paged: Pair) -> None:
    # The unified prefill against the paged pair's decode (a daemon start saved).
    prefill, _, p, _ = unified
    paged_prefill, decode, pp, d = paged
    d.reserve("mismatch", 100, prefill.address)
    p.send("mismatch", 0, 100, decode.address)
    st = p.wait("mismatch", 60)
    assert st.state is F and st.reason is FailureReason.INCOMPATIBLE
    assert "prefill and decode pools differ in unified-KV mode" in st.detail
    assert d.wait("mismatch", 30).state is F
    # decode creates a link (a QP) only for a verified peer: none to this prefill
    links = [ln for ln in decode.output.splitlines() if "verified and connected" in ln]
    assert not [ln for ln in links if prefill.instance_id in ln]
    assert [ln for ln in links if paged_prefill.instance_id in ln]
    assert "differ in unified-KV mode" in decode.output
    # the refusal left the paged pair serving
    assert run_request(pp, d, "after-mismatch", 2048, 1, timeout=60).ok


def test_corruption_after_landing_is_caught_every_time(unified: Pair) -> None:
    """The integrity check over RDMA: decode flips a landed byte in every request (test-only
    fault hook) and every one ends Failed(integrity); none passes as Success."""
    env = {CORRUPT_LANDED_ENV: "1", SEED_ENV: "3"}
    prefill = unified[0]  # only decode needs the hook: the shared prefill sends
    decode = start("decode", transport="rdma", extra=[ENABLE_FLAG], env=env)
    try:
        with KvbeamClient(decode.address) as d:
            results = drive(prefill.address, decode.address, [64, 5000, 32768],
                            source_slots=8, concurrency=3, timeout=120, prefix="rot")
            assert all(r.state.startswith("Failed(integrity") for r in results), results
            assert decode.output.count("FAULT INJECTED: corrupted") == 3
            for r in results:
                assert d.status(r.request_id).reason is FailureReason.INTEGRITY
    finally:
        decode.stop()


def test_sub_batches_are_marked_over_two_qps_and_verified_as_they_land(
        rdma_device: RdmaDevice) -> None:
    """Protocol 6 over RDMA with two QPs per link: each sub-batch's WRITE WITH IMMEDIATE
    (its mark) follows its own writes on both lanes, decode digests it at once, and every
    request is Success only after its last part's check; none is refused or lost."""
    two = ["--qps-per-peer", "2"]
    with pair(transport="rdma", prefill_extra=two,
              decode_extra=[*two, "--verify-sub-batch-mib", "0.0625"]) as (
            prefill, decode, _p, d):
        results = drive(prefill.address, decode.address, [64, 5000, 32768, 32768],
                        source_slots=8, concurrency=3, timeout=120, prefix="sub")
        assert all(r.ok and r.verified for r in results), results
        for r in results:
            assert d.status(r.request_id).detail.startswith("XXH3-128 verified")
        assert prefill.output.count("sub-batches marked before the last") == 4
        assert wait_until(lambda: decode.output.count(
            "sub-batches digested as they landed") == 4, 10), decode.output[-3000:]
