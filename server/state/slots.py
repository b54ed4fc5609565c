"""Decode's request slots: who holds which slot, with nothing leaked.

A slot is held from Reserve until the transfer fails, is aborted, its lease
expires, or (after Success) the scheduler releases it or the hand-off lease
expires. The daemon decides when; this class only keeps the books, thread-safely.
"""

from __future__ import annotations

import threading

from kvbeam.errors import KvbeamError, NoFreeSlot


class SlotPool:
    """A fixed set of request slots ``0..size-1``; lowest free slot first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = list(range(size - 1, -1, -1))  # pop() takes the lowest
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, request_id: str) -> int:
        """Hold a slot for ``request_id``; raises NoFreeSlot when none is free."""
        with self._lock:
            if request_id in self._held:
                raise KvbeamError(f"request id {request_id!r} already holds slot "
                                  f"{self._held[request_id]}")
            if not self._free:
                raise NoFreeSlot(f"no free request slot: all {self.size} are held")
            slot = self._free.pop()
            self._held[request_id] = slot
            return slot

    def release(self, request_id: str) -> int | None:
        """Free the request's slot; returns it, or None when the request held none."""
        with self._lock:
            slot = self._held.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)
                self._free.sort(reverse=True)
            return slot

    def slot_of(self, request_id: str) -> int | None:
        """The slot a request holds, if any."""
        with self._lock:
            return self._held.get(request_id)

    @property
    def free(self) -> int:
        """Number of free slots."""
        with self._lock:
            return len(self._free)

    @property
    def held(self) -> int:
        """Number of held slots."""
        with self._lock:
            return len(self._held)
