"""kvbeam's threads, named in the operating system too.

Python 3.11 names only its own ``Thread`` object: ``top -H``, ``ps -L``, ``perf`` and
``/proc/PID/task/TID/comm`` would show every thread of a daemon under the process's name.
Each kvbeam thread names itself first thing (:func:`name_os_thread`; a pool's threads
through ``initializer=name_os_thread``), cut to the kernel's 15 bytes (``kvbeam-peer-channel``
shows as ``kvbeam-peer-cha``), so a thread's CPU can be told from outside the process
(``make bench-host`` splits a request's CPU by thread from these names).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)

#: prctl(2)'s option that names the calling thread (Linux).
_PR_SET_NAME = 15
#: The kernel keeps this many bytes of a thread's name (TASK_COMM_LEN less its NUL).
OS_NAME_BYTES = 15
_libc: Any = None


def name_os_thread(name: str | None = None) -> None:
    """Name the calling thread in the OS: ``name``, or its Python name (a pool's
    ``initializer``: ``kvbeam-io_0``). Linux only; elsewhere, or without prctl, nothing
    happens (only the name outside Python is lost)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    text = (name or threading.current_thread().name).encode()[:OS_NAME_BYTES]
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(_PR_SET_NAME, text, 0, 0, 0)
    except (OSError, AttributeError) as exc:
        log.debug("could not name thread %s in the OS: %s", text, exc)
