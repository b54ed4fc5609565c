"""Prefill's record of one request, and the explicit phase of its send path.

A request's send path is in exactly one :class:`Step` at a time. The core moves it
only through :meth:`Outgoing.move` (an illegal move raises ``RuntimeError``: a bug
in the core, never an input's fault), so the questions the core asks ("may a step start
now?", "does an Offer start one?", "may the resend start?") are answered by one
field, never by a combination of flags::

    IDLE ──Send / next chunk──▶ RUNNING ──no connection──▶ CONNECTING
     ▲  ▲                        │  ▲                          │
     │  └───────step ends────────┘  └──────handshake done──────┘
     │                           │
     │                    waits for decode's
     │                      reservation
     │                           ▼
     └─────ended───────────── PARKED ──decode's Offer / the grace──▶ RUNNING

A fresh single-chunk Send that would only wait for decode's Offer parks at once
(IDLE → PARKED, no step at all). A step that parks stays RUNNING until it ends
(:meth:`Outgoing.step_ended`): an Offer that comes meanwhile finds it RUNNING and
starts nothing; the step's end sees the offer and runs again. So one step per
request runs at a time, which keeps its chunks in order.

What became of the writes is the current :class:`Attempt`'s own explicit state
(:class:`AttemptState`), apart from the send path's: an attempt is OPEN while it writes
(or will) on its link; LANDED once its final chunk's last write completed on it; BROKEN
when that link failed with a transient error, which owes a resend, started once the
request is IDLE with no write outstanding (:meth:`Outgoing.resend_due`;
:mod:`kvbeam.server.core.resend`) as a new attempt (one assignment); GIVEN_UP when no
resend follows; RELEASED when the request failed and its writes hung past the drain
grace, so its link was released::

    OPEN ──final chunk's last write──▶ LANDED ◀──────┐
     │                                               │ (its writes had landed)
     └──transient link failure──▶ BROKEN ────────────┘
                                    │ ├──resend──▶ a new attempt, OPEN
                                    │ └──ended / no time left──▶ GIVEN_UP
    any other ──the request failed, its writes hung past the drain grace──▶ RELEASED

Nothing here locks, sleeps or does I/O: the core calls these methods on the loop
and does what they answer (unit tests drive them directly: tests/unit/test_outgoing.py).
Only the loop reads or writes a record: the core's actions and the driver name one by
its :class:`RecordRef`, and carry the plain data the driver needs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvbeam.pools.digest_pool import DigestJob
from kvbeam.pools.types import IndexKind
from kvbeam.server.core.actions import RecordRef, new_ref
from kvbeam.server.core.chunks import NOTHING, Chunk
from kvbeam.server.core.ports import IndexLists, WriteGrant, list_lengths
from kvbeam.server.core.prefill_pieces import Pieces
from kvbeam.server.core.prefill_record import StagingSlot
from kvbeam.server.state.peers import PeerConn
from kvbeam.states import TransferFacts

#: Token ranges of a gRPC Send's chunk, ``[start, end)`` pairs (the core turns them into
#: the KV pages they complete: :meth:`~kvbeam.server.core.prefill.PrefillCore.send`).
Ranges = list[tuple[int, int]]

#: Digest jobs of a request's sub-batches, by the flat buffers ``[lo, hi)`` each covers.
EarlyDigests = dict[tuple[int, int], DigestJob]


class Step(Enum):
    """Where a request's send path is (one at a time)."""

    #: No step runs or is queued: the request waits for its engine's next chunk, for
    #: its writes to complete, or for its end.
    IDLE = "idle"
    #: A step is queued on the executor or running (on it, or inline on the thread that
    #: made the request ready); it takes the next chunk.
    RUNNING = "running"
    #: Its step waits for the handshake with its decode (one per address; every
    #: request waiting for that address goes on when it is done).
    CONNECTING = "connecting"
    #: Its chunk waits for decode's reservation: decode's Offer (or, after the grace,
    #: BeginWrite) starts its step.
    PARKED = "parked"

    # Members are singletons: hashed by identity, a move's table lookups stay in C
    # instead of Enum.__hash__'s two Python calls each (about ten per request).
    __hash__ = object.__hash__


#: The moves :meth:`Outgoing.move` allows (to, from any of).
_MOVES: dict[Step, frozenset[Step]] = {
    Step.RUNNING: frozenset({Step.IDLE, Step.PARKED, Step.CONNECTING}),
    Step.CONNECTING: frozenset({Step.RUNNING}),
    Step.PARKED: frozenset({Step.IDLE, Step.RUNNING}),
    Step.IDLE: frozenset({Step.RUNNING, Step.CONNECTING, Step.PARKED}),
}


class AttemptState(Enum):
    """What became of an attempt's writes (one at a time; the module's diagram)."""

    #: It writes on its link, or will (its first post picks the link).
    OPEN = "open"
    #: Its final chunk's last write completed on its link: every byte before it landed.
    LANDED = "landed"
    #: Its link failed with a transient error: a resend is owed (``broken_by`` says why).
    BROKEN = "broken"
    #: Its link failed and no resend follows (the request ended, or too little time was
    #: left): the request fails with the link's error.
    GIVEN_UP = "given up"
    #: The request failed and writes of it hung past the drain grace: its link was
    #: released, so none of them can read the source any longer.
    RELEASED = "released"

    __hash__ = object.__hash__  # as Step's: identity, hashed in C


#: The moves :meth:`Attempt.move` allows (to, from any of).
_ATTEMPT_MOVES: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.LANDED: frozenset({AttemptState.OPEN, AttemptState.BROKEN}),
    AttemptState.BROKEN: frozenset({AttemptState.OPEN}),
    AttemptState.GIVEN_UP: frozenset({AttemptState.BROKEN}),
    # Whatever it was: a release is forced (its writes hang), and every state but
    # RELEASED itself may still have writes in flight as far as the sweep can tell.
    AttemptState.RELEASED: frozenset(AttemptState) - {AttemptState.RELEASED},
}


@dataclass(eq=False)
class Attempt:
    """One attempt at writing a request, on one link: its state, the chunks it took,
    the pages it covered, its writes in flight and the bytes of them. A resend after a
    transient transport error is a new attempt (:meth:`Outgoing.replay`), one
    assignment: nothing of the dead link's attempt carries over."""

    state: AttemptState = AttemptState.OPEN
    broken_by: str = ""  # what broke its link (BROKEN, GIVEN_UP): the resend's cause
    #: When the sweep first saw the request failed with writes of it in flight (None:
    #: not seen): RELEASED once they hang past the drain grace.
    hung_since: float | None = None
    posted: list[Chunk] = field(default_factory=list)  # chunks it took (a resend replays)
    written: Chunk = NOTHING  # what of the request's KV pages is written (chunks.py)
    link: int | None = None  # the link it posts on (its first post sets it)
    outstanding: int = 0  # writes posted and not completed
    pending_bytes: deque[int] = field(default_factory=deque)  # each outstanding write's bytes
    bytes_total: int = 0  # bytes posted
    bytes_done: int = 0  # bytes of completed writes
    final_posted: bool = False  # the final chunk's writes are posted: Success once they complete
    #: Where its writes are cut into marked sub-batches (pools/sub_batches.py), decided
    #: at its first step: () none; None not decided yet.
    cut: tuple[int, ...] | None = None
    marked: set[int] = field(default_factory=set)  # sub-batches whose mark it posted
    #: Decode's grant from its latest BeginWrite, the link it came on and when: a later
    #: chunk on that link writes under it without asking again while it is fresh
    #: (:meth:`PrefillCore._held_grant`).
    grant: WriteGrant | None = None
    grant_link: int | None = None
    granted_at: float = 0.0

    def move(self, to: AttemptState) -> None:
        """Move to ``to``; raises ``RuntimeError`` if it may not (a bug in the core)."""
        if self.state not in _ATTEMPT_MOVES[to]:
            raise RuntimeError(f"an attempt cannot go from {self.state.value} to {to.value}")
        self.state = to


@dataclass(eq=False)
class Outgoing:
    """Prefill's one record of a request (its lifecycle state lives in the table).

    Fields by what they track: the engine's request; the send path (:class:`Step`,
    the chunks, the grant); the writes in flight; the resend; its end.
    """

    # -- the engine's request (fixed by its first Send) ---------------------------------
    request_id: str
    seq_len: int
    decode_address: str
    src_indices: IndexLists
    #: The current attempt: what it posted and what of that completed. A resend starts
    #: a new one (:meth:`replay`), so nothing of a dead link's attempt carries over.
    attempt: Attempt
    src_draft: IndexLists = field(default_factory=dict)  # the draft's own lists (engine's)
    pieces: Pieces | None = None  # its lists come a piece per chunk (SEND with kv_offset)
    final_submitted: bool = False  # the engine's final chunk came

    # -- the send path -------------------------------------------------------------------
    step: Step = Step.IDLE
    chunks: deque[Chunk] = field(default_factory=deque)  # queued, not yet taken by a step
    #: When it parked, or when its final piece came while it was parked: its BeginWrite
    #: fallback is due a grace later (PrefillCore.periodic).
    parked_at: float = 0.0
    asked: bool = False  # asks (or asked) with BeginWrite: only decode's Offer unparks it
    conn: PeerConn | None = None
    transfer_id: int | None = None
    kv_skip: int | None = None  # leading KV pages decode holds (its grant's; None: no grant)
    rehandshake: str = ""  # why it handshook again before writing (decode forgot us)

    # -- the writes in flight (beside the attempt's own count) ---------------------------
    write_keys: set[tuple[int, int]] = field(default_factory=set)
    #: The staging slot its digest record is written from (area, its free-list, slot),
    #: held while a write of it is outstanding (server/core/prefill_record.py).
    staging: StagingSlot | None = None
    digests: bytes | None = None  # computed once: a resend's source bytes are the same
    #: Digests of its sub-batches started as each became whole (flat buffers [lo, hi)
    #: -> the job), before its final chunk: that chunk digests only the rest.
    early_digests: EarlyDigests = field(default_factory=dict)

    # -- the resends after transient transport errors (server/core/resend.py) -----------
    first_failure: str = ""  # what broke the first link, for the final detail
    resends: int = 0

    # -- its end -----------------------------------------------------------------------
    told_decode: bool = False  # decode knows of the failure (or must not be told)

    #: How actions and the driver name this record (set once, by ``__post_init__``).
    ref: RecordRef = field(init=False)

    def __post_init__(self) -> None:
        self.ref = new_ref(self.request_id)

    @classmethod
    def start(cls, request_id: str, seq_len: int, decode_address: str,
              src_indices: IndexLists, **more: Any) -> Outgoing:
        """A new request's record, its first attempt empty."""
        return cls(request_id, seq_len, decode_address, src_indices, Attempt(), **more)

    @property
    def moved_source(self) -> IndexLists:
        """The source lists of what moves: the KV pages from ``kv_skip`` on (what decode
        reserved and digests), every other list whole."""
        if not self.kv_skip:
            return self.src_indices
        out = dict(self.src_indices)
        out[IndexKind.KV_PAGES] = self.src_indices[IndexKind.KV_PAGES][self.kv_skip:]
        return out

    def facts(self, verification: str) -> TransferFacts:
        """What it moves: bytes written of those posted, its lists (what moves of them)."""
        return TransferFacts(self.attempt.bytes_done, self.attempt.bytes_total,
                             list_lengths(self.moved_source, self.src_draft),
                             self.kv_skip or 0, verification)

    @property
    def drained(self) -> bool:
        """No write of this request can still read its source."""
        return self.attempt.outstanding <= 0 or self.attempt.state is AttemptState.RELEASED

    @property
    def resend_owed(self) -> bool:
        """Its attempt's link broke and a resend is owed (:meth:`resend_due` says when)."""
        return self.attempt.state is AttemptState.BROKEN

    # ---- the send path's moves ----------------------------------------------------------
    def move(self, to: Step) -> None:
        """Move the send path to ``to``; raises ``RuntimeError`` if it may not (a bug)."""
        if self.step not in _MOVES[to]:
            raise RuntimeError(f"request {self.request_id}: its send path cannot go from "
                              f"{self.step.value} to {to.value}")
        self.step = to

    def queue(self, chunk: Chunk) -> bool:
        """The engine sent a chunk. True when a step must be started for it (the
        request was IDLE; the caller parks it or moves it to RUNNING). A PARKED request
        stays parked: what decode's reservation unparks it for is its newest chunk, and
        asking decode again per chunk (a layer-by-layer engine's many) would only hear
        that nothing is reserved yet. A chunk that is not final and makes no KV page
        ready beyond those already queued or taken is nothing to write: it is not
        queued."""
        self.final_submitted = chunk.final
        if not chunk.final and not chunk.adds_to(self.ready):
            return False
        self.chunks.append(chunk)
        return self.step is Step.IDLE

    @property
    def ready(self) -> Chunk:
        """What the chunks queued or taken so far make ready (the last of them)."""
        if self.chunks:
            return self.chunks[-1]
        return self.attempt.posted[-1] if self.attempt.posted else NOTHING

    def park(self, now: float) -> None:
        """Wait for decode's reservation (from IDLE: a Send parked at once; from
        RUNNING: only at the step's end, :meth:`step_ended`)."""
        self.move(Step.PARKED)
        self.parked_at = now

    def final_came(self, now: float) -> None:
        """The engine's final chunk came (:meth:`queue` took it): a PARKED request's
        BeginWrite fallback counts its grace from now, the prompt's end, not from when
        its first piece parked (until then the prompt was still being computed)."""
        if self.step is Step.PARKED:
            self.parked_at = now

    def unpark(self) -> bool:
        """Decode's reservation came (or the grace passed): True when the request was
        PARKED, now RUNNING (the caller starts its step)."""
        if self.step is not Step.PARKED:
            return False
        self.move(Step.RUNNING)
        return True

    def take_chunk(self) -> Chunk:
        """The step takes the newest chunk (kept in ``posted``: a resend replays it).
        A chunk says all that is ready so far, so the newest covers those queued before
        it: one step (one grant, one batch of writes) for what came while the last step
        ran, e.g. the layers a layer-by-layer engine computed meanwhile."""
        chunk = self.chunks[-1]
        self.chunks.clear()
        self.attempt.posted.append(chunk)
        return chunk

    def put_back(self) -> Chunk:
        """The step did not write the chunk it took: it goes first again."""
        chunk = self.attempt.posted.pop()
        self.chunks.appendleft(chunk)
        return chunk

    def step_ended(self, *, ended: bool, parks: bool, offer_waiting: bool,
                   now: float) -> bool:
        """The step is over. ``ended``: the request ended meanwhile; ``parks``: the step
        put its chunk back to wait for decode's reservation; ``offer_waiting``: an offer
        for it is in the book. True: run the next step now (it stays RUNNING);
        otherwise it is IDLE, or PARKED when it parks and no offer is there yet."""
        if not ended and self.chunks and not self.resend_owed and \
                (not parks or offer_waiting):
            return True
        if parks and not ended:
            self.park(now)
        else:
            self.move(Step.IDLE)
        return False

    # ---- the writes --------------------------------------------------------------------
    def completed(self, ok: bool, link: int) -> bool:
        """One write on ``link`` completed (``ok``: its bytes landed). True when it
        proves the whole request landed: the last outstanding write of its final chunk,
        on this attempt's link (RC and TCP keep order: every byte before it landed); the
        attempt is LANDED, and a resend owed is moot."""
        attempt = self.attempt
        attempt.outstanding -= 1
        nbytes = attempt.pending_bytes.popleft() if attempt.pending_bytes else 0
        if ok:
            attempt.bytes_done += nbytes
        done = ok and attempt.final_posted and attempt.outstanding == 0 and link == attempt.link
        if done and attempt.state in _ATTEMPT_MOVES[AttemptState.LANDED]:
            attempt.move(AttemptState.LANDED)
        return done

    # ---- its digests (the driver computes them; the loop keeps them) -------------------
    def keep_digest_jobs(self, jobs: EarlyDigests) -> None:
        """Digest jobs of sub-batches a step made whole (flat buffers [lo, hi) -> the
        job), started by the driver: kept (a range already started keeps its job)."""
        for span, job in jobs.items():
            self.early_digests.setdefault(span, job)

    def keep_digests(self, digests: bytes) -> None:
        """The request's digests, computed by the driver: kept (a resend's are the same)."""
        if self.digests is None:
            self.digests = digests

    # ---- the resend --------------------------------------------------------------------
    def link_failed(self, link_id: int, cause: str, retries: int) -> bool:
        """Link ``link_id`` failed with a transient error, the request still live. True
        when that does not fail it: a resend is owed (now or already), or the link is
        not the one this attempt posts on, or the attempt is not OPEN (it landed, or its
        link broke already). False: no resend is left (``retries``)."""
        attempt = self.attempt
        if attempt.link != link_id or attempt.state is not AttemptState.OPEN:
            return True
        if self.resends >= retries:
            return False
        attempt.move(AttemptState.BROKEN)
        attempt.broken_by = cause
        self.first_failure = self.first_failure or cause
        return True

    def resend_due(self) -> bool:
        """A resend is owed and may start: no step runs and no write is outstanding
        (each write on the dead link completes, as failed, before it starts)."""
        return self.resend_owed and self.attempt.outstanding <= 0 and self.step is Step.IDLE

    def give_up_resend(self) -> str:
        """No resend follows the broken link (the request ended, or no time is left):
        what broke it."""
        self.attempt.move(AttemptState.GIVEN_UP)
        return self.attempt.broken_by

    def hung(self, now: float, drain_s: float) -> bool:
        """The sweep sees the request failed with writes of it in flight: True (once)
        when they have hung more than ``drain_s`` since it first saw them, so its link
        is to be released; the attempt is RELEASED (drained from now on)."""
        attempt = self.attempt
        if attempt.hung_since is None:
            attempt.hung_since = now
        if now - attempt.hung_since <= drain_s or attempt.state is AttemptState.RELEASED:
            return False
        attempt.move(AttemptState.RELEASED)
        return True

    def replay(self) -> None:
        """Start the owed resend as a new attempt (the caller runs its step): every
        chunk posted so far again, in order, before the ones still queued."""
        self.move(Step.RUNNING)
        self.resends += 1
        self.chunks.extendleft(reversed(self.attempt.posted))
        self.attempt = Attempt()
        self.conn = None  # the dead link's connection: the next step finds or makes one
