"""When a failed heartbeat makes a peer lost: refusals fast, timeouts only after silence."""

from __future__ import annotations

import grpc

from kvbeam.server.daemon_servicer import MAX_MISSED_HEARTBEATS, heartbeat_lost

REFUSED = grpc.StatusCode.UNAVAILABLE
TIMED_OUT = grpc.StatusCode.DEADLINE_EXCEEDED


def test_refused_heartbeats_lose_the_peer_after_the_allowed_misses() -> None:
    assert not heartbeat_lost(REFUSED, MAX_MISSED_HEARTBEATS - 1, 0.5, 10.0)
    assert heartbeat_lost(REFUSED, MAX_MISSED_HEARTBEATS, 0.5, 10.0)


def test_timed_out_heartbeats_lose_the_peer_only_after_peer_timeout() -> None:
    # Many misses in a row on a loaded machine: still the same healthy peer.
    assert not heartbeat_lost(TIMED_OUT, 5 * MAX_MISSED_HEARTBEATS, 9.9, 10.0)
    assert heartbeat_lost(TIMED_OUT, 1, 10.0, 10.0)
