"""Polling for the tests: wait for a condition that another process or thread makes true."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[..., object], timeout: float, interval: float = 0.05) -> bool:
    """Call ``predicate()`` until it returns truthy or ``timeout`` seconds pass (``...``:
    a lambda that binds a loop variable as a default argument is called with none).

    Returns whether it did; it is asked once more at the deadline, so a condition that
    came true during the last sleep still counts.
    """
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
