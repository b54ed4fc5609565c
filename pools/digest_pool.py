"""A small pool of threads that compute a request's digests in parallel.

``xxhash`` (python-xxhash 3.x/4.x) releases the GIL while it digests an input over
64 KiB (``XXHASH_GIL_MINSIZE`` in its C source; ``make bench-host``'s digest lines
measure it), so threads digesting different buffers run on different cores: a
61-layer request's 182 buffers are split into contiguous groups of about equal
bytes, one task each, and the job's result is the digests in the buffers' order
(one bytes object, 16 per buffer), exactly what
:func:`kvbeam.pools.digest.request_digests` returns on one thread.
Buffers under 64 KiB (the per-slot states) hold the GIL while digested, but they
are a few percent of a large request's bytes. ``numpy.take`` (a scattered list's
gather) releases the GIL too. With the compiled helper (:func:`kvbeam.pools.digest.
digest_many`) a task is one call that holds the GIL for none of its parts and gathers
nothing.

Prefill starts its job before it posts the final writes and sends the digests once
it is done; decode starts its job when the writes landed and compares once it is
done. Neither holds a lock while it waits (docs/concurrency.md).

``threads=0`` computes on the calling thread (the job is done when returned), and so
does a job too small to gain from the threads (:data:`INLINE_BELOW_BYTES`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from kvbeam.pools import digest
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest import DigestParts, digest_many, digest_parts
from kvbeam.pools.plan import IndexLists
from kvbeam.threads import name_os_thread

#: The pool threads' name, in Python and in the OS (``top -H``, /proc/PID/task/TID/comm).
THREAD_NAME = "kvbeam-digest"
#: Tasks per thread a job is split into: more evens out unequal groups, fewer costs
#: less per task (a task is a future and a thread wake-up, some 20 us).
TASKS_PER_THREAD = 2
#: Inputs over this size are digested with the GIL released (``XXHASH_GIL_MINSIZE``).
GIL_RELEASE_BYTES = 64 << 10
#: A job with fewer bytes than this in parts that release the GIL runs on the calling
#: thread: handing it to the pool costs more than it saves. Measured for a 128-token
#: request of docker/config/prefill.yaml (27 parts, 444 KB, none over 32 KiB, so no
#: part would run in parallel anyway): 96 us on the calling thread, 210 us (223 us of
#: CPU) through a 2-thread pool, and 2.6 ms of wall time through the pool while the
#: machine was loaded (the pool thread's wake-up). At a few GB/s per core, 2 MiB is a
#: few hundred microseconds: about where two threads start to pay for the hand-off.
INLINE_BELOW_BYTES = 2 << 20


def split_parts(parts: DigestParts, groups: int) -> list[DigestParts]:
    """``parts`` cut into at most ``groups`` contiguous runs of about equal bytes, in
    order (every part in exactly one run; a part of zero bytes goes with its neighbours)."""
    sizes = parts.part_bytes()
    total = sum(sizes)
    if groups <= 1 or len(parts) <= 1 or total == 0:
        return [parts] if len(parts) else []
    out: list[DigestParts] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        acc += size
        # Cut once this run reaches its share of the bytes (the last run takes the rest).
        if len(out) < groups - 1 and acc * groups >= total * (len(out) + 1):
            out.append(parts[start:i + 1])
            start = i + 1
    if start < len(parts):
        out.append(parts[start:])
    return out


def _parallel_bytes(parts: DigestParts) -> int:
    """Bytes of ``parts`` that a pool thread digests with the GIL released: all of them
    with the compiled helper, the parts over 64 KiB with python-xxhash."""
    if digest.COMPILED:
        return parts.nbytes
    return sum(n for n in parts.part_bytes() if n > GIL_RELEASE_BYTES)


def _digest_all(parts: DigestParts) -> bytes:
    """A pool task: the GIL released, so the pool's threads hash on different cores."""
    return digest_many(parts, release_gil=True)


class DigestJob:
    """One request's digests being computed; :meth:`result` waits for them all."""

    def __init__(self, tasks: list[Future[bytes]], *, inline: bool = False) -> None:
        self._tasks = tasks
        #: Computed on the calling thread before :meth:`DigestPool.digests` returned (a
        #: small job, or a pool without threads): done, nothing to overlap with it.
        self.inline = inline
        #: A job done on the calling thread (:meth:`computed`): its result, or its error.
        self._value: bytes | None = None
        self._error: Exception | None = None
        #: A job joined from others (:meth:`joined`): their results, in order.
        self._parts: list[DigestJob] = []

    @classmethod
    def computed(cls, value: bytes | None, error: Exception | None = None) -> DigestJob:
        """A job done on the calling thread: its digests, or the exception that
        :meth:`result` re-raises. No future: a small request's job is on its path,
        and a Future (with its Condition) costs more than the job's own bookkeeping."""
        job = cls([], inline=True)
        job._value, job._error = value, error
        return job

    @classmethod
    def joined(cls, jobs: Sequence[DigestJob]) -> DigestJob:
        """One job of ``jobs``' digests, in order (runs of one request's buffers started
        at different times: its sub-batches as each became whole, then the rest)."""
        if len(jobs) == 1:
            return jobs[0]
        if all(j.inline for j in jobs):
            try:
                return cls.computed(b"".join(j.result() for j in jobs))
            except Exception as exc:
                return cls.computed(None, exc)
        job = cls([])
        job._parts = list(jobs)
        return job

    def done(self) -> bool:
        """True once every task finished (:meth:`result` will not wait)."""
        return all(t.done() for t in self._tasks) and all(j.done() for j in self._parts)

    def result(self, timeout: float | None = None) -> bytes:
        """The digests (16 bytes each), in the buffers' order; re-raises a task's exception
        (e.g. an index outside its buffer). ``timeout``: seconds for the whole job
        (TimeoutError)."""
        if self._error is not None:
            raise self._error
        if self._value is not None:
            return self._value
        if self._parts:
            return b"".join(job.result(timeout) for job in self._parts)
        if len(self._tasks) == 1:
            return self._tasks[0].result(timeout)
        # In order: a later task may finish first.
        return b"".join(task.result(timeout) for task in self._tasks)


class DigestPool:
    """Threads that digest a request's buffers in parallel (see the module docstring).

    Args:
        threads: how many (``--digest-threads``, default
            :data:`kvbeam.server.settings.DEFAULT_DIGEST_THREADS`); 0: digest on the
            calling thread.
        inline_below: a job with fewer bytes than this in parts over
            :data:`GIL_RELEASE_BYTES` runs on the calling thread (default
            :data:`INLINE_BELOW_BYTES`; 0: every job goes to the threads).

    The threads are started on first use, at most ``threads`` of them, and live
    until :meth:`close` (one pool per daemon, never a thread per request).
    """

    def __init__(self, threads: int, *, inline_below: int = INLINE_BELOW_BYTES) -> None:
        if threads < 0:
            raise ValueError(f"digest threads must be >= 0, got {threads}")
        self.threads = threads
        #: Jobs with fewer GIL-releasing bytes run on the calling thread (0: none do).
        self.inline_below = inline_below
        self._executor = (ThreadPoolExecutor(max_workers=threads,
                                             thread_name_prefix=THREAD_NAME,
                                             initializer=name_os_thread)
                          if threads else None)

    def digests(self, side: AllocatedSide, indices: IndexLists, *, include_kv: bool = True,
                include_states: bool = True, draft: IndexLists | None = None,
                windows: Sequence[tuple[int, int] | None] | None = None) -> DigestJob:
        """Start digesting what :func:`~kvbeam.pools.digest.request_digests` would (same
        arguments, same result); returns at once with threads, when done without."""
        return self.start(digest_parts(side, indices, include_kv=include_kv,
                                       include_states=include_states, draft=draft,
                                       windows=windows))

    def start(self, parts: DigestParts) -> DigestJob:
        """Start digesting ``parts`` (:func:`~kvbeam.pools.digest.digest_parts`, or a run of
        them: a sub-batch's buffers); the job's result is their digests, in order."""
        if self._executor is None or _parallel_bytes(parts) < self.inline_below:
            try:
                # On the calling thread: keep the GIL (digest_many says why).
                return DigestJob.computed(digest_many(parts, release_gil=False))
            except Exception as exc:  # the same as a pool task's: result() raises it
                return DigestJob.computed(None, exc)
        groups = split_parts(parts, self.threads * TASKS_PER_THREAD)
        return DigestJob([self._executor.submit(_digest_all, g) for g in groups])

    def close(self) -> None:
        """Stop the threads (a job under way finishes; none is accepted after)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> DigestPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
