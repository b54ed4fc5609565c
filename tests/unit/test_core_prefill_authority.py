"""Who may report decode's verdict to prefill: prefill's Abort handler takes a
``from_peer`` Abort only from the request's own decode (the rule decode applies to
prefill's Aborts, tests/unit/test_core_decode_authority.py)."""

from __future__ import annotations

from typing import cast

from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.server.state.peers import PeerConn
from kvbeam.states import FailureReason, TransferState
from tests.core_fakes import FakeLink, prefill_core, slot_lists, wait_for

ADDR = "127.0.0.1:9"
SEQ = 300


def _in_flight() -> tuple[PrefillDriver, PeerConn]:
    """A prefill core with request "r" posted to decode at ADDR (its writes in flight)."""
    core, fake = prefill_core(drain_s=0.2, integrity=False)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 0, SEQ))
    assert wait_for(lambda: len(fake.begins) == 1)
    conn = core.peers.by_address(ADDR)
    assert conn is not None
    assert wait_for(lambda: len(cast(FakeLink, conn.link).writes) == 1)
    return core, conn


def test_a_verdict_from_another_decode_instance_is_a_schedulers_abort() -> None:
    core, _conn = _in_flight()
    st = core.abort("r", from_peer=True, detail="decode says failed",
                    wait_s=0.0, instance_id="intruder", caller_refusal=lambda _a: None)
    assert st.state is TransferState.FAILED and st.reason is FailureReason.ABORTED, st


def test_a_verdict_whose_caller_may_not_speak_for_the_decode_is_a_schedulers_abort() -> None:
    core, conn = _in_flight()
    st = core.abort("r", from_peer=True, detail="decode says failed",
                    wait_s=0.0, instance_id=conn.instance_id,
                    caller_refusal=lambda address: f"not {address}")
    assert st.state is TransferState.FAILED and st.reason is FailureReason.ABORTED, st


def test_the_requests_own_decode_reports_its_verdict() -> None:
    core, conn = _in_flight()
    st = core.abort("r", from_peer=True, detail="decode says failed",
                    wait_s=0.0, instance_id=conn.instance_id, caller_refusal=lambda _a: None)
    assert st.state is TransferState.FAILED and st.reason is FailureReason.PEER_FAILED, st
