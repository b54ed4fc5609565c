"""Diagnostic: which thread of each daemon burns the CPU a request costs.

Starts a daemon pair (``tests.daemon_helpers.start_both``), runs a few warm-up
requests, then ``--n`` requests of ``--tokens`` through the scheduler API, and
prints each daemon's CPU per request split by OS thread (``/proc/PID/task/TID/stat``,
user + system). Python threads are named from ``py-spy dump`` (OS thread id to
Python thread name); the others keep their kernel name (gRPC's C core threads).

Process CPU (what ``bench_request`` reports) says how much a request costs; this
says where: a gRPC poller, the verbs progress thread (with rxe, the kernel's
sending inside ``ibv_post_send`` counts there), the send pool, the executor.

``--digests``: CRC32C, XXH3 and zlib's CRC32 over 10 MB first (MB/s), the cost of
integrity per byte on this machine.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvbeam.client import KvbeamClient
from kvbeam.scheduler import run_request
from tests.bench.bench_request import BENCH_DEADLINES, stat_cpu_s
from tests.daemon_helpers import start_both


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{tid: (kernel thread name, CPU seconds so far)} for every thread of ``pid``."""
    out: dict[int, tuple[str, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended between listing and reading
            continue
        out[int(task.name)] = (stat[stat.index("(") + 1:stat.rindex(")")], stat_cpu_s(stat))
    return out


def python_thread_names(pid: int) -> dict[int, str]:
    """{tid: Python thread name} from ``py-spy dump`` (empty without py-spy)."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    try:
        dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {int(m.group(1)): m.group(2) for m in re.finditer(r'^Thread (\d+) \([^)]*\): "([^"]*)"',
                                                             dump, re.M)}


#: Thread groups, by the name's start: every kvbeam thread names itself in the OS too
#: (kvbeam/threads.py), so the kernel's names (15 bytes: "kvbeam-verbs-pr") say which
#: thread is which without py-spy; py-spy's Python names, where it is installed, start
#: the same. Other threads (gRPC's C core, the main thread) keep kernel names, bracketed.
GROUPS = [("kvbeam-verbs", "verbs progress (posts, completions; rxe sends in ibv_post_send)"),
          ("kvbeam-tcp", "TCP data plane"),
          ("kvbeam-io", "executor (plan, post, digests, peer RPCs)"),
          ("kvbeam-digest", "digest pool (XXH3-128, --digest-threads)"),
          ("kvbeam-control", "RPC handlers (gRPC handler pool)"),
          ("kvbeam-loop", "daemon loop (engine and peer channels' frames, cores' API calls, "
                          "pushes, heartbeats, leftover transport events, the sweep)"),
          ("kvbeam-peer", "peer channel Abort pool"),
          ("Thread-1 (_serve)", "gRPC Python server loop (_serve)"),
          ("[", "other threads (gRPC's C core, the main thread)")]


def group_of(name: str) -> str:
    """The group a thread's name belongs to (``other`` when none matches)."""
    return next((g for prefix, g in GROUPS if name.startswith(prefix)), "other")


def thread_breakdown(p: KvbeamClient, d: KvbeamClient, pids: dict[str, int], tokens: int,
                     n: int, by_thread: bool = False) -> dict[str, dict[str, float]]:
    """CPU ms per request of ``tokens``, per daemon and thread group (``by_thread``: per
    thread, "NAME TID"), over ``n`` requests (after the caller's warm-up); each daemon's
    ``total`` and the median Send-to-Success (``send_to_success_ms``) beside them."""
    before = {role: thread_cpu(pid) for role, pid in pids.items()}
    times = []
    for i in range(n):
        r = run_request(p, d, f"thr-{tokens}-{i}-{time.monotonic_ns()}", tokens, i % 8,
                        timeout=120.0)
        if not r.ok:
            raise RuntimeError(f"request {r.request_id} ended {r.state}")
        times.append(r.send_to_success_s * 1e3)
    after = {role: thread_cpu(pid) for role, pid in pids.items()}
    out = {role: cpu_by_group(pid, before[role], after[role], n, by_thread=by_thread)
           for role, pid in pids.items()}
    out["send_to_success_ms"] = {"median": statistics.median(times)}
    return out


def cpu_by_group(pid: int, before: dict[int, tuple[str, float]],
                 after: dict[int, tuple[str, float]], n: int, *,
                 by_thread: bool = False) -> dict[str, float]:
    """CPU ms per request of ``pid`` between two :func:`thread_cpu` readings over ``n``
    requests, per thread group (``by_thread``: per thread, "NAME TID"), largest first,
    then ``total``. Python names from ``py-spy dump`` where it is installed, else the
    kernel's (kvbeam's threads name themselves there); others' kernel names in brackets."""
    names = python_thread_names(pid)
    groups: dict[str, float] = {}
    for tid, (kname, cpu) in after.items():
        spent = (cpu - before.get(tid, (kname, 0.0))[1]) * 1e3 / n
        name = names.get(tid) or (kname if kname.startswith("kvbeam-") else f"[{kname}]")
        group = f"{name} {tid}" if by_thread else group_of(name)
        groups[group] = groups.get(group, 0.0) + spent
    return {**dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "total": sum(groups.values())}


def digest_speeds(mb: int = 10) -> None:
    """MB/s of each candidate digest over ``mb`` MB of random bytes (best of 3)."""
    import zlib

    import crc32c
    import numpy as np
    import xxhash

    data = np.random.default_rng(1).integers(0, 256, mb << 20, dtype=np.uint8).tobytes()
    cands: dict[str, Callable[[bytes], object]] = {
        "crc32c": crc32c.crc32c, "zlib.crc32": zlib.crc32,
        "xxh3_64": xxhash.xxh3_64_intdigest, "xxh3_128": xxhash.xxh3_128_intdigest}
    for name, fn in cands.items():
        best = min(_timed(fn, data) for _ in range(3))
        print(f"digest {name:>10}: {mb / best:8.1f} MB/s ({best * 1e3:.1f} ms for {mb} MB)",
              flush=True)


def _timed(fn: Callable[[bytes], object], data: bytes) -> float:
    t0 = time.perf_counter()
    fn(data)
    return time.perf_counter() - t0


def main() -> None:
    """Run one pair and print the per-thread table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", default="rdma", choices=["rdma", "tcp"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--integrity", default="true", choices=["true", "false"])
    parser.add_argument("--extra", default="", help="more daemon flags, space-separated")
    parser.add_argument("--digests", action="store_true")
    args = parser.parse_args()
    if args.digests:
        digest_speeds()
    flags = ["--integrity", args.integrity, *BENCH_DEADLINES, *args.extra.split()]
    prefill, decode = start_both(transport=args.transport, prefill_extra=flags,
                                 decode_extra=flags)
    pids = {"prefill": prefill.proc.pid, "decode": decode.proc.pid}
    try:
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            for i in range(3):
                run_request(p, d, f"warm-{i}", args.tokens, 1, timeout=120.0)
            out = thread_breakdown(p, d, pids, args.tokens, args.n, by_thread=True)
        print(f"\n{args.n} requests of {args.tokens} tokens over {args.transport} "
              f"(integrity {args.integrity}, {args.extra or 'default flags'}): median "
              f"{out['send_to_success_ms']['median']:.1f} ms Send-to-Success", flush=True)
        for role in pids:
            per = out[role]
            print(f"{role}: {per.pop('total'):.1f} ms CPU per request")
            for name, spent in per.items():
                if spent > 0:
                    print(f"  {spent:8.2f} ms  {name}")
    finally:
        prefill.stop()
        decode.stop()


if __name__ == "__main__":
    main()
