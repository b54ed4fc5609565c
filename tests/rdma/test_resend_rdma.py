"""A QP broken once does not fail the request: prefill resends it on a new QP pair.

Runs on the fault tests' daemon pair (two rxe devices joined by a veth wire, see
tests/rdma/netfaults.py). Prefill's test-only hook ``KVBEAM_FAULT_BREAK_LINK`` (armed
by the fixture for the first request whose id starts with ``qpbreak-``) moves the QP
to the error state just before the request's write is posted, as an RC QP whose
retries ran out under load would be: the write fails with a verbs status, prefill
handshakes a new QP pair, resends with a new BeginWrite, and the request succeeds,
XXH3-128-verified, with nothing leaked (one QP per daemon, every slot free).
"""

from __future__ import annotations

import re
import time

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.scheduler import run_request
from tests.daemon_helpers import DECODE_SLOTS, free_slots
from tests.rdma.conftest import WirePair
from tests.rdma.test_faults_rdma import one_qp_each
from tests.waiting import wait_until

pytestmark = pytest.mark.rdma
RESEND = re.compile(r"request (\S+): resend (\d)/\d on a new link after a transport error: "
                    r"([^\n]+)")


def test_a_qp_broken_once_is_resent_and_the_request_succeeds(wire_pair: WirePair) -> None:
    pair = wire_pair
    # Resends before this test (the soak's, when it ran first on this pair): the figure
    # for the closing note.
    before = RESEND.findall(pair.prefill.output)
    soak = [m for m in before if m[0].startswith("soak-")]
    print(f"RESENDS before this test: {len(before)} (soak requests: {len(soak)}): {before}")
    with KvbeamClient(pair.prefill.address) as p, KvbeamClient(pair.decode.address) as d:
        assert run_request(p, d, "rs-warm", 2048, 0, timeout=120).ok
        qp_before = one_qp_each(pair)
        t0 = time.monotonic()
        result = run_request(p, d, "qpbreak-1", 8192, 1, timeout=120)
        took = time.monotonic() - t0
        print(f"FAULT QP broken once: decode {result.state}, prefill {result.prefill_state} "
              f"after {took:.2f}s")
        assert result.ok and result.verified, result
        assert "FAULT INJECTED: broke link" in pair.prefill.output
        assert wait_until(lambda: len(RESEND.findall(pair.prefill.output)) > len(before), 10)
        mine = [m for m in RESEND.findall(pair.prefill.output) if m[0].startswith("qpbreak-")]
        assert len(mine) == 1 and mine[0][1] == "1", mine
        # The broken QP was found at once, by the device's answer (a work completion's
        # status), not by the transport's own write deadline (TIMEOUT, or the QP state it
        # found: "no completion within 8 s"). The answer is the write's own completion (or
        # its post's refusal), or, when the link's service polls first, the flushed receive
        # WRs' (IBV_WC_WR_FLUSH_ERR), which fail the link either before the write is posted
        # ("link unusable: link N failed (IBV_WC_...)") or while it is in flight ("link
        # failed: IBV_WC_WR_FLUSH_ERR: ..."): each names a verbs status.
        cause = mine[0][2]
        assert "TIMEOUT" not in cause and "no completion within" not in cause, mine
        assert "IBV_WC_" in cause or "POST_SEND_FAILED" in cause, mine
        assert "prefill resends it on a new link" in pair.decode.output
        qp_after = one_qp_each(pair)
        assert qp_after[0] != qp_before[0] and qp_after[1] != qp_before[1], (qp_before,
                                                                             qp_after)
        assert wait_until(lambda: free_slots(d) == DECODE_SLOTS, 30)
        assert run_request(p, d, "qpbreak-after", 4096, 2, timeout=120).ok
