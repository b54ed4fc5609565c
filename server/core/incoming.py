"""Decode's record of one request, and the explicit phase of its landing.

A request's bytes are in exactly one :class:`Landing` phase for its current grant;
the core moves it on the daemon's loop (:mod:`kvbeam.server.core.decode`,
:mod:`kvbeam.server.core.decode_landing`). Prefill's counterpart is
:mod:`kvbeam.server.core.outgoing`.

Only the loop reads or writes a record: the core's actions name one by its
:class:`~kvbeam.server.core.actions.RecordRef`, and a landing's check reads a
:class:`LandingView`, copied on the loop when the core asks for the check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from kvbeam.pools.digest import DigestParts
from kvbeam.pools.digest_pool import DigestJob
from kvbeam.server.core.actions import RecordRef, new_ref
from kvbeam.server.core.ports import IndexLists, list_lengths
from kvbeam.states import TransferFacts


class Landing(Enum):
    """Where a request's bytes are on decode, for its current grant (one at a time).

    AWAITED -> LANDED (its notification came) -> VERIFYING (the check is queued or
    running: at most once per landing) -> VERIFIED (Success; held for the engine's
    Release). A resend on a new link, before the check began, starts over at AWAITED
    with a new transfer id; one that comes later is answered ``AlreadyLanded``.
    """

    #: Nothing of the current grant has landed (no notification of its transfer id).
    AWAITED = "awaited"
    #: Its notification came; the check waits for prefill's integrity flag (an Offer's
    #: answer) or for the marks its digest record counts.
    LANDED = "landed"
    #: The check is queued or running.
    VERIFYING = "verifying"
    #: Checked: Success (or it ended meanwhile); nothing lands on it any more.
    VERIFIED = "verified"


@dataclass(frozen=True, eq=False)
class LandingView:
    """What the driver's check of a landing (or of one of its sub-batches) reads of the
    request: copied from its record on the loop when the core asks for it
    (:meth:`Incoming.view`), so the check, off the loop, never reads the record."""

    request_id: str
    prefill_address: str
    indices: IndexLists
    draft: IndexLists
    nbytes: int
    #: Prefill's integrity flag as the core knew it (``Incoming.digests_follow``).
    digests_follow: bool | None
    landed_at: float  # when its notification came (the check's timing)
    mailbox_slot: int
    sub_batches: tuple[int, ...]
    #: The digest jobs of the sub-batches whose mark came (mark number -> job).
    marked: Mapping[int, DigestJob]
    parts: DigestParts | None  # its digest parts, if a mark built them


@dataclass(eq=False)
class UnconfirmedAbort:
    """An abort of the request that prefill answered without confirming that its writes
    drained: the slot stays held while the core asks again, a few at a time
    (:meth:`~kvbeam.server.core.decode.DecodeCore.periodic`), until prefill confirms,
    the link goes, or the request's transfer budget has passed since ``since`` (then its
    link is released)."""

    since: float  # when it was first left unconfirmed
    detail: str  # the abort's detail, said again with each ask
    asked_at: float  # when prefill last answered
    asking: bool = False  # an Abort of it is under way (asked again, or its link goes)


@dataclass(eq=False)
class Incoming:
    """Decode's one record of a request (its lifecycle state lives in the table).

    Prefill's counterpart is :class:`~kvbeam.server.core.outgoing.Outgoing`; the
    scheduler's view of the same reservation is :class:`kvbeam.client.Reservation`
    (what Reserve answered).
    """

    request_id: str
    slot: int
    seq_len: int
    prefill_address: str
    transfer_id: int
    indices: IndexLists
    nbytes: int
    peer_instance: str = ""          # set by BeginWrite: prefill may write from now on
    digests: bytes | None = None  # the digest record's, once checked
    #: Where its bytes are (:class:`Landing`).
    landing: Landing = Landing.AWAITED
    success_at: float | None = None  # when it was VERIFIED (its hand-off lease runs from it)
    draft: IndexLists = field(default_factory=dict)  # the draft's own lists (engine's)
    link_id: int | None = None       # the link prefill was granted: only its notification counts
    # Prefill's integrity flag (from BeginWrite or its answer to Offer): True, its
    # digest record comes in band (the mailbox); None, not known yet (an Offer not
    # answered: a record found in the slot at the landing says it is on).
    digests_follow: bool | None = None
    offered: bool = False            # granted by Offer, no BeginWrite since
    # time.monotonic() of the landing: the Success log line says how long the check took.
    landed_at: float = 0.0
    #: An abort prefill did not confirm (its writes may be in flight); None: none.
    unconfirmed: UnconfirmedAbort | None = None
    kv_skip: int = 0                 # leading KV pages the engine holds: not written
    #: The request's slot of the digest mailbox (its request slot, also with engine lists).
    mailbox_slot: int = -1
    #: Where its sub-batches end (flat-buffer positions, pools/sub_batches.py), if prefill
    #: marks them: decode's own cut, from its sub-batch size and this request's bytes.
    sub_batches: tuple[int, ...] = ()
    #: The digest jobs of the sub-batches whose mark came (mark number -> job), of the
    #: current transfer id (a resend's new id starts over).
    marked: dict[int, DigestJob] = field(default_factory=dict)
    #: Its digest parts (one per flat buffer), built at its first mark.
    parts: DigestParts | None = None
    #: How actions and the driver name this record (set once, by ``__post_init__``).
    ref: RecordRef = field(init=False)

    def __post_init__(self) -> None:
        self.ref = new_ref(self.request_id)

    def view(self) -> LandingView:
        """What a check of its landing reads, as of now (a copy: the record is the
        loop's)."""
        return LandingView(self.request_id, self.prefill_address, self.indices, self.draft,
                           self.nbytes, self.digests_follow, self.landed_at,
                           self.mailbox_slot, self.sub_batches, dict(self.marked),
                           self.parts)

    def facts(self, verification: str) -> TransferFacts:
        """What it moves: bytes landed of those reserved, its destination lists."""
        return TransferFacts(self.nbytes if self.landed else 0, self.nbytes,
                             list_lengths(self.indices, self.draft), self.kv_skip, verification)

    # ---- the landing's moves (the core calls them on the loop) ----------------------
    @property
    def landed(self) -> bool:
        """Its current grant's notification came (every byte of it landed)."""
        return self.landing is not Landing.AWAITED

    @property
    def checking(self) -> bool:
        """Its check is queued, running or done: nothing may replace the landing."""
        return self.landing in (Landing.VERIFYING, Landing.VERIFIED)

    def notified(self, now: float) -> None:
        """The notification of its current transfer id came: AWAITED -> LANDED (a
        repeated one changes nothing)."""
        if self.landing is Landing.AWAITED:
            self.landing, self.landed_at = Landing.LANDED, now

    def verify(self) -> None:
        """Its check starts (once per landing): LANDED -> VERIFYING."""
        self._move(Landing.LANDED, Landing.VERIFYING)

    def verified(self, now: float) -> None:
        """Its check passed and it is Success: VERIFYING -> VERIFIED (its hand-off
        lease runs from ``now``)."""
        self._move(Landing.VERIFYING, Landing.VERIFIED)
        self.success_at = now

    def relinked(self) -> None:
        """Prefill writes it again on a new link, before any check began: back to
        AWAITED, and the old landing's sub-batches count for nothing."""
        if self.checking:
            raise RuntimeError(f"request {self.request_id}: a landing being checked "
                               "cannot be replaced")
        self.landing = Landing.AWAITED
        self.marked = {}

    def _move(self, at: Landing, to: Landing) -> None:
        if self.landing is not at:
            raise RuntimeError(f"request {self.request_id}: its landing cannot go from "
                               f"{self.landing.value} to {to.value}")
        self.landing = to
