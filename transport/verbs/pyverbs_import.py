"""Import pyverbs without letting it reconfigure the process's logging.

pyverbs 44's ``base`` module, on import, adds a StreamHandler to the root logger
and sets the root level to INFO. A daemon that configures logging afterwards
(``logging.basicConfig`` is a no-op once the root has a handler) would silently
lose its own configuration, so the first import goes through here and undoes it.
"""

from __future__ import annotations

import logging
import threading

_lock = threading.Lock()


def import_pyverbs() -> None:
    """Import pyverbs, restoring the root logger's handlers and level; ImportError if absent."""
    with _lock:
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        try:
            import pyverbs.base
            import pyverbs.device  # noqa: F401
        finally:
            for handler in root.handlers[:]:
                if handler not in handlers:
                    root.removeHandler(handler)
            root.setLevel(level)
