"""Decode forgot prefill's connection (its engine re-attached): the request goes on."""

from __future__ import annotations

from kvbeam.server.core.prefill import GRANT_RENEW_S
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.states import FailureReason, TransferState
from tests.core_fakes import FakeDecode, FakeLink, prefill_core, slot_lists, wait_for
from tests.fake_clock import FakeClock
from tests.unit.test_core_resend import ADDR, _link


def _connected() -> tuple[PrefillDriver, FakeDecode, FakeLink]:
    """A core whose connection to ADDR served one request; decode then forgets it."""
    core, fake = prefill_core(integrity=False)
    core.send("r0", 300, ADDR, [], True, indices=slot_lists(core, 0, 300))
    link = _link(core)
    assert wait_for(lambda: len(link.writes) == 1)
    core.on_event(link.completion(link.writes[0][0]))
    assert core.status("r0").state is TransferState.SUCCESS
    fake.forgot.add(link.id)
    return core, fake, link


def test_a_refused_first_begin_write_handshakes_again_and_the_request_succeeds() -> None:
    core, fake, old = _connected()
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 1, 300))
    new = _link(core, not_=old)
    assert wait_for(lambda: len(new.writes) == 1)
    core.on_event(new.completion(new.writes[0][0]))
    assert core.status("r").state is TransferState.SUCCESS
    assert fake.connects == [ADDR, ADDR] and old.released and old.writes[1:] == []
    assert [link for rid, link in fake.begins if rid == "r"] == [new.id]
    assert fake.aborts == []


def test_a_second_refusal_fails_the_request_as_the_peer_failed_after_one_handshake() -> None:
    core, fake, _old = _connected()
    fake.unreserved.add("r")  # decode restarted: the reservation went with it
    core.send("r", 300, ADDR, [], True, indices=slot_lists(core, 1, 300))
    assert wait_for(lambda: core.status("r").state is TransferState.FAILED)
    st = core.status("r")
    assert st.reason is FailureReason.PEER_FAILED, st
    assert "restarted or dropped" in st.detail and "after handshaking again" in st.detail
    assert fake.connects == [ADDR, ADDR]


def test_a_request_that_wrote_already_fails_at_once_without_a_new_handshake() -> None:
    clock = FakeClock()
    core, fake = prefill_core(integrity=False, clock=clock)
    core.send("r", 1000, ADDR, [(0, 256)], False, indices=slot_lists(core, 0, 1000))
    link = _link(core)
    assert wait_for(lambda: len(link.writes) == 1)
    core.on_event(link.completion(link.writes[0][0]))
    fake.forgot.add(link.id)
    clock.advance(GRANT_RENEW_S)  # the first piece's grant is stale: the next piece asks
    core.send("r", 1000, ADDR, [], True, indices=slot_lists(core, 0, 1000))
    assert wait_for(lambda: core.status("r").state is TransferState.FAILED)
    st = core.status("r")
    assert st.reason is FailureReason.PEER_FAILED and "restarted" in st.detail, st
    assert fake.connects == [ADDR]
