"""The staging buffer's slot allocator: which items of the host buffer a request holds.

A staging buffer (:mod:`kvbeam.engine.staging`) is a side's pools in memfds, laid out
by a config of its own capacity; a request staged through it holds, per index kind,
as many items as its device lists name (its pages, ring rows, state items). This
module hands those items out and takes them back. It is plain Python (no torch, no
numpy work per item): each kind's free items are extents ``(start, count)``, handed
out first-fit, so a request's items of a kind are usually ONE contiguous run and its
copies one contiguous host range per buffer; when no single extent is large enough,
several are taken (the run is then a few pieces, never refused while enough is free).

When too little is free, :meth:`SlotAllocator.acquire` waits (bounded) for
:meth:`SlotAllocator.release` to return items, then raises :class:`StagingFull`
carrying the caller's policy (fail the request, or recompute it): never a hang.

An engine loop that must not block (vLLM's worker step, sglang's scheduler poll) takes
a :class:`Ticket` instead (:meth:`SlotAllocator.enqueue`) and asks again at each step
(:meth:`SlotAllocator.poll`): tickets get their items in the order they were taken
(a large request is not passed over forever by small ones), and one whose wait ran
out raises :class:`StagingFull` when asked.
"""

from __future__ import annotations

import bisect
import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvbeam.errors import StagingFull
from kvbeam.pools.types import IndexKind

#: One contiguous piece of a kind's items: ``count`` items from ``start``.
Extent = tuple[int, int]


class FullPolicy(enum.Enum):
    """What an engine does with a request whose staging wait ran out.

    ``fail``: the request fails (prefill: not sent; decode: not loaded, the engine
    reports a load failure). ``recompute``: decode computes the request's KV itself
    (vLLM's ``kv_load_failure_policy: recompute``); prefill treats it as ``fail``.
    The allocator only carries the choice (:attr:`StagingFull.policy`): the engine acts.
    """

    FAIL = "fail"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Slots:
    """A request's items in the staging buffer: per kind, its extents in order.

    ``lists`` (built on first use) is what the engine gives kvbeam's ``send`` /
    ``send_metadata``: element ``i`` of a kind's list is where element ``i`` of the
    request's device list is staged.
    """

    extents: Mapping[IndexKind, tuple[Extent, ...]]

    def list_for(self, kind: IndexKind) -> npt.NDArray[np.int64]:
        """The staged items of ``kind``, in the request's order."""
        runs = self.extents.get(kind, ())
        if not runs:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in runs])

    @property
    def lists(self) -> dict[IndexKind, npt.NDArray[np.int64]]:
        """Every kind's staged list (the index lists to send or reserve with)."""
        return {kind: self.list_for(kind) for kind in self.extents}

    @property
    def items(self) -> int:
        """Items held, all kinds together."""
        return sum(n for runs in self.extents.values() for _, n in runs)


@dataclass(eq=False)
class Ticket:
    """A request's place in the queue for staging items (:meth:`SlotAllocator.enqueue`):
    ``slots`` once granted; ask with :meth:`SlotAllocator.poll`, give it up with
    :meth:`SlotAllocator.cancel`."""

    counts: Mapping[IndexKind, int]
    deadline: float
    wait_s: float
    slots: Slots | None = None
    #: True once its first ask found no room (counted once in ``waits``).
    waited: bool = False
    #: Why its wait ran out ("": it did not); set when the deadline passed.
    refused: str = field(default="", repr=False)


class _Extents:
    """One kind's free items: sorted, coalesced extents (starts and counts apart)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.starts: list[int] = [0] if capacity else []
        self.counts: list[int] = [capacity] if capacity else []
        self.free = capacity

    def take(self, n: int) -> tuple[Extent, ...]:
        """``n`` items (caller checked ``n <= free``): the first extent that holds them
        all, else the largest extents first (fewest pieces)."""
        if n == 0:
            return ()
        for i, c in enumerate(self.counts):
            if c >= n:
                return (self._cut(i, n),)
        out: list[Extent] = []
        while n:
            i = max(range(len(self.counts)), key=self.counts.__getitem__)
            piece = self._cut(i, min(n, self.counts[i]))
            out.append(piece)
            n -= piece[1]
        return tuple(out)

    def _cut(self, i: int, n: int) -> Extent:
        start = self.starts[i]
        if self.counts[i] == n:
            del self.starts[i], self.counts[i]
        else:
            self.starts[i] += n
            self.counts[i] -= n
        self.free -= n
        return (start, n)

    def give(self, extent: Extent) -> None:
        """Return an extent, merging it with its free neighbours."""
        start, n = extent
        i = bisect.bisect_left(self.starts, start)
        overlaps_next = i < len(self.starts) and self.starts[i] < start + n
        overlaps_prev = i > 0 and self.starts[i - 1] + self.counts[i - 1] > start
        if overlaps_next or overlaps_prev:
            raise ValueError(f"staging extent {extent} is free already (double release)")
        self.starts.insert(i, start)
        self.counts.insert(i, n)
        if i + 1 < len(self.starts) and start + n == self.starts[i + 1]:
            self.counts[i] += self.counts.pop(i + 1)
            del self.starts[i + 1]
        if i and self.starts[i - 1] + self.counts[i - 1] == start:
            self.counts[i - 1] += self.counts.pop(i)
            del self.starts[i]
        self.free += n


class SlotAllocator:
    """Per-kind staging items for requests; thread-safe, bounded waits.

    Args:
        capacity: items of each index kind the staging buffer holds.
        policy: carried by :class:`StagingFull` when a wait runs out.
        clock: monotonic seconds, what a request's wait for room is measured on (a
            test's fake clock makes a ticket's wait run out when it moves it).
    """

    def __init__(self, capacity: Mapping[IndexKind, int],
                 policy: FullPolicy = FullPolicy.FAIL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = dict(capacity)
        self.policy = policy
        self.clock = clock
        self._free = {kind: _Extents(n) for kind, n in capacity.items()}
        self._cond = threading.Condition()
        self._held = 0
        #: Tickets not granted yet, in the order they were taken.
        self._queue: deque[Ticket] = deque()
        #: Requests that waited for room, and those whose wait ran out.
        self.waits = 0
        self.refusals = 0

    def acquire(self, counts: Mapping[IndexKind, int], wait_s: float) -> Slots:
        """Items for one request: ``counts[kind]`` of each kind, all or nothing.

        Waits up to ``wait_s`` seconds for releases when too few are free; raises
        :class:`StagingFull` then (and at once when the request can never fit).
        """
        self._check(counts)
        deadline = self.clock() + wait_s
        waited = False
        with self._cond:
            while not self._fits(counts):
                left = deadline - self.clock()
                if left <= 0:
                    self.refusals += 1
                    raise StagingFull(self._full(counts, wait_s), policy=self.policy.value)
                if not waited:
                    waited = True
                    self.waits += 1
                self._cond.wait(left)
            return self._take(counts)

    def enqueue(self, counts: Mapping[IndexKind, int], wait_s: float) -> Ticket:
        """A place in the queue for one request's items, for a caller that must not
        block: ask :meth:`poll` at each of its steps. Raises :class:`StagingFull` at
        once when the request can never fit."""
        self._check(counts)
        ticket = Ticket(dict(counts), self.clock() + wait_s, wait_s)
        with self._cond:
            self._queue.append(ticket)
        return ticket

    def poll(self, ticket: Ticket) -> Slots | None:
        """The ticket's items once it is its turn and they are free (None: not yet).

        Tickets are served in the order they were taken; one whose wait ran out leaves
        the queue and raises :class:`StagingFull` (counted once in ``refusals``).
        """
        with self._cond:
            self._grant(self.clock())
            if ticket.slots is not None:
                return ticket.slots
            if ticket.refused:
                raise StagingFull(ticket.refused, policy=self.policy.value)
            if not ticket.waited:
                ticket.waited = True
                self.waits += 1
            return None

    def cancel(self, ticket: Ticket) -> None:
        """Give a ticket up (its request ended while it waited): out of the queue, and
        its items back when it had been granted."""
        with self._cond:
            if ticket in self._queue:
                self._queue.remove(ticket)
                self._cond.notify_all()
        if ticket.slots is not None:
            slots, ticket.slots = ticket.slots, None
            self.release(slots)

    def _grant(self, now: float) -> None:
        """Under the lock: grant queued tickets in order while they fit; expire those
        whose wait ran out (they no longer hold the queue up)."""
        while self._queue:
            head = self._queue[0]
            if self._fits(head.counts):
                self._queue.popleft()
                head.slots = self._take(head.counts)
                continue
            if head.deadline > now:
                break
            self._queue.popleft()
            head.refused = self._full(head.counts, head.wait_s)
            self.refusals += 1
        for ticket in [t for t in self._queue if t.deadline <= now]:
            self._queue.remove(ticket)
            ticket.refused = self._full(ticket.counts, ticket.wait_s)
            self.refusals += 1

    def _check(self, counts: Mapping[IndexKind, int]) -> None:
        for kind, n in counts.items():
            cap = self.capacity.get(kind)
            if n < 0 or cap is None:
                raise ValueError(f"staging: no {kind.value} items in the staging buffer"
                                 if cap is None else f"staging: {n} {kind.value} items")
            if n > cap:
                self._refuse(f"a request needs {n} {kind.value} items, the staging buffer "
                             f"holds {cap} in all: give it more capacity (requests/tokens)")

    def _fits(self, counts: Mapping[IndexKind, int]) -> bool:
        return all(self._free[k].free >= n for k, n in counts.items())

    def _take(self, counts: Mapping[IndexKind, int]) -> Slots:
        slots = Slots({k: self._free[k].take(n) for k, n in counts.items()})
        self._held += 1
        return slots

    def _full(self, counts: Mapping[IndexKind, int], wait_s: float) -> str:
        short = ", ".join(f"{k.value} {self._free[k].free}/{n}"
                          for k, n in counts.items() if self._free[k].free < n)
        return (f"staging buffer full: waited {wait_s:g} s for room (free/needed: "
                f"{short or 'queued behind earlier requests'}; {self._held} requests "
                f"staged, {len(self._queue)} waiting); policy {self.policy.value}")

    def _refuse(self, why: str) -> None:
        with self._cond:
            self.refusals += 1
        raise StagingFull(f"staging buffer too small: {why}; policy {self.policy.value}",
                          policy=self.policy.value)

    def release(self, slots: Slots) -> None:
        """Give a request's items back and wake the requests waiting for room."""
        with self._cond:
            for kind, runs in slots.extents.items():
                for extent in runs:
                    self._free[kind].give(extent)
            self._held -= 1
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """Tickets waiting for their items now."""
        return len(self._queue)

    @property
    def held(self) -> int:
        """Requests holding staging items now."""
        return self._held

    def occupancy(self) -> float:
        """The fullest kind's share of items held (0.0 .. 1.0)."""
        with self._cond:
            return max(((e.capacity - e.free) / e.capacity
                        for e in self._free.values() if e.capacity), default=0.0)
