"""Prefill's request record as a state machine: events in, its send path's phase out.

No threads, no sleeps, no core: each test feeds the moves the core makes (a Send, a
step's end, decode's Offer, a link failure, a completion) and asserts the phase and
what the record answers (start a step? park? resend?).
"""

from __future__ import annotations

import pytest

from kvbeam.server.core.chunks import NOTHING, Chunk
from kvbeam.server.core.outgoing import Attempt, AttemptState, Outgoing, Step

_whole = Chunk.whole


def _rec() -> Outgoing:
    return Outgoing("r", 128, "decode:1", {}, Attempt())


def _at(rec: Outgoing) -> Step:
    """The phase (a call, so the type checker does not narrow it across the moves)."""
    return rec.step


def _posted(rec: Outgoing, link: int, writes: int = 2) -> None:
    """What the core does once a step posted ``writes`` writes on ``link``."""
    rec.attempt.link = link
    rec.attempt.outstanding += writes
    rec.attempt.pending_bytes.extend([100] * writes)
    rec.attempt.bytes_total += 100 * writes


def test_a_send_starts_one_step_and_a_further_chunk_only_queues() -> None:
    rec = _rec()
    assert rec.queue(_whole(1, False)) is True  # IDLE: the caller starts a step
    rec.move(Step.RUNNING)
    assert rec.take_chunk() == _whole(1, False)
    assert rec.queue(_whole(2, True)) is False  # a step runs: it takes this one next
    assert rec.final_submitted and len(rec.chunks) == 1
    assert rec.step_ended(ended=False, parks=False, offer_waiting=False, now=1.0) is True
    assert _at(rec) is Step.RUNNING  # the next chunk's step, still one at a time
    assert rec.take_chunk() == _whole(2, True)
    assert rec.step_ended(ended=False, parks=False, offer_waiting=False, now=2.0) is False
    assert _at(rec) is Step.IDLE and rec.attempt.posted == [_whole(1, False), _whole(2, True)]


def test_a_step_takes_the_newest_chunk_which_covers_those_queued_before_it() -> None:
    """A chunk says all that is ready so far: chunks that queued while a step ran are
    one step (one grant, one batch of writes), the newest, not one step each."""
    rec = _rec()
    rec.queue(Chunk(0, 2, 1, False))
    rec.move(Step.RUNNING)
    assert rec.queue(Chunk(0, 2, 2, False)) is False
    assert rec.queue(Chunk(0, 2, 3, False)) is False
    assert len(rec.chunks) == 3
    assert rec.take_chunk() == Chunk(0, 2, 3, False) and not rec.chunks
    assert rec.attempt.posted == [Chunk(0, 2, 3, False)]


def test_a_send_that_came_first_parks_and_decodes_offer_starts_its_step() -> None:
    rec = _rec()
    assert rec.queue(_whole(2, True))
    rec.park(now=5.0)
    assert _at(rec) is Step.PARKED and rec.parked_at == 5.0
    assert rec.unpark() is True and _at(rec) is Step.RUNNING
    assert rec.unpark() is False, "a second Offer started a second step"


def test_a_step_that_parks_stays_running_until_it_ends() -> None:
    rec = _rec()
    rec.queue(_whole(2, True))
    rec.move(Step.RUNNING)
    rec.take_chunk()
    rec.put_back()  # BeginWrite said not reserved: the chunk waits for the Offer
    # decode's Offer lands while the step is still running: it starts nothing
    assert rec.unpark() is False and _at(rec) is Step.RUNNING
    # the step's end sees the offer in the book: it runs again instead of parking
    assert rec.step_ended(ended=False, parks=True, offer_waiting=True, now=3.0) is True
    assert _at(rec) is Step.RUNNING and rec.chunks[0] == _whole(2, True) and not rec.attempt.posted


def test_a_step_that_parks_with_no_offer_yet_is_parked_at_its_end() -> None:
    rec = _rec()
    rec.queue(_whole(2, True))
    rec.move(Step.RUNNING)
    rec.take_chunk()
    rec.put_back()
    assert rec.step_ended(ended=False, parks=True, offer_waiting=False, now=7.0) is False
    assert _at(rec) is Step.PARKED and rec.parked_at == 7.0
    assert rec.unpark() is True and _at(rec) is Step.RUNNING


def test_a_request_that_ended_during_its_step_goes_idle_not_parked() -> None:
    rec = _rec()
    rec.queue(_whole(2, True))
    rec.move(Step.RUNNING)
    assert rec.step_ended(ended=True, parks=True, offer_waiting=True, now=1.0) is False
    assert _at(rec) is Step.IDLE


def test_the_handshake_holds_the_step_and_gives_it_back() -> None:
    rec = _rec()
    rec.queue(_whole(2, True))
    rec.move(Step.RUNNING)
    rec.move(Step.CONNECTING)
    assert rec.unpark() is False  # an Offer while connecting: the step goes on after
    assert rec.queue(_whole(2, True)) is False, "a chunk while connecting started a step"
    rec.move(Step.RUNNING)  # the handshake is done: the step runs
    assert _at(rec) is Step.RUNNING


@pytest.mark.parametrize(("at", "to"), [
    (Step.RUNNING, Step.RUNNING),  # two steps at once would reorder chunks
    (Step.IDLE, Step.IDLE),
    (Step.PARKED, Step.CONNECTING),
    (Step.CONNECTING, Step.PARKED),
    (Step.CONNECTING, Step.CONNECTING),
])
def test_a_move_its_phase_does_not_allow_raises(at: Step, to: Step) -> None:
    rec = _rec()
    rec.step = at
    with pytest.raises(RuntimeError, match=f"from {at.value} to {to.value}"):
        rec.move(to)
    assert _at(rec) is at


def test_completions_count_bytes_and_drain() -> None:
    rec = _rec()
    _posted(rec, link=3, writes=2)
    assert not rec.drained
    assert rec.completed(ok=True, link=3) is False and rec.attempt.bytes_done == 100
    assert rec.completed(ok=False, link=3) is False and rec.attempt.bytes_done == 100  # failed
    assert rec.drained and rec.attempt.outstanding == 0


def test_only_the_final_chunks_last_write_on_this_attempts_link_proves_the_landing() -> None:
    rec = _rec()
    _posted(rec, link=3, writes=2)
    assert not rec.completed(ok=True, link=3), "landed before the final chunk was posted"
    rec.attempt.final_posted = True
    assert rec.link_failed(3, "a link failure seen after the bytes landed", retries=1)
    assert not rec.completed(ok=True, link=9), "a stray link's completion proved it"
    _posted(rec, link=3, writes=1)
    assert rec.completed(ok=True, link=3)
    assert rec.attempt.state is AttemptState.LANDED and not rec.resend_owed  # moot
    assert rec.link_failed(3, "after it landed", retries=1) and not rec.resend_owed


def test_a_failed_link_owes_one_resend_that_waits_for_the_writes_and_the_step() -> None:
    rec = _rec()
    rec.queue(_whole(2, True))
    rec.move(Step.RUNNING)
    rec.take_chunk()
    _posted(rec, link=3)
    rec.attempt.final_posted = True
    assert rec.step_ended(ended=False, parks=False, offer_waiting=False, now=1.0) is False
    assert rec.link_failed(3, "IBV_WC_RETRY_EXC_ERR", retries=1) is True
    assert rec.attempt.state is AttemptState.BROKEN
    assert rec.attempt.broken_by == "IBV_WC_RETRY_EXC_ERR" == rec.first_failure
    assert rec.link_failed(3, "again", retries=1) is True  # the same failure, seen twice
    assert rec.attempt.broken_by == "IBV_WC_RETRY_EXC_ERR"
    assert not rec.resend_due(), "a resend started while writes were outstanding"
    rec.completed(ok=False, link=3)
    rec.completed(ok=False, link=3)
    assert rec.resend_due()
    rec.attempt.written = _whole(2, True)
    first = rec.attempt
    rec.replay()
    assert _at(rec) is Step.RUNNING and rec.resends == 1 and not rec.resend_owed
    fresh = rec.attempt
    assert first.state is AttemptState.BROKEN and fresh.state is AttemptState.OPEN
    assert rec.attempt is not first and rec.attempt.written == NOTHING  # a new attempt
    assert list(rec.chunks) == [_whole(2, True)] and not rec.attempt.posted
    assert (rec.attempt.link, rec.conn, rec.attempt.final_posted, rec.attempt.bytes_total) == \
        (None, None, False, 0)


def test_a_queued_step_holds_back_an_owed_resend() -> None:
    rec = _rec()
    rec.queue(_whole(1, False))
    rec.move(Step.RUNNING)
    _posted(rec, link=1)
    rec.link_failed(1, "broken", retries=2)
    rec.completed(ok=False, link=1)
    rec.completed(ok=False, link=1)
    assert not rec.resend_due(), "the resend started while a step ran"
    rec.queue(_whole(2, True))
    # the running step stops for the resend: it ends IDLE, not with the next chunk
    assert rec.step_ended(ended=False, parks=False, offer_waiting=False, now=1.0) is False
    assert _at(rec) is Step.IDLE and rec.resend_due()


def test_a_link_this_attempt_does_not_post_on_spares_it_and_owes_nothing() -> None:
    rec = _rec()
    _posted(rec, link=2)
    assert rec.link_failed(9, "old link", retries=0) is True
    assert not rec.resend_owed and rec.attempt.state is AttemptState.OPEN


def test_no_resend_left_fails_it() -> None:
    rec = _rec()
    _posted(rec, link=2)
    rec.resends = 1
    assert rec.link_failed(2, "broken", retries=1) is False
    assert not rec.resend_owed


def test_an_owed_resend_given_up_names_its_cause_and_is_owed_no_more() -> None:
    rec = _rec()
    _posted(rec, link=2, writes=1)
    with pytest.raises(RuntimeError, match="cannot go from open to given up"):
        rec.give_up_resend()  # nothing was owed: a bug in the core, said so
    rec.link_failed(2, "IBV_WC_RETRY_EXC_ERR", retries=1)
    rec.completed(ok=False, link=2)
    assert rec.resend_due()
    assert rec.give_up_resend() == "IBV_WC_RETRY_EXC_ERR"
    assert rec.attempt.state is AttemptState.GIVEN_UP and not rec.resend_due()


def test_writes_hung_past_the_drain_grace_release_the_attempt_once() -> None:
    rec = _rec()
    _posted(rec, link=2, writes=1)
    assert rec.hung(10.0, drain_s=2.0) is False and rec.attempt.hung_since == 10.0
    assert rec.hung(12.0, drain_s=2.0) is False, "released within the grace"
    assert rec.hung(12.5, drain_s=2.0) is True
    assert rec.attempt.state is AttemptState.RELEASED and rec.drained
    assert rec.attempt.outstanding == 1  # its write never completed: the link goes
    assert rec.hung(20.0, drain_s=2.0) is False  # once


def test_a_chunk_that_makes_no_new_page_ready_is_not_queued() -> None:
    """A chunk is the KV pages it makes ready: one that adds none (its tokens end inside
    a page an earlier chunk did not complete either) is nothing to write; the final one
    always queues (it brings the last pages and the other lists)."""
    rec = _rec()
    assert rec.queue(_whole(1, False)) is True
    rec.move(Step.RUNNING)
    assert rec.queue(_whole(1, False)) is False and len(rec.chunks) == 1
    rec.take_chunk()
    assert rec.queue(_whole(0, False)) is False and not rec.chunks  # none beyond the taken one
    assert rec.ready == _whole(1, False)
    assert rec.queue(_whole(1, True)) is False and list(rec.chunks) == [_whole(1, True)]
    assert rec.final_submitted


def test_a_chunk_by_layers_queues_while_it_adds_layers_or_pages() -> None:
    """A layer-by-layer engine's chunks: more layers of the same pages are new, the same
    layers again or fewer are not, and pages ready in every layer cover any partial
    readiness of the same pages."""
    rec = _rec()
    assert rec.queue(Chunk(0, 2, 1, False)) is True
    rec.move(Step.RUNNING)
    assert rec.queue(Chunk(0, 2, 1, False)) is False
    assert rec.queue(Chunk(0, 2, 2, False)) is False and len(rec.chunks) == 2
    assert rec.queue(_whole(2, False)) is False and len(rec.chunks) == 3
    assert rec.queue(Chunk(0, 2, 3, False)) is False and len(rec.chunks) == 3, \
        "layers of pages ready in every layer queued again"
    assert rec.queue(Chunk(2, 3, 1, False)) is False and len(rec.chunks) == 4


def test_a_parked_requests_grace_counts_from_its_final_chunk() -> None:
    rec = _rec()
    rec.queue(Chunk(0, 2, 1, False))
    rec.park(now=1.0)
    rec.final_came(now=4.0)
    assert rec.parked_at == 4.0
    rec.move(Step.RUNNING)
    rec.final_came(now=9.0)  # not parked: nothing to count
    assert rec.parked_at == 4.0
