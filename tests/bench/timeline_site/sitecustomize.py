"""Bench only (tests/bench/bench_timeline.py): time chosen functions of this process.

Python imports ``sitecustomize`` at start-up from ``sys.path``; bench_timeline starts the
daemons with this folder on ``PYTHONPATH`` and ``KVBEAM_BENCH_TIMELINE_DIR`` set, and
nothing else does: production code knows nothing of it. Each function named in
``KVBEAM_BENCH_TIMELINE_SPECS`` (``module:Class.method`` or ``module:function``, comma
separated) is wrapped to record when each call started and ended (CLOCK_MONOTONIC, the
same clock in every process) and on which thread; at exit the records go to
``KVBEAM_BENCH_TIMELINE_DIR/PID.tl``, one per line: tag, start ns, end ns, thread name.
A wrapped call costs about a microsecond more.
"""

from __future__ import annotations

import os

_OUT = os.environ.get("KVBEAM_BENCH_TIMELINE_DIR", "")
if _OUT:
    import atexit
    import importlib
    import threading
    import time
    from typing import Any

    _records: list[tuple[str, int, int, str]] = []

    def _wrap(owner: Any, name: str, tag: str) -> None:
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic_ns()
            try:
                return fn(*args, **kwargs)
            finally:  # list.append is atomic: no lock on the timed path
                _records.append((tag, start, time.monotonic_ns(),
                                 threading.current_thread().name))

        setattr(owner, name, timed)

    for spec in filter(None, os.environ.get("KVBEAM_BENCH_TIMELINE_SPECS", "").split(",")):
        module, _, path = spec.partition(":")
        owner: Any = importlib.import_module(module)
        *parents, attr = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        _wrap(owner, attr, path)

    def _dump() -> None:
        os.makedirs(_OUT, exist_ok=True)
        with open(os.path.join(_OUT, f"{os.getpid()}.tl"), "w", encoding="utf-8") as f:
            for tag, start, end, thread in _records:
                f.write(f"{tag} {start} {end} {thread}\n")

    atexit.register(_dump)
