"""The daemon's I/O executor: a thread pool whose jobs' errors are logged, never dropped.

Every blocking step of a core (a peer call, a handshake, a link's release) is a
fire-and-forget ``submit`` on this pool: no caller keeps the future. A plain
``ThreadPoolExecutor`` keeps a job's exception in that future, so an unexpected error
(an Abort that could not reach decode, say) would vanish without a line in the log
and leave its request to its deadline. This one logs it with its traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class LoggingExecutor(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` that logs the exception of every job that raised."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on the pool; an exception it raises is logged."""
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(lambda done: _log_failure(done, fn))
        return future


def _log_failure(done: Future[Any], fn: Callable[..., Any]) -> None:
    if done.cancelled():
        return
    exc = done.exception()
    if exc is not None:
        name = getattr(fn, "__qualname__", repr(fn))
        log.error("background job %s failed: %s", name, exc, exc_info=exc)
