"""The peer channel between real daemons over TCP (protocol 4, server/peer_channel.py).

The frames and the channel's own states are unit-tested in
tests/unit/test_peer_channel.py; here two daemons use it: per-request calls go over it,
and its loss (a killed peer, no heartbeat involved) fails that peer's requests at once.
"""

from __future__ import annotations

from kvbeam.client import KvbeamClient
from kvbeam.procs import wait_until
from kvbeam.scheduler import run_request
from kvbeam.states import FailureReason, TransferState
from tests.daemon_helpers import DECODE_SLOTS, free_slots, pair, start

F = TransferState.FAILED
#: Heartbeats (gRPC or on the channel) far apart: only the channel's closing can tell.
NO_BEATS = ["--heartbeat-s", "3600"]


def test_per_request_calls_go_over_the_peer_channel() -> None:
    with pair() as (prefill, decode, p, d):
        for i in range(3):
            assert run_request(p, d, f"chan-{i}", 500, i).ok
        assert "verified and connected (tcp, peer channel)" in prefill.output, \
            prefill.output[-3000:]
        bound = [line for line in decode.output.splitlines()
                 if "peer channel from prefill" in line and "bound" in line]
        assert len(bound) == 1, decode.output[-3000:]  # one channel for the pair
        # Nothing went over the RPCs: no daemon-to-daemon gRPC call was refused or
        # fell back (a fallback would log neither, so check the offers were used).
        assert "offer of" not in decode.output, decode.output[-3000:]


def test_a_killed_prefill_fails_decodes_offered_request_at_once() -> None:
    """Decode offered a reservation to prefill; prefill is SIGKILLed: the channel's EOF
    fails the request with peer_failed (without the channel: its lease, timeout)."""
    decode = start("decode", extra=NO_BEATS)
    try:
        prefill = start("prefill", extra=NO_BEATS)
        with KvbeamClient(decode.address) as d, KvbeamClient(prefill.address) as p:
            assert run_request(p, d, "warm", 500, 0).ok  # the pair has its channel
            assert "peer channel from prefill" in decode.output, decode.output[-3000:]
            d.reserve("offered", 2000, prefill.address)
            prefill.kill()
            st = d.wait("offered", 20)
            logs = f"{st}\n--- decode ---\n{decode.output[-4000:]}\n--- prefill ---\n" \
                   f"{prefill.output[-4000:]}"
            assert st.state is F and st.reason is FailureReason.PEER_FAILED, logs
            assert "peer channel" in st.detail, logs
            assert free_slots(d, prefill.address) == DECODE_SLOTS
    finally:
        decode.stop()


def test_a_killed_decode_is_noticed_by_prefill_and_the_next_decode_serves() -> None:
    prefill = start("prefill", extra=NO_BEATS)
    try:
        decode = start("decode", extra=NO_BEATS)
        with KvbeamClient(prefill.address) as p:
            with KvbeamClient(decode.address) as d:
                assert run_request(p, d, "warm", 500, 0).ok
            decode.kill()
            decode2 = start("decode", extra=NO_BEATS)
            try:
                with KvbeamClient(decode2.address) as d2:
                    assert run_request(p, d2, "after", 500, 1).ok
            finally:
                decode2.stop()
        # The killed decode's channel closed without a BYE: prefill dropped that peer.
        assert wait_until(lambda: "closed: the peer closed the connection" in prefill.output,
                          10), prefill.output[-3000:]
    finally:
        prefill.stop()
