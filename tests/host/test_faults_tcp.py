"""Link faults over TCP on loopback: the daemon-side rules the RDMA fault tests rely on.

The same faults run over RDMA, with a veth wire and real queue pairs, in
tests/rdma/test_faults_rdma.py; these are the fast host versions:

- a write the receiver refuses (the test-only hook of kvbeam/server/faults.py) fails
  the request on both sides with the transport's status named, and the next request
  handshakes a new link;
- a reservation decode holds for the same prefill survives that new handshake (only
  the dead link's requests fail with it).
"""

from __future__ import annotations

from kvbeam.scheduler import drive, run_request
from kvbeam.server.faults import ENABLE_FLAG, OUTSIDE_MR_ENV
from kvbeam.states import TransferState
from tests.daemon_helpers import pair

S, F = TransferState.SUCCESS, TransferState.FAILED


def test_refused_write_fails_both_sides_and_the_link_is_rebuilt() -> None:
    with pair(prefill_extra=[ENABLE_FLAG],
              prefill_env={OUTSIDE_MR_ENV: "bad-"}) as (prefill, decode, p, d):
        assert run_request(p, d, "warm", 1000, 0).ok
        d.reserve("bystander", 2000, prefill.address)  # reserved, not sent yet
        d.reserve("bad-1", 2000, prefill.address)
        p.send("bad-1", 1, 2000, decode.address)
        pst = p.wait("bad-1", 20)
        dst = d.wait("bad-1", 20)
        assert pst.state is F and "TCP_REMOTE_ACCESS_ERR" in pst.detail, pst
        assert dst.state is F, dst
        assert "FAULT INJECTION ARMED" in prefill.output
        # The bystander's send handshakes a new link; decode must not fail the bystander
        # when it replaces the old link.
        p.send("bystander", 2, 2000, decode.address)
        assert d.wait("bystander", 20).state is S
        assert p.wait("bystander", 20).state is S
        d.release("bystander")
        assert run_request(p, d, "after", 3000, 3).ok
        assert prefill.output.count("verified and connected") == 2


def test_many_status_streams_do_not_starve_the_pair() -> None:
    # Every request's scheduler waits on decode with a WatchStatus stream, which holds one
    # of decode's 16 server threads: 16 at once must leave the pair working (its BeginWrite
    # and heartbeats go over the peer channel, the handshake over gRPC).
    with pair() as (prefill, decode, _p, _d):
        results = drive(prefill.address, decode.address, [2000] * 16, source_slots=8,
                        concurrency=16, timeout=60, prefix="many")
        assert all(r.ok for r in results), [r for r in results if not r.ok]
