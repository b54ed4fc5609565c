"""Pieces every transport shares: the event queue, the registration book and write preparation."""

from __future__ import annotations

import select
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbeam.compiled import helper_line, load_helper
from kvbeam.errors import RegionError, TransportError
from kvbeam.transport.base import Access, Event, Registration
from kvbeam.transport.blocks import AddressArray, Blocks
from kvbeam.transport.endpoint import Region, RemoteRegion
from kvbeam.transport.regions import KeyArray, RegionTable

#: How long the event thread waits before looking again while another thread delivers.
PUMP_BUSY_WAIT_S = 0.05
MAX_TRANSFER_ID = 0xFFFF_FFFF  # it travels as the 32-bit immediate of RDMA WRITE WITH IMM


_BLOCKS, _BLOCKS_WHY = load_helper("kvbeam.transport._blocks", "one call per write", "numpy")
#: Whether writes are checked, sliced and (over TCP) framed by the compiled helper; the
#: numpy paths remain for where it was not built and as its oracle (tests switch it off).
COMPILED = _BLOCKS is not None


def blocks_helper() -> Any:
    """The compiled blocks helper when it is in use (:data:`COMPILED`), else None."""
    return _BLOCKS if COMPILED else None


def preparer() -> str:
    """How this process prepares writes: the compiled helper, or numpy and why."""
    return helper_line(_BLOCKS, _BLOCKS_WHY, COMPILED, "numpy")


@dataclass(frozen=True)
class Prepared:
    """A checked, sliced write: parallel arrays plus the local and remote key of each block."""

    transfer_id: int
    notify: bool
    src: AddressArray
    dst: AddressArray
    lengths: AddressArray
    lkeys: KeyArray
    rkeys: KeyArray

    def __len__(self) -> int:
        return len(self.src)


def prepare(transfer_id: int, blocks: Blocks, notify: bool, slice_bytes: int,
            local: RegionTable, remote: RegionTable) -> Prepared:
    """Slice, bounds-check and key every block; raises RegionError before anything is posted."""
    if not 0 <= transfer_id <= MAX_TRANSFER_ID:
        raise TransportError(f"transfer id {transfer_id} does not fit in 32 bits")
    helper = blocks_helper()
    if helper is not None:
        out = helper.prepare(blocks.src, blocks.dst, blocks.lengths, slice_bytes,
                             local.arrays, remote.arrays)
        if out is not None:  # None: a block is outside; the numpy path below names it
            raw, keys = out
            m = len(raw) // 24
            arr = np.frombuffer(raw, dtype=np.uint64)
            key = np.frombuffer(keys, dtype=np.uint32)
            return Prepared(transfer_id, notify, arr[:m], arr[m:2 * m], arr[2 * m:],
                            key[:m], key[m:])
    # Checked whole before any is sliced (a length no region holds must not be sliced:
    # it may not even fit the arithmetic); a RegionError names the caller's block.
    lkeys = local.lookup(blocks.src, blocks.lengths)
    rkeys = remote.lookup(blocks.dst, blocks.lengths)
    b = blocks.split(slice_bytes)
    if b is not blocks:  # slices of checked blocks: each inside its block's region
        lkeys, rkeys = local.lookup(b.src, b.lengths), remote.lookup(b.dst, b.lengths)
    keep = b.lengths > 0  # zero-length blocks move nothing; they were still checked above
    if not bool(keep.all()):
        return Prepared(transfer_id, notify, b.src[keep], b.dst[keep], b.lengths[keep],
                        lkeys[keep], rkeys[keep])
    return Prepared(transfer_id, notify, b.src, b.dst, b.lengths, lkeys, rkeys)


class EventQueue:
    """Thread-safe FIFO of events: drained by an event thread (:meth:`drain`), or, once
    a handler is set (:meth:`deliver_to`), handed to it by whichever thread calls
    :meth:`deliver`.

    A transport thread that saw a completion queues its event without waking anyone
    (``put(wake=False)``) and delivers it itself once it holds no lock: no hand-off to an
    event thread. One deliverer at a time (a lock taken without waiting: a thread that
    finds it held leaves its events to the holder, who looks again after releasing it),
    so events keep their order. :meth:`pump`, on the daemon's event thread, delivers
    what was queued with a wake-up (an event emitted under a lock).
    """

    def __init__(self) -> None:
        self._items: deque[Event] = deque()
        self._cond = threading.Condition()
        self._handler: Callable[[Event], None] | None = None
        self._waker: Callable[[], None] | None = None
        self._delivering = threading.Lock()  # held while handing events over; never waited on

    def put(self, event: Event, wake: bool = True) -> None:
        """Append one event; ``wake``: wake the event thread (else the caller will
        :meth:`deliver`)."""
        with self._cond:
            self._items.append(event)
            if wake:
                self._cond.notify_all()
        if wake and self._waker is not None:
            self._waker()

    def drain(self, timeout: float | None) -> list[Event]:
        """Everything queued, waiting up to ``timeout`` (None: forever) while empty."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                self._cond.wait(left)
            out = list(self._items)
            self._items.clear()
            return out

    def wake(self) -> None:
        """Wake the event thread to take what is queued (:meth:`drain`, :meth:`pump`)."""
        with self._cond:
            self._cond.notify_all()
        if self._waker is not None:
            self._waker()

    def wake_with(self, waker: Callable[[], None]) -> None:
        """Also call ``waker`` (from any thread, maybe under a lock: it must only wake,
        e.g. :meth:`kvbeam.loop.DaemonLoop.wake`) whenever the event thread is
        woken: a loop that :meth:`pump` s with no wait then learns of what was queued."""
        self._waker = waker

    def deliver_to(self, handler: Callable[[Event], None]) -> None:
        """Hand events to ``handler`` from now on (:meth:`deliver`, :meth:`pump`). It runs
        on transport threads: it must not block, and it must not raise."""
        self._handler = handler

    def deliver(self) -> bool:
        """Hand what is queued to the handler on this thread, in order (the caller holds
        no lock); without a handler, wake the event thread to drain it. False when
        another thread is delivering (it takes these too) or no handler is set."""
        handler = self._handler
        if handler is None:
            self.wake()
            return False
        while True:
            if not self._delivering.acquire(blocking=False):
                return False
            try:
                while True:
                    with self._cond:
                        batch = list(self._items)
                        self._items.clear()
                    if not batch:
                        break
                    for event in batch:
                        handler(event)
            finally:
                self._delivering.release()
            with self._cond:  # an event put after our last look, while we held the lock
                if not self._items:
                    return True

    def pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a wake-up, then deliver what is queued (a handler
        must be set)."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
        if not self.deliver():
            with self._cond:  # another thread delivers: do not spin on its queue
                self._cond.wait(min(timeout, PUMP_BUSY_WAIT_S))


class RegistrationBook:
    """The registrations of one transport, and the region tables derived from them.

    Tables are rebuilt on every change (registration is rare) and swapped in whole,
    so writers read a consistent snapshot without locking.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[Registration, tuple[int, ...]]] = []
        self.local = RegionTable((), "local")
        self.writable = RegionTable((), "local remote-writable")

    def add(self, regions: Sequence[Region], access: Access, lkeys: Sequence[int],
            rkeys: Sequence[int], release: Callable[[Registration], None]) -> Registration:
        """Record a registration; raises RegionError if it overlaps an existing one."""
        for r in regions:
            if r.addr <= 0 or r.length <= 0:
                raise RegionError(f"cannot register {r}: address and length must be positive")
        remote = [RemoteRegion(r.addr, r.length, k) for r, k in zip(regions, rkeys, strict=True)]
        reg = Registration(regions, access, remote, release)
        with self._lock:
            entries = [*self._entries, (reg, tuple(lkeys))]
            self._rebuild(entries)
            self._entries = entries
        return reg

    def remove(self, reg: Registration) -> None:
        """Forget a registration."""
        with self._lock:
            entries = [e for e in self._entries if e[0] is not reg]
            self._rebuild(entries)
            self._entries = entries

    def remote_regions(self) -> tuple[RemoteRegion, ...]:
        """Remote-writable regions in registration order: what a link endpoint advertises."""
        with self._lock:
            return tuple(r for reg, _ in self._entries if reg.access is Access.REMOTE_WRITE
                         for r in reg.remote)

    def all(self) -> list[Registration]:
        """Every live registration."""
        with self._lock:
            return [reg for reg, _ in self._entries]

    def _rebuild(self, entries: list[tuple[Registration, tuple[int, ...]]]) -> None:
        local = RegionTable(((r.addr, r.length, k) for reg, keys in entries
                             for r, k in zip(reg.regions, keys, strict=True)), "local")
        writable = RegionTable(((r.addr, r.length, r.rkey) for reg, _ in entries
                                if reg.access is Access.REMOTE_WRITE for r in reg.remote),
                               "local remote-writable")
        self.local, self.writable = local, writable


def remote_table(regions: Sequence[RemoteRegion]) -> RegionTable:
    """The table of a peer's advertised regions."""
    try:
        return RegionTable(((r.addr, r.length, r.rkey) for r in regions), "remote")
    except RegionError as exc:
        raise TransportError(f"peer endpoint is invalid: {exc}") from exc


def wait_readable(fds: Sequence[int], timeout: float | None) -> list[int]:
    """The fds among ``fds`` that are readable (or hung up) within ``timeout`` seconds.

    ``poll`` rather than ``select``: a daemon may hold more than FD_SETSIZE (1024) fds.
    """
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
    return [fd for fd, _ in poller.poll(ms)]
