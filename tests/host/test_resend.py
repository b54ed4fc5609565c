"""A transient transport error does not fail a request: prefill resends it on a new link.

Real daemon processes on loopback (TCP transport). Prefill's test-only hook
``KVBEAM_FAULT_BREAK_LINK`` shuts the TCP data socket just before a write is posted,
as a dropped connection or an RC QP whose retries ran out would break it. With the
default ``--resend-retries 2`` one break costs one resend and the request succeeds,
XXH3-128-verified; with ``--resend-retries 0`` it fails at once with the transport's
detail; a break on every attempt fails it after two resends. Each case ends bounded
and leaks nothing (every slot reservable, no live transfer on either side).
"""

from __future__ import annotations

import re
import time

from kvbeam.client import KvbeamClient, Status
from kvbeam.procs import DaemonProcess
from kvbeam.scheduler import run_request
from kvbeam.server.faults import BREAK_LINK_ENV, ENABLE_FLAG
from kvbeam.states import FailureReason, TransferState
from tests.daemon_helpers import DECODE_SLOTS, free_slots, pair
from tests.metrics_helpers import Samples, scrape, settle, value
from tests.waiting import wait_until

METRICS = ["--metrics", "127.0.0.1:0"]
#: Prefill's flags: metrics and the fault hooks (KVBEAM_FAULT_BREAK_LINK).
PREFILL = [*METRICS, ENABLE_FLAG]


def _one(p: KvbeamClient, d: KvbeamClient, rid: str) -> tuple[Status, Status, float]:
    """Reserve, send and wait for a request on both sides: (prefill, decode, seconds)."""
    d.reserve(rid, 3000, p.address)
    t0 = time.monotonic()
    p.send(rid, 1, 3000, d.address)
    pst = p.wait(rid, 60)
    dst = d.wait(rid, 60)
    return pst, dst, time.monotonic() - t0


def _ended_by_prefill(dst: Status, took: float, prefill: DaemonProcess) -> None:
    """Decode failed because prefill's Abort told it, not by its Transferring deadline.

    The cause is asserted, not the time: under a loaded CI host the three handshakes
    of a resend can take seconds, which says nothing about who ended the request.
    """
    why = (dst, took, prefill.output[-3000:])  # prefill's log says whether it told decode
    assert dst.detail.startswith("prefill failed: "), why
    assert "no progress" not in dst.detail and "deadline" not in dst.detail, why


def _idle(metrics: str) -> Samples:
    """The daemon's metrics once no transfer is live on it."""
    return settle(metrics, lambda s: sum(v for (name, _l), v in s.items()
                                         if name == "kvbeam_transfers_live") == 0)


def _no_leak(prefill: DaemonProcess, decode: DaemonProcess, d: KvbeamClient) -> None:
    assert prefill.metrics and decode.metrics
    _idle(prefill.metrics)
    _idle(decode.metrics)
    assert free_slots(d) == DECODE_SLOTS


def test_a_broken_link_costs_one_resend_and_the_request_succeeds() -> None:
    with pair(decode_extra=METRICS, prefill_extra=PREFILL,
              prefill_env={BREAK_LINK_ENV: "1"}) as (prefill, decode, p, d):
        result = run_request(p, d, "rs-once", 3000, 1, timeout=60)
        assert result.ok, (result, prefill.output[-3000:])
        assert result.verified, result  # decode's XXH3-128 of what landed matched prefill's
        assert "FAULT INJECTED: broke link" in prefill.output
        assert wait_until(lambda: re.search(r"WARNING .*request rs-once: resend 1/2 on a new "
                                            r"link after a transport error: \S+",
                                            prefill.output) is not None, 10), \
            prefill.output[-3000:]
        assert prefill.metrics
        assert value(scrape(prefill.metrics), "kvbeam_resends_total") == 1
        assert "prefill resends it on a new link" in decode.output
        # The next request goes over the new link without a resend.
        assert run_request(p, d, "rs-after", 3000, 2, timeout=60).ok
        assert value(scrape(prefill.metrics), "kvbeam_resends_total") == 1
        _no_leak(prefill, decode, d)


def test_resend_retries_zero_fails_the_request_with_the_transport_detail() -> None:
    with pair(decode_extra=METRICS, prefill_extra=[*PREFILL, "--resend-retries", "0"],
              prefill_env={BREAK_LINK_ENV: "1"}) as (prefill, decode, p, d):
        pst, dst, took = _one(p, d, "rs-off")
        assert pst.state is TransferState.FAILED, pst
        assert pst.reason in (FailureReason.TRANSPORT_ERROR, FailureReason.PEER_FAILED), pst
        assert "TCP_CONNECTION_LOST" in pst.detail and "resend" not in pst.detail, pst
        assert dst.state is TransferState.FAILED, dst
        _ended_by_prefill(dst, took, prefill)
        assert prefill.metrics
        assert value(scrape(prefill.metrics), "kvbeam_resends_total") == 0
        _no_leak(prefill, decode, d)
        assert run_request(p, d, "rs-off-after", 3000, 2, timeout=60).ok


def test_a_link_broken_on_every_attempt_fails_after_the_retries_bounded() -> None:
    with pair(decode_extra=METRICS, prefill_extra=PREFILL,
              prefill_env={BREAK_LINK_ENV: "3:rs-always"}) as (prefill, decode, p, d):
        pst, dst, took = _one(p, d, "rs-always")
        assert pst.state is TransferState.FAILED, pst
        assert "TCP_CONNECTION_LOST" in pst.detail and "after 2 resends" in pst.detail, pst
        assert dst.state is TransferState.FAILED, dst
        _ended_by_prefill(dst, took, prefill)  # three attempts, each ended by its transport error
        assert prefill.metrics
        assert value(scrape(prefill.metrics), "kvbeam_resends_total") == 2
        assert prefill.output.count("FAULT INJECTED: broke link") == 3
        _no_leak(prefill, decode, d)
        assert run_request(p, d, "ok-after", 3000, 2, timeout=60).ok
