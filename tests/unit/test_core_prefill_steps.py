"""Prefill's send path driven one event at a time: no threads, no sleeps.

The executor is a queue that runs nothing until the test says so and the digests run
inline, so each test chooses the interleaving of a Send, decode's Offer, a step, a
completion and a link failure, and asserts what the core did (its writes, BeginWrites,
its request's phase) after each. These are the races the request's explicit phase
(:class:`kvbeam.server.core.outgoing.Step`) settles: one step per request at a time,
an Offer never lost, a resend only once the running step and every write are done.
"""

from __future__ import annotations

from typing import cast

import pytest

from kvbeam.pools.indices import request_indices
from kvbeam.server.core import prefill as prefill_module
from kvbeam.server.core.outgoing import Outgoing, Step
from kvbeam.server.core.ports import WriteGrant
from kvbeam.server.core.prefill_driver import PrefillDriver
from kvbeam.states import TransferState
from tests.core_fakes import FakeDecode, FakeLink, prefill_core, slot_lists
from tests.fake_clock import FakeClock
from tests.fixtures import UNIFIED_TARGET
from tests.unit.test_core_decode import QueueExecutor

ADDR = "127.0.0.1:9"
SEQ = 300
LONG = 700


def _core(**kw: object) -> tuple[PrefillDriver, FakeDecode, QueueExecutor]:
    io = QueueExecutor()
    core, fake = prefill_core(io=io, digest_threads=0, **kw)  # type: ignore[arg-type]
    return core, fake, io


def _rec(core: PrefillDriver, rid: str = "r") -> Outgoing:
    return core.core._out[rid]


def _step(core: PrefillDriver, rid: str = "r") -> Step:
    return _rec(core, rid).step


def _offer(core: PrefillDriver, fake: FakeDecode, tid: int, rid: str = "r",
           seq_len: int = SEQ) -> bool:
    conn = core.peers.by_address(ADDR)
    assert conn is not None
    grant = WriteGrant(tid, request_indices(UNIFIED_TARGET, 2, seq_len), mailbox_slot=3)
    return core.offer(rid, conn.instance_id, seq_len, grant, lease_s=10.0)


def _connected(core: PrefillDriver, io: QueueExecutor) -> FakeLink:
    """The pair connected by a first request (asked with BeginWrite), landed."""
    core.send("first", SEQ, ADDR, [], True, indices=slot_lists(core, 0, SEQ))
    io.run_all()
    link = _link(core)
    for event in link.finish(link.writes[0][0]):
        core.on_event(event)
    return link


def _link(core: PrefillDriver) -> FakeLink:
    conn = core.peers.by_address(ADDR)
    assert conn is not None
    return cast(FakeLink, conn.link)


def test_an_offer_while_a_step_parks_runs_the_step_once_more_not_twice() -> None:
    core, fake, io = _core(send_wait_s=5.0)
    fake.not_yet.add("r")  # decode has not reserved it: BeginWrite is refused
    real = fake.begin_write

    def begin_then_offer(*args: object, **kw: object) -> WriteGrant:
        # decode's Offer lands while the step waits for BeginWrite's refusal
        assert _offer(core, fake, 32)
        assert not io.queue and _step(core) is Step.RUNNING, "the Offer started a step"
        return real(*args, **kw)  # type: ignore[arg-type]

    fake.begin_write = begin_then_offer  # type: ignore[method-assign]
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    io.run_all()  # handshake, then the step: BeginWrite refused, the offer in the book
    assert fake.refused_not_yet == ["r"]
    link = _link(core)
    # The step's end found the offer and ran once more: it wrote with the offer's id.
    assert link.writes == [(32, True)]
    assert core.status("r").state is TransferState.TRANSFERRING
    assert _step(core) is Step.IDLE and not io.queue
    for event in link.finish(32):
        core.on_event(event)
    assert core.status("r").state is TransferState.SUCCESS


def test_an_offer_after_the_send_parked_writes_on_the_offers_thread() -> None:
    core, fake, io = _core(send_wait_s=5.0)
    core.send("first", SEQ, ADDR, [], True,
              indices=slot_lists(core, 0, SEQ))  # connects the pair (by BeginWrite)
    io.run_all()
    link = _link(core)
    for event in link.finish(link.writes[0][0]):
        core.on_event(event)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    # Connected, no offer yet: it parks at once, with no step at all.
    assert _step(core) is Step.PARKED and not io.queue
    assert core.status("r").state is TransferState.WAITING_FOR_INPUT
    assert _offer(core, fake, 48)
    # The Offer's thread ran the small step inline: posted, nothing left for the executor.
    assert link.writes[-1] == (48, True) and not io.queue
    assert _step(core) is Step.IDLE
    assert not _offer(core, fake, 64), "a second offer of a writing request was kept"
    assert link.writes[-1] == (48, True)
    assert [rid for rid, _ in fake.begins] == ["first"]


def test_the_grace_asks_a_parked_send_with_begin_write_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    core, fake, io = _core(send_wait_s=5.0)
    core.send("first", SEQ, ADDR, [], True, indices=slot_lists(core, 0, SEQ))
    io.run_all()
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    assert _step(core) is Step.PARKED
    core.periodic()  # within the grace: it keeps waiting for the Offer
    assert _step(core) is Step.PARKED and not io.queue
    monkeypatch.setattr(prefill_module, "OFFER_GRACE_S", 0.0)
    core.periodic()
    assert _step(core) is Step.RUNNING and _rec(core).asked
    core.periodic()  # asked already: the sweep does not start it again
    assert len(io.queue) == 1
    io.run_all()
    assert [rid for rid, _ in fake.begins] == ["first", "r"]
    assert _step(core) is Step.IDLE
    assert core.status("r").state is TransferState.TRANSFERRING


def test_an_abort_of_a_parked_send_leaves_no_step_for_a_late_offer() -> None:
    core, fake, io = _core(send_wait_s=5.0)
    core.send("first", SEQ, ADDR, [], True, indices=slot_lists(core, 0, SEQ))
    io.run_all()
    writes = len(_link(core).writes)
    core.send("r", SEQ, ADDR, [], True, indices=slot_lists(core, 1, SEQ))
    assert _step(core) is Step.PARKED
    core.abort("r", from_peer=False, detail="client went away")
    assert core.status("r").state is TransferState.FAILED
    io.run_all()  # the Abort to decode (nothing of it was in flight)
    assert fake.aborts == ["r"]
    _offer(core, fake, 80)  # decode's reservation, too late: refused
    assert _step(core) is Step.IDLE and len(_link(core).writes) == writes
    io.run_all()  # and aborted again: decode holds a reservation now
    assert fake.aborts == ["r", "r"]


def test_a_link_failure_during_a_queued_step_resends_every_chunk_in_order_after_it() -> None:
    clock = FakeClock()
    core, fake, io = _core(resend_retries=1, clock=clock)
    core.send("r", SEQ, ADDR, [(0, 256)], False, indices=slot_lists(core, 0, SEQ))
    io.run_all()  # handshake, BeginWrite, the first chunk posted (unnotified)
    first = _link(core)
    tid = first.writes[0][0]
    assert first.writes == [(tid, False)] and _step(core) is Step.IDLE
    clock.advance(prefill_module.GRANT_RENEW_S)  # a stale grant: the step asks, on the executor
    core.send("r", SEQ, ADDR, [(256, SEQ)], True, indices=slot_lists(core, 0, SEQ))
    assert _step(core) is Step.RUNNING and len(io.queue) == 1  # its step, not run yet
    # The first chunk's write fails: a resend is owed, but a step is queued.
    core.on_event(first.completion(tid, ok=False, status="IBV_WC_RETRY_EXC_ERR"))
    rec = _rec(core)
    assert rec.resend_owed and rec.resends == 0
    assert _step(core) is Step.RUNNING, "the resend started beside the queued step"
    io.run_all()  # the step stops for the resend; the resend handshakes and replays
    assert rec.resends == 1 and first.released
    second = _link(core)
    assert second is not first
    assert [link for _, link in fake.begins] == [first.id, second.id]
    new = second.writes[0][0]
    # The replayed first chunk and the final chunk as one step (the newest covers the
    # first), with its record, on the new link.
    assert second.writes == [(new, True)]
    assert _step(core) is Step.IDLE and core.status("r").state is TransferState.TRANSFERRING
    for event in second.finish(new):
        core.on_event(event)
    assert core.status("r").state is TransferState.SUCCESS


def test_a_request_in_pieces_asks_begin_write_once_a_second_not_per_piece() -> None:
    clock = FakeClock()
    core, fake, io = _core(clock=clock)  # three pages, a piece each
    core.send("r", LONG, ADDR, [(0, 256)], False, indices=slot_lists(core, 0, LONG))
    io.run_all()  # handshake, BeginWrite, the first piece
    link = _link(core)
    assert fake.begins == [("r", link.id)] and len(link.writes) == 1
    clock.advance(0.5)
    core.send("r", LONG, ADDR, [(256, 512)], False, indices=slot_lists(core, 0, LONG))
    io.run_all()
    # Under the first piece's grant, on the same link: no second ask.
    assert fake.begins == [("r", link.id)] and len(link.writes) == 2
    assert link.writes[1][0] == link.writes[0][0], "a piece under another transfer id"
    clock.advance(prefill_module.GRANT_RENEW_S)
    core.send("r", LONG, ADDR, [(512, LONG)], True, indices=slot_lists(core, 0, LONG))
    io.run_all()
    # The grant is a second old: the final piece asks again (decode's sign of progress).
    assert fake.begins == [("r", link.id)] * 2
    tid = link.writes[0][0]
    for event in link.finish(tid):
        core.on_event(event)
    assert core.status("r").state is TransferState.SUCCESS


def test_pieces_that_all_came_before_decode_reserved_go_under_its_offer_unasked() -> None:
    # A router that asks decode only once prefill answered: every piece comes before
    # decode's reservation. The first parks at once (no BeginWrite that decode would
    # refuse), the rest queue behind it, and decode's Offer writes the whole request
    # under the offer's grant, as for a whole Send.
    core, fake, io = _core(send_wait_s=5.0)
    link = _connected(core, io)
    core.send("r", LONG, ADDR, [(0, 256)], False, indices=slot_lists(core, 0, LONG))
    assert _step(core) is Step.PARKED and not io.queue
    core.send("r", LONG, ADDR, [(256, 512)], False, indices=slot_lists(core, 0, LONG))
    core.send("r", LONG, ADDR, [(512, LONG)], True, indices=slot_lists(core, 0, LONG))
    assert _step(core) is Step.PARKED and not io.queue
    assert _offer(core, fake, 96, seq_len=LONG)
    io.run_all()
    assert [rid for rid, _ in fake.begins] == ["first"] and not fake.refused_not_yet
    assert {tid for tid, _ in link.writes[1:]} == {96}
    for event in link.finish(96):
        core.on_event(event)
    assert core.status("r").state is TransferState.SUCCESS


def test_an_offer_while_the_prompt_is_computed_makes_its_first_piece_ask_once() -> None:
    # Decode reserved while prefill still computes: the parked first piece asks with
    # BeginWrite (never refused: the reservation is there), which moves decode to
    # Transferring; the later pieces write under that grant.
    clock = FakeClock()
    core, fake, io = _core(send_wait_s=5.0, clock=clock)
    link = _connected(core, io)
    core.send("r", LONG, ADDR, [(0, 256)], False, indices=slot_lists(core, 0, LONG))
    core.send("r", LONG, ADDR, [(256, 512)], False, indices=slot_lists(core, 0, LONG))
    assert _step(core) is Step.PARKED and not io.queue
    assert _offer(core, fake, 96, seq_len=LONG)
    io.run_all()
    assert [rid for rid, _ in fake.begins] == ["first", "r"] and not fake.refused_not_yet
    writes = len(link.writes)
    clock.advance(0.5)
    core.send("r", LONG, ADDR, [(512, LONG)], True, indices=slot_lists(core, 0, LONG))
    io.run_all()
    assert [rid for rid, _ in fake.begins] == ["first", "r"]
    assert len(link.writes) > writes
    tid = link.writes[-1][0]
    for event in link.finish(tid):
        core.on_event(event)
    assert core.status("r").state is TransferState.SUCCESS


def test_an_offer_before_a_first_piece_that_is_not_the_last_asks_once() -> None:
    core, fake, io = _core(send_wait_s=5.0)
    _connected(core, io)
    assert _offer(core, fake, 112, seq_len=LONG)  # decode reserved first
    core.send("r", LONG, ADDR, [(0, 256)], False, indices=slot_lists(core, 0, LONG))
    io.run_all()
    core.send("r", LONG, ADDR, [(256, LONG)], True, indices=slot_lists(core, 0, LONG))
    io.run_all()
    assert [rid for rid, _ in fake.begins] == ["first", "r"] and not fake.refused_not_yet
    assert core.status("r").state is TransferState.TRANSFERRING


def test_parked_pieces_ask_with_begin_write_only_after_their_final_piece(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # No Offer comes (decode reserved before the pair connected): the grace's BeginWrite
    # waits for the prompt's end, then asks once, as for a whole Send.
    clock = FakeClock()
    core, fake, io = _core(send_wait_s=5.0, clock=clock)
    _connected(core, io)
    monkeypatch.setattr(prefill_module, "OFFER_GRACE_S", 0.05)
    core.send("r", LONG, ADDR, [(0, 256)], False, indices=slot_lists(core, 0, LONG))
    clock.advance(1.0)
    core.periodic()
    assert _step(core) is Step.PARKED and not io.queue, "asked before the prompt's end"
    core.send("r", LONG, ADDR, [(256, LONG)], True, indices=slot_lists(core, 0, LONG))
    core.periodic()  # the grace counts from the final piece
    assert _step(core) is Step.PARKED and not io.queue
    clock.advance(0.06)
    core.periodic()
    io.run_all()
    assert [rid for rid, _ in fake.begins] == ["first", "r"]
    assert core.status("r").state is TransferState.TRANSFERRING
