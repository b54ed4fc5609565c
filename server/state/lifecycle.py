"""The transfer lifecycle on a daemon: legal transitions, deadlines, the transfer table.

The states, failure reasons and status records are :mod:`kvbeam.states` (the wire
codec and the public client need them without the daemons). Every non-terminal state
has a deadline; a transfer past it fails with ``TIMEOUT``. Nothing waits forever.
Terminal states never change.

The table is the daemon loop's (one writer, no lock); any thread reads the statuses it
publishes (:class:`TransferTable`). It reads no clock: each change is given its time
(``now``, the time of the event the core handles, on the clock the cores' drivers read:
``time.monotonic`` in a daemon, a clock a test moves), and deadlines, ages and the
timeline are counted in it. A watcher's limit (:func:`follow`) is counted on the clock its
caller gives.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue

from kvbeam.errors import DuplicateRequest, IllegalTransition, TooManyTransfers
from kvbeam.states import FailureReason, TransferFacts, TransferState, TransferStatus

_NEXT: dict[TransferState, frozenset[TransferState]] = {
    TransferState.BOOTSTRAPPING: frozenset({TransferState.WAITING_FOR_INPUT,
                                            TransferState.FAILED}),
    TransferState.WAITING_FOR_INPUT: frozenset({TransferState.TRANSFERRING,
                                                TransferState.FAILED}),
    TransferState.TRANSFERRING: frozenset({TransferState.SUCCESS, TransferState.FAILED}),
    TransferState.SUCCESS: frozenset(),
    TransferState.FAILED: frozenset(),
}


def legal(src: TransferState, dst: TransferState) -> bool:
    """True when ``src -> dst`` is a legal transition."""
    return dst in _NEXT[src]


@dataclass(frozen=True)
class Deadlines:
    """Seconds allowed in each non-terminal state (defaults far below sglang's 300 s)."""

    bootstrapping: float = 10.0
    waiting_for_input: float = 30.0
    transferring: float = 30.0

    def for_state(self, state: TransferState) -> float | None:
        """The budget of ``state``; None for terminal states."""
        if state is TransferState.BOOTSTRAPPING:
            return self.bootstrapping
        if state is TransferState.WAITING_FOR_INPUT:
            return self.waiting_for_input
        if state is TransferState.TRANSFERRING:
            return self.transferring
        return None


@dataclass
class Transfer:
    """One request's transfer on one side. Mutate only through :class:`TransferTable`."""

    request_id: str
    peer: str
    #: When it was created and entered its current state (the time its changes were given).
    created: float
    entered: float
    state: TransferState = TransferState.BOOTSTRAPPING
    reason: FailureReason | None = None
    detail: str = ""
    deadline: float | None = None
    history: list[TransferState] = field(default_factory=list)
    #: When it entered each state of ``history``.
    entered_at: list[float] = field(default_factory=list)
    version: int = 0
    nbytes: int = 0  # bytes moved, recorded with the move to SUCCESS
    waiting: str = ""  # what the current state waits for, named if its deadline passes
    lease_s: float | None = None  # the current state's own budget (a lease), if not the default
    #: What it moved, from its core's record, kept once the core forgot the request.
    facts: TransferFacts | None = None

    def snapshot(self, now: float) -> TransferStatus:
        """An immutable copy for status replies (its age as of ``now``)."""
        return TransferStatus(self.request_id, self.peer, self.state, self.reason, self.detail,
                              self.version, now - self.created, self.nbytes)


class TransferTable:
    """The bounded table of one side's transfers: the daemon loop's, readable anywhere.

    **One writer.** Every change is made on the daemon's loop (its cores, its sweep), so
    the table takes no lock; :meth:`advance` and :meth:`fail` enforce the legal
    transitions and set the next deadline. **Readers anywhere.** Each change publishes
    the request's status as an immutable :class:`~kvbeam.states.TransferStatus`;
    :meth:`get`, :meth:`state_of`, :meth:`is_live` and :meth:`live_count` read only what
    was published (one dict lookup, atomic under the GIL), so a gRPC handler or an
    executor job reads a consistent status without handing a call to the loop. The rest
    (:meth:`live`, :meth:`timeline`, :meth:`facts`, :meth:`subscribe`) is the loop's:
    another thread hands its read to the loop (``DriverBase.on_loop``).

    Terminal transfers are kept (up to ``keep_terminal``) so a late Status still
    answers. ``on_change`` observes every change (for metrics, logs, engine pushes);
    watchers (:meth:`subscribe`) get each new status on a queue. The table reads no
    clock: every change and every deadline question is given ``now`` (seconds,
    monotonic), the time of the event its core handles.
    """

    def __init__(self, deadlines: Deadlines, capacity: int = 1024, keep_terminal: int = 4096,
                 on_change: Callable[[TransferStatus], None] | None = None) -> None:
        self.deadlines = deadlines
        self.capacity = capacity
        self.keep_terminal = keep_terminal
        self._live: dict[str, Transfer] = {}
        self._done: OrderedDict[str, Transfer] = OrderedDict()
        #: Each known request's newest status and its creation time (what the readers
        #: off the loop see): replaced whole at each change, never changed in place.
        self._published: dict[str, tuple[TransferStatus, float]] = {}
        #: The watchers' queues of each request (:meth:`subscribe`).
        self._watchers: dict[str, list[SimpleQueue[TransferStatus]]] = {}
        self._on_change = on_change

    @property
    def deadlines(self) -> Deadlines:
        """Each state's budget (a new one applies to the states entered from then on)."""
        return self._deadlines

    @deadlines.setter
    def deadlines(self, deadlines: Deadlines) -> None:
        self._deadlines = deadlines
        #: Each state's budget, s (None: terminal), looked up once per move.
        self._budgets = {state: deadlines.for_state(state) for state in TransferState}

    def create(self, request_id: str, peer: str, *, now: float) -> TransferStatus:
        """Start a transfer in BOOTSTRAPPING at ``now``; refuse duplicates and a full table."""
        if request_id in self._live or request_id in self._done:
            raise DuplicateRequest(f"request id {request_id!r} is already known on this side")
        if len(self._live) >= self.capacity:
            raise TooManyTransfers(
                f"{len(self._live)} transfers in flight (capacity {self.capacity})")
        t = Transfer(request_id, peer, created=now, entered=now)
        t.history.append(t.state)
        self._set_deadline(t, now)
        t.entered_at.append(t.entered)
        self._live[request_id] = t
        snap = self._publish(t, now)
        if self._on_change is not None:
            self._on_change(snap)
        return snap

    def _set_deadline(self, t: Transfer, now: float) -> None:
        t.lease_s = None
        budget = self._budgets[t.state]
        t.entered = now
        t.deadline = None if budget is None else now + budget

    @staticmethod
    def _illegal(request_id: str, src: TransferState, dst: TransferState) -> IllegalTransition:
        return IllegalTransition(
            f"request {request_id!r}: illegal transition {src.value} -> {dst.value}")

    def _move(self, t: Transfer, state: TransferState, now: float) -> None:
        # The legality check inline, not through a helper: a request makes three or four
        # moves per side, and each is on the loop's path of every request.
        if state not in _NEXT[t.state]:
            raise self._illegal(t.request_id, t.state, state)
        t.state = state
        t.waiting = ""
        t.history.append(state)
        t.version += 1
        self._set_deadline(t, now)
        t.entered_at.append(now)
        if state.terminal:
            del self._live[t.request_id]
            self._done[t.request_id] = t
            while len(self._done) > self.keep_terminal:
                gone, _ = self._done.popitem(last=False)
                self._published.pop(gone, None)

    def _publish(self, t: Transfer, now: float) -> TransferStatus:
        """Publish ``t``'s status (after a change) and hand it to its watchers."""
        snap = t.snapshot(now)
        self._published[t.request_id] = (snap, t.created)
        queues = self._watchers.get(t.request_id)
        if queues is not None:
            for queue in queues:
                queue.put(snap)
            if snap.state.terminal:  # nothing follows: each watcher ends with it
                del self._watchers[t.request_id]
        return snap

    # ---- readers on any thread (what was published) -------------------------------------
    def get(self, request_id: str) -> TransferStatus | None:
        """The current status as published (its age as of its last change), or None
        for an unknown request."""
        published = self._published.get(request_id)
        return published[0] if published is not None else None

    def status(self, request_id: str, now: float) -> TransferStatus | None:
        """The current status with its age as of ``now`` (a status reply's), or None for
        an unknown request."""
        published = self._published.get(request_id)
        if published is None:
            return None
        s, created = published
        return dataclasses.replace(s, age_s=now - created)

    def state_of(self, request_id: str) -> TransferState | None:
        """The request's current state (None: unknown), without copying its status."""
        published = self._published.get(request_id)
        return published[0].state if published is not None else None

    def is_live(self, request_id: str) -> bool:
        """Whether the request is known and not terminal (no status copied: the cores ask
        this several times per request)."""
        return request_id in self._live

    def live_count(self) -> int:
        """How many transfers are not terminal."""
        return len(self._live)

    # ---- the loop's ----------------------------------------------------------------------
    def timeline(self, request_id: str) -> tuple[tuple[TransferState, float], ...]:
        """Each state the request entered and when, seconds after its creation (empty:
        unknown)."""
        t = self._live.get(request_id) or self._done.get(request_id)
        if t is None:
            return ()
        return tuple((state, at - t.created)
                     for state, at in zip(t.history, t.entered_at, strict=True))

    def keep_facts(self, request_id: str, facts: TransferFacts) -> None:
        """Keep what a request moved (its core forgets its record now): status replies
        read them until the table forgets the request too."""
        t = self._live.get(request_id) or self._done.get(request_id)
        if t is not None:
            t.facts = facts

    def facts(self, request_id: str) -> TransferFacts | None:
        """What :meth:`keep_facts` kept (None: nothing kept, or unknown)."""
        t = self._live.get(request_id) or self._done.get(request_id)
        return t.facts if t is not None else None

    def advance(self, request_id: str, state: TransferState, detail: str = "",
                nbytes: int = 0, *, through: Sequence[TransferState] = (),
                announce: bool = True, now: float) -> TransferStatus:
        """Move a live transfer to a non-failed state at ``now`` (legal transitions only).

        ``detail``, when given, replaces the status detail (decode says there how a
        Success was verified). ``nbytes``: with SUCCESS, the bytes the transfer moved
        (observers count them). ``through``: states passed on the way, each a move of
        its own (history, version) but one notification for all: observers (the
        engine's pushes) see only where it ends, a version step of more than one.
        ``announce`` False: the observers are told later, by :meth:`announce` (readers
        and watchers see it at once).
        """
        if state is TransferState.FAILED or TransferState.FAILED in through:
            raise IllegalTransition("use fail() to fail a transfer: it needs a reason")
        t = self._require(request_id)
        path = (t.state, *through, state)
        for here, there in itertools.pairwise(path):  # whole first: no half-made path
            if not legal(here, there):
                raise self._illegal(request_id, here, there)
        for passed in through:
            self._move(t, passed, now)
        self._move(t, state, now)
        if detail:
            t.detail = detail
        if state is TransferState.SUCCESS:
            t.nbytes = nbytes
        snap = self._publish(t, now)
        if announce and self._on_change is not None:
            self._on_change(snap)
        return snap

    def announce(self, snap: TransferStatus) -> None:
        """Tell the observers of a change :meth:`advance` made without telling them. A
        later change may have reached them first: they keep the newest version (the
        engine channel pushes nothing after a terminal state; an engine applies only a
        newer version)."""
        if self._on_change is not None:
            self._on_change(snap)

    def set_peer(self, request_id: str, peer: str) -> None:
        """Name a live transfer's peer once it is known: prefill's Send with no decode
        address learns its decode from the decode's Offer (docs/protocol.md,
        "Decode-initiated pairing"). No state change, nobody notified."""
        t = self._live.get(request_id)
        if t is not None:
            t.peer = peer
            snap, created = self._published[request_id]
            self._published[request_id] = (dataclasses.replace(snap, peer=peer), created)

    def touch(self, request_id: str, *, now: float) -> None:
        """Record progress at ``now``: restart the current state's deadline (e.g. a chunk
        arrived)."""
        t = self._live.get(request_id)
        if t is not None:
            self._set_deadline(t, now)

    def extend(self, request_id: str, seconds: float, *, now: float) -> None:
        """Allow the current state at least ``seconds`` from ``now`` (e.g. Transferring
        sized by the request's bytes); never shortens a deadline."""
        t = self._live.get(request_id)
        if t is not None and t.deadline is not None:
            t.deadline = max(t.deadline, now + seconds)

    def lease(self, request_id: str, seconds: float, what: str, *, now: float) -> None:
        """Give the current state exactly ``seconds`` from ``now`` (a lease, shorter or
        longer than the state's deadline); a timeout's detail names ``what`` it waited
        for."""
        t = self._live.get(request_id)
        if t is not None:
            t.deadline = now + seconds
            t.lease_s = seconds
            t.waiting = what

    def waiting_for(self, request_id: str, what: str) -> None:
        """Say what the current state waits for: a timeout's detail names it."""
        t = self._live.get(request_id)
        if t is not None:
            t.waiting = what

    def left(self, request_id: str, *, now: float) -> float | None:
        """Seconds from ``now`` until a live transfer's deadline; None: unknown, ended, or
        no deadline."""
        t = self._live.get(request_id)
        if t is None or t.deadline is None:
            return None
        return t.deadline - now

    def fail(self, request_id: str, reason: FailureReason, detail: str, *,
             now: float) -> TransferStatus | None:
        """Fail a live transfer at ``now``; None (and no change) when it is terminal or
        unknown."""
        t = self._live.get(request_id)
        if t is None:
            return None
        t.reason, t.detail = reason, detail
        self._move(t, TransferState.FAILED, now)
        snap = self._publish(t, now)
        if self._on_change is not None:
            self._on_change(snap)
        return snap

    def _require(self, request_id: str) -> Transfer:
        t = self._live.get(request_id)
        if t is None:
            done = self._done.get(request_id)
            if done is not None:
                raise IllegalTransition(
                    f"request {request_id!r} already ended in {done.state.value}")
            raise KeyError(request_id)
        return t

    def expire(self, now: float) -> list[TransferStatus]:
        """Fail every live transfer past its deadline as of ``now`` with TIMEOUT; returns
        what expired."""
        late = [t for t in self._live.values() if t.deadline is not None and now > t.deadline]
        out = []
        for t in late:
            t.reason = FailureReason.TIMEOUT
            budget = t.lease_s if t.lease_s is not None else self._budgets[t.state]
            t.detail = (f"no progress in {t.state.value} for {budget} s"
                        + (f" ({t.waiting})" if t.waiting else ""))
            self._move(t, TransferState.FAILED, now)
            out.append(self._publish(t, now))
        for snap in out:
            if self._on_change is not None:
                self._on_change(snap)
        return out

    def live(self) -> list[TransferStatus]:
        """The published status of every non-terminal transfer."""
        published = self._published
        return [published[rid][0] for rid in self._live]

    def subscribe(self, request_id: str) -> SimpleQueue[TransferStatus] | None:
        """A watcher's queue (None: the request is unknown): it gets the current status
        at once, then each new one until the terminal one. A thread off the loop reads
        it (:func:`follow`) and gives it back with :meth:`unsubscribe`."""
        snap = self.get(request_id)
        if snap is None:
            return None
        queue: SimpleQueue[TransferStatus] = SimpleQueue()
        queue.put(snap)
        if not snap.state.terminal:
            self._watchers.setdefault(request_id, []).append(queue)
        return queue

    def unsubscribe(self, request_id: str, queue: SimpleQueue[TransferStatus]) -> None:
        """The watcher of ``queue`` is done (a no-op once the request ended)."""
        queues = self._watchers.get(request_id)
        if queues is not None and queue in queues:
            queues.remove(queue)
            if not queues:
                del self._watchers[request_id]


def follow(queue: SimpleQueue[TransferStatus], timeout: float,
           clock: Callable[[], float] = time.monotonic) -> Iterator[TransferStatus]:
    """Yield each status a watcher's ``queue`` (:meth:`TransferTable.subscribe`) gets
    until a terminal one, or until ``timeout`` passes on ``clock`` (waiting at most a
    second at a time, so a clock a test moves ends it too). Any thread but the loop's."""
    end = clock() + timeout
    while True:
        left = end - clock()
        if left <= 0:
            return
        try:
            snap = queue.get(timeout=min(left, 1.0))
        except Empty:
            continue
        yield snap
        if snap.state.terminal:
            return
