"""Bench only (tests/bench/bench_calls.py): profile every thread of this process.

Python imports ``sitecustomize`` at start-up from ``sys.path``; bench_calls starts the
daemons with this folder on ``PYTHONPATH`` and ``KVBEAM_BENCH_PROFILE_DIR`` set, and
nothing else does: production code knows nothing of it. Each thread gets its own
``cProfile.Profile`` (cProfile sees one thread at a time); at exit every profile is
written to ``KVBEAM_BENCH_PROFILE_DIR/PID-N.prof``.
"""

from __future__ import annotations

import os

_OUT = os.environ.get("KVBEAM_BENCH_PROFILE_DIR", "")
if _OUT:
    import atexit
    import cProfile
    import sys
    import threading

    _profiles: list[cProfile.Profile] = []
    _lock = threading.Lock()

    def _start(*_args: object) -> None:
        """The first profile event of a new thread: give it a profiler of its own."""
        profile = cProfile.Profile()
        with _lock:
            _profiles.append(profile)
        sys.setprofile(None)
        profile.enable()

    threading.setprofile(_start)
    _main = cProfile.Profile()
    _profiles.append(_main)
    _main.enable()

    def _dump() -> None:
        os.makedirs(_OUT, exist_ok=True)
        for i, profile in enumerate(list(_profiles)):
            try:
                profile.disable()
                profile.dump_stats(os.path.join(_OUT, f"{os.getpid()}-{i}.prof"))
            except Exception:  # a thread's profiler may be mid-call: skip it
                pass

    atexit.register(_dump)
