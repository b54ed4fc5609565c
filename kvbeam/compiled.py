"""kvbeam's optional compiled helpers: loaded once, each with the words its process logs.

Every helper (the planner, the blocks helper, the owner book, the list codec; the WR
poster and the digests say more and load their own) is built at install when a C
compiler is there, and optional: where it did not load, the Python and numpy path it
replaced does the same work, slower, and stays its oracle in the tests. A module using
one keeps the loaded module and a ``COMPILED`` flag (tests switch it off), and says in
one line how it works (the daemon logs those lines at start).
"""

from __future__ import annotations

import importlib
from typing import Any


def load_helper(name: str, how: str, fallback: str) -> tuple[Any, str]:
    """The helper module ``name`` and the line saying how this process works with it:
    ``compiled (NAME, HOW)``, or None and ``FALLBACK (the compiled helper did not load:
    WHY)`` where it was not built (no C compiler at install) or is stale."""
    try:
        return importlib.import_module(name), f"compiled ({name}, {how})"
    except ImportError as exc:
        return None, f"{fallback} (the compiled helper did not load: {type(exc).__name__}: {exc})"


def helper_line(module: Any, why: str, compiled: bool, fallback: str) -> str:
    """The line for a helper loaded by :func:`load_helper` whose user's ``COMPILED`` flag is
    ``compiled``: ``why``, or ``FALLBACK (switched off)`` when it loaded but is off."""
    return why if compiled or module is None else f"{fallback} (switched off)"
