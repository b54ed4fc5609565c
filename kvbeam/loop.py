"""The daemon's loop: one thread, one selector, for every source that waits on a socket.

A :class:`DaemonLoop` serves :class:`LoopSource` objects: each registers its file
descriptors through its own :class:`SourceSelector` (the loop dispatches a ready one to
the source that registered it, with the data it gave), and runs its housekeeping in
:meth:`LoopSource.tick` only when that is due: at the time its last tick asked for (the
loop's timers: one due time per source, the loop sleeps until the soonest), or at the end
of the pass in which it was poked (:meth:`DaemonLoop.poke`: it has queued work, from any
thread). A pass that only carries an engine's or a peer's frame therefore calls no other
source. Other threads hand work to the loop with :meth:`DaemonLoop.call_soon_threadsafe`
and wake it with :meth:`DaemonLoop.wake`.

A source's state that only the loop thread touches needs no lock, whoever else shares
the loop. Nothing on the loop may block: a source hands blocking work (a memory
registration, a handshake) to an executor, which comes back with
:meth:`DaemonLoop.call_soon_threadsafe`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from kvbeam.threads import name_os_thread

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The loop's longest sleep, s, whatever its sources ask.
MAX_WAIT_S = 0.2
#: A pass of the loop (its handlers, calls and housekeeping) that keeps it this long, s,
#: is counted and logged (WARNING, naming what the pass handled; at most once per
#: ``STALL_LOG_EVERY_S`` for the same): every other source of the daemon waited
#: meanwhile, and nothing on the loop may block.
STALL_WARN_S = 0.1
STALL_LOG_EVERY_S = 10.0


class LoopSource(Protocol):
    """What a source of a :class:`DaemonLoop` does, on the loop thread."""

    def ready(self, data: Any, mask: int) -> None:
        """A file descriptor it registered with ``data`` is ready (``mask``:
        ``selectors.EVENT_READ`` and/or ``EVENT_WRITE``)."""

    def tick(self, now: float) -> float:
        """Housekeeping (timeouts, queued work), at the end of a pass in which it is due
        (``now``: the pass's start, ``time.monotonic()``). Returns when it is next due,
        on the same clock (``math.inf``: only when poked); a poke during the tick keeps
        it due at once."""


class SourceSelector:
    """A source's view of the loop's selector: what it registers is dispatched to it."""

    def __init__(self, sel: selectors.BaseSelector, source: LoopSource) -> None:
        self._sel = sel
        self._source = source

    def register(self, fileobj: Any, events: int, data: Any = None) -> None:
        """Watch ``fileobj`` for ``events``; ``data`` comes back with each readiness."""
        self._sel.register(fileobj, events, (self._source, data))

    def modify(self, fileobj: Any, events: int, data: Any = None) -> None:
        """Change what ``fileobj`` is watched for."""
        self._sel.modify(fileobj, events, (self._source, data))

    def unregister(self, fileobj: Any) -> None:
        """Stop watching ``fileobj`` (KeyError when it was not watched)."""
        self._sel.unregister(fileobj)

    def watched(self, fileobj: Any) -> tuple[int, Any] | None:
        """(events, data) ``fileobj`` is watched for, None when it is not."""
        try:
            key = self._sel.get_key(fileobj)
        except (KeyError, ValueError):
            return None
        return key.events, key.data[1]


def join_loop(loop: DaemonLoop | None, name: str,
              join: Callable[[DaemonLoop], None]) -> tuple[DaemonLoop, bool]:
    """A source's start: run ``join`` (it adds the source and registers its fds) on
    ``loop``'s thread, or on a new loop named ``name`` that is then started, the
    source's own (a unit test's standalone server). Returns the loop and whether it is
    the source's own, for :func:`leave_loop`."""
    own = loop is None
    served = loop or DaemonLoop(name)
    served.run_sync(lambda: join(served))
    if own:
        served.start()
    return served, own


def leave_loop(loop: DaemonLoop, source: LoopSource, own: bool) -> None:
    """A source's stop: stop its own loop, or leave the daemon's (on the loop thread,
    so no pass is handling the source's fds as they close)."""
    if own:
        loop.stop()
    else:
        with contextlib.suppress(TimeoutError):
            loop.run_sync(lambda: loop.remove(source))


class DaemonLoop:
    """One thread serving every registered source (see the module's docstring)."""

    def __init__(self, name: str = "kvbeam-loop") -> None:
        self.name = name
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        #: Each source and when its tick is next due (time.monotonic; the loop thread's,
        #: or before start). Its keys are the sources, in the order they were added.
        self._due: dict[LoopSource, float] = {}
        #: Sources poked from other threads, for the loop to mark due (deque: append and
        #: popleft need no lock).
        self._poked: deque[LoopSource] = deque()
        self._lock = threading.Lock()  # leaf: the queue of calls only
        self._calls: deque[Callable[[], None]] = deque()
        self._stop = threading.Event()
        self._finished = threading.Event()  # set when serving ended (run() or the thread)
        self._in_run = False  # its thread (or run()) is serving now
        self._thread: threading.Thread | None = None
        # The loop thread's id while it runs (None otherwise), and whether it serves:
        # plain fields, since every call into a core asks both (one C call, no Python).
        self._ident: int | None = None
        self._serving = False
        self._closed = False
        #: Stalls seen (the loop's thread; read by metrics and tests) and when each kind
        #: was last logged.
        self.stalls = 0
        self._stall_logged: dict[str, float] = {}

    # ---- sources --------------------------------------------------------------------------
    def add(self, source: LoopSource) -> SourceSelector:
        """Serve ``source`` (before :meth:`start` or on the loop thread); its selector.
        Its first tick is due at once (it then says when the next is)."""
        self._due[source] = 0.0
        return SourceSelector(self._sel, source)

    def remove(self, source: LoopSource) -> None:
        """Serve ``source`` no more and forget every fd it registered (on the loop thread,
        or once the loop stopped)."""
        self._due.pop(source, None)
        if self._closed:
            return  # the selector is gone, and its registrations with it
        for key in list(self._sel.get_map().values()):
            if isinstance(key.data, tuple) and key.data[0] is source:
                self._sel.unregister(key.fileobj)

    # ---- other threads ----------------------------------------------------------------------
    @property
    def on_loop(self) -> bool:
        """Whether the caller is the loop's thread."""
        return threading.get_ident() == self._ident

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` ran (the loop serves no more)."""
        return self._closed

    @property
    def queued(self) -> int:
        """Calls handed to the loop and not yet run (diagnostics, tests)."""
        return len(self._calls)

    @property
    def running(self) -> bool:
        """Whether the loop's thread serves (started, not stopped)."""
        return self._serving

    def wake(self) -> None:
        """End the loop's current sleep (any thread; cheap when it is awake already)."""
        # BlockingIOError: a wake-up is pending already; OSError: the loop has stopped.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def poke(self, source: LoopSource) -> None:
        """Make ``source``'s tick due now (any thread): at the end of the current pass on
        the loop thread, else at the loop's next pass (which this wakes). A source
        removed meanwhile is not ticked."""
        if threading.get_ident() == self._ident:
            if source in self._due:
                self._due[source] = 0.0
            return
        self._poked.append(source)
        self.wake()

    def call_soon_threadsafe(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the loop thread at its next pass (any thread)."""
        with self._lock:
            self._calls.append(call)
        self.wake()

    def run_sync(self, call: Callable[[], T], timeout_s: float = 5.0) -> T:
        """Run ``call`` on the loop thread and return its result: at once when the caller
        is the loop thread or the loop does not run. Raises what ``call`` raised, or
        TimeoutError when the loop did not run it within ``timeout_s``."""
        if self.on_loop or not self.running:
            return call()
        done: Future[T] = Future()

        def run() -> None:
            try:
                done.set_result(call())
            except BaseException as exc:  # handed to the waiting caller
                done.set_exception(exc)

        # A stall names the call, not this wrapper.
        run.__qualname__ = getattr(call, "__qualname__", run.__qualname__)
        self.call_soon_threadsafe(run)
        return done.result(timeout_s)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self, *, thread: bool = True) -> None:
        """Start serving: on a thread of its own, or (``thread`` False) on the caller's,
        which is the loop's thread from now on and serves once it calls :meth:`run` (a
        daemon's main thread, which has nothing else to do). Either way, calls handed
        over from another thread from now on wait for the loop."""
        self._serving = True
        if not thread:
            self._ident = threading.get_ident()  # its own calls run inline until run()
            return
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Serve on the caller's thread until :meth:`stop` (after ``start(thread=False)``
        on this thread)."""
        if self._thread is not None or self._ident != threading.get_ident():
            raise RuntimeError(f"{self.name}: run() serves on the thread that called "
                               "start(thread=False)")
        # Named as a loop thread of its own would be (logs, py-spy, the benches' split).
        threading.current_thread().name = self.name
        self._run()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop's thread (the sources' fds stay open: their owners close them)."""
        self._stop.set()
        self.wake()
        if not self.on_loop:  # wait for its end: its thread's, or run()'s on another thread
            if self._thread is not None:
                self._thread.join(timeout_s)
            elif self._in_run:
                self._finished.wait(timeout_s)
        self._closed = True
        if not self._in_run:
            # Calls handed over as it ended (or to a loop that never served): run them
            # here, as run_sync does once the loop no longer runs, so no waiter waits out
            # its timeout.
            self._run_calls()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        self._ident = threading.get_ident()
        self._in_run = True
        try:
            self._serve()
        finally:
            self._serving = False
            self._ident = None  # an id is reused by a later thread: it is not the loop
            self._in_run = False
            self._finished.set()

    def _serve(self) -> None:
        # Also when run() serves on a daemon's main thread: the process then shows as
        # the loop in ps and top, as every thread of it is named by what it does.
        name_os_thread(self.name)
        due = self._due
        ended = time.monotonic()
        while not self._stop.is_set():
            # Pokes from other threads are taken after the pass's calls, below: each one
            # also sent the wake-up byte, so a poke that comes later ends this sleep.
            soonest = min(due.values(), default=math.inf)
            # Read without the lock: a call queued after this check wakes the loop itself.
            wait = 0.0 if self._calls or soonest <= ended else min(MAX_WAIT_S,
                                                                     soonest - ended)
            try:
                events = self._sel.select(wait)
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("%s: select failed", self.name)
                self._stop.wait(MAX_WAIT_S)
                continue
            began = time.monotonic()  # one clock read each side of the pass's work
            for key, mask in events:
                if key.data is None:
                    self._drain_wake()
                    continue
                source, data = key.data
                try:
                    source.ready(data, mask)
                except Exception:  # never lose the loop to one source's connection
                    log.exception("%s: %r: handling %r failed", self.name, source, data)
            calls = self._run_calls()
            if self._poked:
                self._take_pokes()
            if min(due.values(), default=math.inf) <= began:
                self._tick_due(began)
            ended = time.monotonic()
            if ended - began > STALL_WARN_S:
                self._stalled(ended - began, _pass_of(events, calls))

    def _take_pokes(self) -> None:
        """Mark the sources other threads poked due now."""
        due, poked = self._due, self._poked
        while poked:
            source = poked.popleft()
            if source in due:
                due[source] = 0.0

    def _tick_due(self, now: float) -> None:
        """Tick each source due by ``now``, in the order they were added. A source is
        not due while its tick runs, so a poke then (its own or another's) stands."""
        due = self._due
        for source, when in list(due.items()):
            if when > now or source not in due:
                continue
            due[source] = math.inf
            try:
                after = source.tick(now)
            except Exception:
                log.exception("%s: %r: its housekeeping failed", self.name, source)
                after = now + MAX_WAIT_S  # not at once: a failing tick must not spin
            if source in due and after < due[source]:
                due[source] = after

    def _stalled(self, seconds: float, what: str) -> None:
        """One pass kept the loop ``seconds`` (``what``: what it handled): count it; log
        it (at most once per ``STALL_LOG_EVERY_S`` for the same ``what``)."""
        self.stalls += 1
        now = time.monotonic()
        if now - self._stall_logged.get(what, -STALL_LOG_EVERY_S) < STALL_LOG_EVERY_S:
            return
        if len(self._stall_logged) >= 64:  # what a pass handled varies: keep it bounded
            self._stall_logged.clear()
        self._stall_logged[what] = now
        log.warning("%s: one pass kept the loop %.0f ms (over %.0f ms), handling: %s; every "
                    "other source of this daemon waited meanwhile (%d stalls so far)",
                    self.name, seconds * 1e3, STALL_WARN_S * 1e3, what, self.stalls)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _run_calls(self) -> tuple[Callable[[], None], ...]:
        """Run the queued calls; the calls run (for a stall's report)."""
        if not self._calls:  # the usual pass; a call queued after this wakes the next one
            return ()
        with self._lock:
            calls, self._calls = self._calls, deque()
        for call in calls:
            try:
                call()
            except Exception:
                log.exception("%s: a call on the loop failed", self.name)
        return tuple(calls)


def _pass_of(events: list[tuple[selectors.SelectorKey, int]],
             calls: tuple[Callable[[], None], ...]) -> str:
    """What one pass of the loop handled, for a stall's report: the sources whose fds
    were ready (with what each registered), the calls handed to it, the housekeeping."""
    parts = [f"{type(key.data[0]).__name__} handling {type(key.data[1]).__name__}"
             for key, _mask in events if key.data is not None]
    parts += [f"a call ({getattr(call, '__qualname__', call)})" for call in calls]
    return "; ".join([*parts, "the housekeeping"])
