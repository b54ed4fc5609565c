"""Decode-initiated pairing: what prefill answers a Connect whose handshake failed, and
what decode makes of the answer (fail its reservations, or let them wait)."""

from __future__ import annotations

import grpc
import pytest

from kvbeam.errors import (
    Busy,
    PeerUnavailableError,
    PoolCompatibilityError,
    TransportError,
)
from kvbeam.server.api.prefill import connect_code
from kvbeam.server.peers.calls import connect_refusal
from kvbeam.states import FailureReason
from tests.unit.test_rpc_errors import FakeRpcError as _Answer

ADDR = "10.0.0.1:7000"
QP_DOWN = ("cannot connect QP 26 to ::ffff:10.10.0.2 QP 26: Failed to modify QP state to "
           "RTR. Errno: 101, Network is unreachable")


@pytest.mark.parametrize(("exc", "code"), [
    (TransportError(QP_DOWN), grpc.StatusCode.UNAVAILABLE),
    (PeerUnavailableError("decode did not answer", address=ADDR), grpc.StatusCode.UNAVAILABLE),
    (PoolCompatibilityError("block size differs"), grpc.StatusCode.FAILED_PRECONDITION),
    (Busy("handshakes"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RuntimeError("a bug"), grpc.StatusCode.INTERNAL),
])
def test_prefill_answers_each_handshake_failure_with_its_status(
        exc: Exception, code: grpc.StatusCode) -> None:
    assert connect_code(exc) is code


def test_a_data_link_that_cannot_connect_leaves_the_reservations_waiting() -> None:
    """A partition of the data path (a port down) while decode asked: nothing is wrong
    with the pair, so its reservations wait for the Send's handshake or their deadline
    (the RDMA fault test reserves during a partition and sends after it heals)."""
    refusal = connect_refusal(_Answer(grpc.StatusCode.UNAVAILABLE,
                                      f"TransportError: {QP_DOWN}"), ADDR, 24.0)
    assert refusal.retry and refusal.reason is FailureReason.PEER_UNREACHABLE
    assert "could not connect its data link" in str(refusal) and QP_DOWN in str(refusal)


def test_a_decode_prefill_cannot_reach_fails_the_reservations() -> None:
    refusal = connect_refusal(_Answer(grpc.StatusCode.UNAVAILABLE,
                                      "PeerUnavailableError: decode did not answer"), ADDR, 24.0)
    assert not refusal.retry and refusal.reason is FailureReason.PEER_UNREACHABLE
    refused = connect_refusal(_Answer(grpc.StatusCode.FAILED_PRECONDITION,
                                      "PoolCompatibilityError: block size"), ADDR, 24.0)
    assert not refused.retry and refused.reason is FailureReason.INCOMPATIBLE
