"""The transfer lifecycle on a daemon: legal transitions, deadlines, the transfer table.

The states, failure reasons and status records are :mod:`kvbeam.states` (the wire
codec and the public client need them without the daemons). Every non-terminal state
has a deadline; a transfer past it fails with ``TIMEOUT``. Nothing waits forever.
Terminal states never change.

The table reads time only through the clock it is given (``clock``): its deadlines, a
transfer's age and timeline, :meth:`TransferTable.expire`'s default ``now`` and
:meth:`TransferTable.watch`'s limit. The daemon gives it ``time.monotonic``, the
clock its cores' drivers read; a test gives it a clock it moves.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

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
    #: When it was created and entered its current state (the table's clock).
    created: float
    entered: float
    state: TransferState = TransferState.BOOTSTRAPPING
    reason: FailureReason | None = None
    detail: str = ""
    deadline: float | None = None
    history: list[TransferState] = field(default_factory=list)
    #: When it entered each state of ``history`` (the table's clock).
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
    """The bounded, thread-safe table of one side's transfers.

    Every state change goes through :meth:`advance` or :meth:`fail`, which enforce
    the legal transitions, set the next deadline and wake watchers. Terminal
    transfers are kept (up to ``keep_terminal``) so a late Status still answers.
    ``on_change`` runs (outside the lock) after every change, for metrics and logs.
    ``clock`` is the one time source the table reads (seconds, monotonic): the daemon
    passes ``time.monotonic``, a test a clock it moves instead of sleeping.
    """

    def __init__(self, deadlines: Deadlines, capacity: int = 1024, keep_terminal: int = 4096,
                 on_change: Callable[[TransferStatus], None] | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.deadlines = deadlines
        self.clock = clock
        self.capacity = capacity
        self.keep_terminal = keep_terminal
        self._live: dict[str, Transfer] = {}
        self._done: OrderedDict[str, Transfer] = OrderedDict()
        # Taken as ``with self._lock`` (C), not through the Condition's Python-level
        # __enter__/__exit__ (a few per request change); the Condition shares the lock.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._watching = 0  # threads waiting on _cond (watch): no notify without one
        self._on_change = on_change

    def create(self, request_id: str, peer: str) -> TransferStatus:
        """Start a transfer in BOOTSTRAPPING; refuse duplicates and a full table."""
        with self._lock:
            if request_id in self._live or request_id in self._done:
                raise DuplicateRequest(f"request id {request_id!r} is already known on this side")
            if len(self._live) >= self.capacity:
                raise TooManyTransfers(
                    f"{len(self._live)} transfers in flight (capacity {self.capacity})")
            now = self.clock()
            t = Transfer(request_id, peer, created=now, entered=now)
            t.history.append(t.state)
            self._set_deadline(t, now)
            t.entered_at.append(t.entered)
            self._live[request_id] = t
            snap = t.snapshot(now)
            self._notify()
        self._changed(snap)
        return snap

    def _set_deadline(self, t: Transfer, now: float) -> None:
        t.lease_s = None
        budget = self.deadlines.for_state(t.state)
        t.entered = now
        t.deadline = None if budget is None else t.entered + budget

    @staticmethod
    def _check_legal(request_id: str, src: TransferState, dst: TransferState) -> None:
        if not legal(src, dst):
            raise IllegalTransition(
                f"request {request_id!r}: illegal transition {src.value} -> {dst.value}")

    def _move(self, t: Transfer, state: TransferState, now: float) -> None:
        self._check_legal(t.request_id, t.state, state)
        t.state = state
        t.waiting = ""
        t.history.append(state)
        t.version += 1
        self._set_deadline(t, now)
        t.entered_at.append(t.entered)
        if state.terminal:
            del self._live[t.request_id]
            self._done[t.request_id] = t
            while len(self._done) > self.keep_terminal:
                self._done.popitem(last=False)

    def get(self, request_id: str) -> TransferStatus | None:
        """The current status, or None for an unknown request."""
        with self._lock:
            t = self._live.get(request_id) or self._done.get(request_id)
            return t.snapshot(self.clock()) if t else None

    def timeline(self, request_id: str) -> tuple[tuple[TransferState, float], ...]:
        """Each state the request entered and when, seconds after its creation (empty:
        unknown)."""
        with self._lock:
            t = self._live.get(request_id) or self._done.get(request_id)
            if t is None:
                return ()
            return tuple((state, at - t.created)
                         for state, at in zip(t.history, t.entered_at, strict=True))

    def keep_facts(self, request_id: str, facts: TransferFacts) -> None:
        """Keep what a request moved (its core forgets its record now): status replies
        read them until the table forgets the request too."""
        with self._lock:
            t = self._live.get(request_id) or self._done.get(request_id)
            if t is not None:
                t.facts = facts

    def facts(self, request_id: str) -> TransferFacts | None:
        """What :meth:`keep_facts` kept (None: nothing kept, or unknown)."""
        with self._lock:
            t = self._live.get(request_id) or self._done.get(request_id)
            return t.facts if t is not None else None

    def is_live(self, request_id: str) -> bool:
        """Whether the request is known and not terminal (no status copied: the cores ask
        this several times per request)."""
        with self._lock:
            return request_id in self._live

    def state_of(self, request_id: str) -> TransferState | None:
        """The request's current state (None: unknown), without copying its status."""
        with self._lock:
            t = self._live.get(request_id) or self._done.get(request_id)
            return t.state if t else None

    def advance(self, request_id: str, state: TransferState, detail: str = "",
                nbytes: int = 0, *, through: Sequence[TransferState] = (),
                announce: bool = True) -> TransferStatus:
        """Move a live transfer to a non-failed state (legal transitions only).

        ``detail``, when given, replaces the status detail (decode says there how a
        Success was verified). ``nbytes``: with SUCCESS, the bytes the transfer moved
        (observers count them). ``through``: states passed on the way, each a move of
        its own (history, version) but one notification for all: observers (the
        engine's pushes) see only where it ends, a version step of more than one.
        ``announce`` False: the observers are told later, by :meth:`announce` (the
        table and its watchers know at once).
        """
        if state is TransferState.FAILED or TransferState.FAILED in through:
            raise IllegalTransition("use fail() to fail a transfer: it needs a reason")
        with self._lock:
            t = self._require(request_id)
            path = (t.state, *through, state)
            for here, there in itertools.pairwise(path):  # whole first: no half-made path
                self._check_legal(request_id, here, there)
            now = self.clock()
            for passed in through:
                self._move(t, passed, now)
            self._move(t, state, now)
            if detail:
                t.detail = detail
            if state is TransferState.SUCCESS:
                t.nbytes = nbytes
            snap = t.snapshot(now)
            self._notify()
        if announce:
            self._changed(snap)
        return snap

    def announce(self, snap: TransferStatus) -> None:
        """Tell the observers of a change :meth:`advance` made without telling them. A
        later change may have reached them first: they keep the newest version (the
        engine channel pushes nothing after a terminal state; an engine applies only a
        newer version)."""
        self._changed(snap)

    def set_peer(self, request_id: str, peer: str) -> None:
        """Name a live transfer's peer once it is known: prefill's Send with no decode
        address learns its decode from the decode's Offer (docs/protocol.md,
        "Decode-initiated pairing"). No state change, nobody notified."""
        with self._lock:
            t = self._live.get(request_id)
            if t is not None:
                t.peer = peer

    def touch(self, request_id: str) -> None:
        """Record progress: restart the current state's deadline (e.g. a chunk arrived)."""
        with self._lock:
            t = self._live.get(request_id)
            if t is not None:
                self._set_deadline(t, self.clock())

    def extend(self, request_id: str, seconds: float) -> None:
        """Allow the current state at least ``seconds`` from now (e.g. Transferring sized
        by the request's bytes); never shortens a deadline."""
        with self._lock:
            t = self._live.get(request_id)
            if t is not None and t.deadline is not None:
                t.deadline = max(t.deadline, self.clock() + seconds)

    def lease(self, request_id: str, seconds: float, what: str) -> None:
        """Give the current state exactly ``seconds`` from now (a lease, shorter or longer
        than the state's deadline); a timeout's detail names ``what`` it waited for."""
        with self._lock:
            t = self._live.get(request_id)
            if t is not None:
                t.deadline = self.clock() + seconds
                t.lease_s = seconds
                t.waiting = what

    def waiting_for(self, request_id: str, what: str) -> None:
        """Say what the current state waits for: a timeout's detail names it."""
        with self._lock:
            t = self._live.get(request_id)
            if t is not None:
                t.waiting = what

    def left(self, request_id: str) -> float | None:
        """Seconds until a live transfer's deadline; None: unknown, ended, or no deadline."""
        with self._lock:
            t = self._live.get(request_id)
            if t is None or t.deadline is None:
                return None
            return t.deadline - self.clock()

    def fail(self, request_id: str, reason: FailureReason, detail: str) -> TransferStatus | None:
        """Fail a live transfer; None (and no change) when it is terminal or unknown."""
        with self._lock:
            t = self._live.get(request_id)
            if t is None:
                return None
            t.reason, t.detail = reason, detail
            now = self.clock()
            self._move(t, TransferState.FAILED, now)
            snap = t.snapshot(now)
            self._notify()
        self._changed(snap)
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

    def expire(self, now: float | None = None) -> list[TransferStatus]:
        """Fail every live transfer past its deadline (as of ``now``, the table's clock
        when not given) with TIMEOUT; returns what expired."""
        now = self.clock() if now is None else now
        with self._lock:
            late = [t for t in self._live.values()
                    if t.deadline is not None and now > t.deadline]
            out = []
            for t in late:
                t.reason = FailureReason.TIMEOUT
                budget = t.lease_s if t.lease_s is not None else \
                    self.deadlines.for_state(t.state)
                t.detail = (f"no progress in {t.state.value} for {budget} s"
                            + (f" ({t.waiting})" if t.waiting else ""))
                self._move(t, TransferState.FAILED, now)
                out.append(t.snapshot(now))
            if out:
                self._notify()
        for snap in out:
            self._changed(snap)
        return out

    def live(self) -> list[TransferStatus]:
        """Snapshots of every non-terminal transfer."""
        with self._lock:
            now = self.clock()
            return [t.snapshot(now) for t in self._live.values()]

    def watch(self, request_id: str, timeout: float) -> Iterator[TransferStatus]:
        """Yield each new status of a transfer until it is terminal or ``timeout`` passes
        on the table's clock (waiting at most a second at a time, so a clock a test
        moves ends it too)."""
        end = self.clock() + timeout
        seen = -1
        while True:
            with self._lock:
                t = self._live.get(request_id) or self._done.get(request_id)
                if t is None:
                    raise KeyError(request_id)
                while t.version == seen and not t.state.terminal:
                    left = end - self.clock()
                    if left <= 0:
                        return
                    self._watching += 1
                    try:
                        self._cond.wait(min(left, 1.0))
                    finally:
                        self._watching -= 1
                snap = t.snapshot(self.clock()) if t.version != seen else None
            if snap is not None:
                seen = snap.version
                yield snap
                if snap.state.terminal:
                    return
            elif t.state.terminal:
                return

    def _notify(self) -> None:
        """Wake the watchers (lock held); the Condition's notify is Python, skipped when
        none waits (the usual case: nothing watches a request on the engine channel)."""
        if self._watching:
            self._cond.notify_all()

    def _changed(self, snap: TransferStatus) -> None:
        if self._on_change is not None:
            self._on_change(snap)
