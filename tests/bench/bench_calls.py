"""Benchmark: Python calls per small request in each daemon (host, TCP, engine channel).

What limits a small request's daemon CPU is the Python it runs (docs/performance.md,
"What limits the missed targets"), and the steadiest measure of that is a count, not a
time: the number of Python function calls (builtins included) each daemon makes per
request. Two runs of the engine channel's sequential phase (bench_engine_channel's
daemons and engine workers, 128-token requests), a long one and a short one, each with
every thread of both daemons under cProfile (tests/bench/calls_site/sitecustomize.py,
armed only by this bench's environment); the short run's counts are taken from the
long run's, so start-up, attach, handshake and warm-up cancel out. Prints calls per
request per daemon, by file and the top functions, and the machine-readable lines
``python_calls_per_request_prefill=N`` and ``python_calls_per_request_decode=N``.

Run: ``python -m tests.bench.bench_calls [--requests 300] [--baseline 50]`` (part of
``make bench-host``). cProfile slows each call down, so nothing here is a time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import pstats
import tempfile
from pathlib import Path

from tests.bench.bench_engine_channel import engine_workers

SITE = str(Path(__file__).resolve().parent / "calls_site")
ROOT = str(Path(__file__).resolve().parents[2])
Stats = dict[tuple[str, int, str], tuple[int, int, float, float, object]]


def run(requests: int, out: str) -> tuple[int, int]:
    """``requests`` sequential 128-token requests (after 5 warm-up ones) with both daemons
    profiled into ``out``; their pids (prefill, decode)."""
    env = {"KVBEAM_BENCH_PROFILE_DIR": out,
           "PYTHONPATH": os.pathsep.join([SITE, ROOT, os.environ.get("PYTHONPATH", "")])}
    with engine_workers(env) as (prefill, decode, pe, de):  # SIGTERM: profiles written
        for i in range(5 + requests):
            rid = f"c{i}"
            de.cmd(f"reserve {rid} {prefill.address}")
            pe.cmd(f"send {rid} {decode.address}")
            de.cmd(f"done {rid}")
            state = pe.cmd(f"wait {rid}")
            if state != "Success":
                raise RuntimeError(f"request {rid} ended {state}")
        return prefill.proc.pid, decode.proc.pid


def load(out: str, pid: int) -> Stats:
    """Every thread's profile of process ``pid``, merged."""
    files = sorted(glob.glob(os.path.join(out, f"{pid}-*.prof")))
    if not files:
        raise RuntimeError(f"daemon {pid} wrote no profile into {out}")
    stats = pstats.Stats(files[0])
    for f in files[1:]:
        stats.add(f)
    return stats.stats  # type: ignore[attr-defined,no-any-return]


def where(path: str) -> str:
    """A function's file as the tables name it: the repository path, a package, or the
    standard library's module."""
    if path == "~":
        return "builtins"
    if "site-packages/" in path:
        return path.split("site-packages/")[1].split("/")[0]
    if path.startswith(ROOT + "/"):
        return path[len(ROOT) + 1:]
    return "stdlib:" + os.path.basename(path)


def per_request(long: Stats, short: Stats, n: int) -> collections.Counter[tuple[str, int, str]]:
    """Calls per request of each function: the long run's less the short run's, over
    the requests between them."""
    out: collections.Counter[tuple[str, int, str]] = collections.Counter()
    for key, value in long.items():
        calls = value[1] - (short[key][1] if key in short else 0)
        if calls > 0:
            out[key] = calls / n  # type: ignore[assignment]
    return out


def main() -> None:
    """Print the tables and the two machine-readable lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="the long run's requests")
    parser.add_argument("--baseline", type=int, default=50, help="the short run's requests")
    parser.add_argument("--top", type=int, default=12, help="functions listed per daemon")
    args = parser.parse_args()
    if args.requests <= args.baseline:
        parser.error("--requests must be more than --baseline")
    with tempfile.TemporaryDirectory(prefix="kvbeam-calls-prof-") as root:
        long_dir, short_dir = os.path.join(root, "long"), os.path.join(root, "short")
        long_pids = run(args.requests, long_dir)
        short_pids = run(args.baseline, short_dir)
        n = args.requests - args.baseline
        totals = {}
        for i, role in enumerate(("prefill", "decode")):
            calls = per_request(load(long_dir, long_pids[i]), load(short_dir, short_pids[i]), n)
            totals[role] = round(sum(calls.values()))
            by_file: collections.Counter[str] = collections.Counter()
            for (path, _line, _name), c in calls.items():
                by_file[where(path)] += c
            print(f"# {role}: {totals[role]} Python calls per 128-token request "
                  f"({args.requests} less {args.baseline} sequential requests, engine "
                  "channel, TCP)")
            print("#   by file: " + "; ".join(f"{f} {c:.0f}" for f, c in by_file.most_common(8)))
            for (path, line, name), c in calls.most_common(args.top):
                print(f"#   {c:7.1f}  {where(path)}:{line} {name}")
    print(f"python_calls_per_request_prefill={totals['prefill']}")
    print(f"python_calls_per_request_decode={totals['decode']}")


if __name__ == "__main__":
    main()
