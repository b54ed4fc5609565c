"""Benchmark: whole DSV4 requests through the daemons over RDMA, beside ib_write_bw.

Run in the soft-RoCE guest (``make bench`` runs it through ``bench_suite``) or on
any host with an RDMA device. Starts a prefill and a decode daemon (RDMA; with
integrity on, decode checks the CRC32C of every moved buffer before Success),
sends requests of several lengths one at a time through the scheduler API
(:func:`kvbeam.scheduler.run_request`: Reserve on decode, Send on prefill, wait
on decode, Release) and reports the median
Send-to-Success time and bytes/s, next to ``ib_write_bw`` at 64 KiB measured in
the same run, and the raw transport time for the same bytes.

The last line is machine-readable: ``ratio_vs_ib_write_bw=0.NN`` (32k-token
request bytes/s over ib_write_bw's). Each row also has each daemon's process CPU
time per request (``/proc/PID/stat``, user + system, all threads).

``--host-json FILE``: the host figures instead (TCP on loopback, no RDMA): 128- and
32k-token requests, written to FILE for ``make bench`` to fold into its report,
ending with ``host_small_request_ms=N.N``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvbeam.client import KvbeamClient
from kvbeam.procs import DaemonProcess
from kvbeam.scheduler import drive, run_request
from tests.bench.bench_transport import ib_write_bw
from tests.bench.request_blocks import request_case
from tests.daemon_helpers import start_both

#: Seconds each daemon's idle CPU rate is measured before the first request.
IDLE_S = 2.0
#: The harness's deadlines (tests/daemon_helpers.SLOW_GUEST: 10 s without progress, peer
#: lost after 10 s of unanswered heartbeats) are for fault tests; a benchmark that queues
#: 16 requests on one link under TCG measures how long they take instead of failing them.
BENCH_DEADLINES = ["--deadline-transfer-s", "120", "--peer-timeout-s", "60"]

#: A callback run on a daemon pair after its rows: (prefill, decode, clients to each).
PairWork = Callable[[DaemonProcess, DaemonProcess, KvbeamClient, KvbeamClient], None]


@dataclass
class RequestRow:
    """One request length in one mode: median and best Send-to-Success time."""

    mode: str
    integrity: bool
    tokens: int
    bytes: int
    median_ms: float
    best_ms: float
    runs_ms: list[float]
    #: Process CPU time (user + system, every thread) per timed request, ms.
    prefill_cpu_ms: float = float("nan")
    decode_cpu_ms: float = float("nan")
    #: Of that, what the idle daemon burns in the same wall time (heartbeats, sweeps,
    #: progress threads): its CPU rate before any request, times the wall time, per request.
    prefill_idle_ms: float = float("nan")
    decode_idle_ms: float = float("nan")

    @property
    def gbps(self) -> float:
        """Request bytes over the median Send-to-Success time."""
        return self.bytes * 8 / self.median_ms / 1e6

    def as_dict(self) -> dict[str, Any]:
        """For the JSON file."""
        return {**asdict(self), "gbps": self.gbps}


def stat_cpu_s(stat: str) -> float:
    """User + system CPU seconds from the text of a ``/proc/PID/stat`` (a process, all its
    threads) or ``/proc/PID/task/TID/stat`` (one thread)."""
    # Fields after the command name (which may hold spaces) in parentheses: utime is the
    # 14th field of the line, stime the 15th, in clock ticks.
    fields_ = stat[stat.rindex(")") + 2:].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (/proc/PID/stat)."""
    return stat_cpu_s(Path(f"/proc/{pid}/stat").read_text())


def _spy(pid: int, seconds: float, out: str) -> subprocess.Popen[bytes]:
    """py-spy sampling one daemon: only threads holding the GIL (Python CPU, not waits)."""
    return subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record",
                             "-p", str(pid), "-r", "250", "-d", str(int(seconds)), "-f", "raw",
                             "--threads", "--gil", "-o", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _profile_loop(p: KvbeamClient, d: KvbeamClient, pids: tuple[int, int], seq_len: int,
                  seconds: float, out_dir: str) -> None:
    """Requests of ``seq_len`` tokens back to back for ``seconds`` under py-spy (both daemons).

    Writes ``prefill.txt`` and ``decode.txt`` (py-spy raw, collapsed stacks) and
    ``requests.txt`` (count and median ms) to ``out_dir``; summarise them with
    :mod:`tests.bench.profile_summary`.
    """
    os.makedirs(out_dir, exist_ok=True)

    def one(rid: str) -> float:
        r = run_request(p, d, rid, seq_len, 1, timeout=120.0)
        if not r.ok:
            raise SystemExit(f"request {rid} ended {r.state}")
        return r.send_to_success_s

    for i in range(3):
        one(f"warm-{i}")
    spies = [_spy(pid, seconds, os.path.join(out_dir, f"{name}.txt"))
             for pid, name in zip(pids, ("prefill", "decode"), strict=True)]
    time.sleep(2.0)  # py-spy attaches
    times: list[float] = []
    end = time.monotonic() + seconds - 3.0
    while time.monotonic() < end:
        times.append(one(f"prof-{len(times)}"))
    for spy in spies:
        spy.wait(180)  # py-spy writes its file after -d; under a loaded TCG guest 60 s was short
    with open(os.path.join(out_dir, "requests.txt"), "w") as f:
        f.write(f"{len(times)} requests of {seq_len} tokens, median "
                f"{statistics.median(times) * 1e3:.1f} ms, window {seconds - 3.0:.0f} s\n")


def profile_requests(paged: bool, seq_len: int, seconds: float, out_dir: str,
                     transport: str = "rdma") -> None:
    """Start a daemon pair and run :func:`_profile_loop` on it."""
    prefill, decode = start_both(paged=paged, transport=transport)
    try:
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            _profile_loop(p, d, (prefill.proc.pid, decode.proc.pid), seq_len, seconds, out_dir)
    finally:
        prefill.stop()
        decode.stop()


def run_requests(paged: bool, integrity: bool, lens: list[int], repeat: int,
                 extra: list[str] | None = None, profile_dir: str | None = None,
                 profile_seconds: float = 20.0, transport: str = "rdma",
                 on_pair: PairWork | None = None) -> list[RequestRow]:
    """Start a daemon pair, time ``repeat`` requests of each length (after one warm-up),
    with each daemon's CPU time over the timed requests.

    Then, with ``profile_dir``, a profile of 128-token requests (py-spy), then
    ``on_pair`` (more measurements on the same pair).
    """
    flags = ["--integrity", "true" if integrity else "false", *BENCH_DEADLINES,
             *(extra or [])]
    prefill, decode = start_both(paged=paged, transport=transport, prefill_extra=flags,
                                 decode_extra=flags)
    pids = (prefill.proc.pid, decode.proc.pid)
    idle0, t_idle = [cpu_s(pid) for pid in pids], time.monotonic()
    time.sleep(IDLE_S)
    t_idle = time.monotonic() - t_idle
    idle_rate = [(cpu_s(pid) - c) / t_idle for pid, c in zip(pids, idle0, strict=True)]
    mode = "paged" if paged else "unified"
    rows = []
    try:
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            n = 0
            for seq_len in lens:
                times: list[float] = []
                nbytes = 0
                cpu0: list[float] = []
                t0 = 0.0
                for i in range(repeat + 1):  # the first is a warm-up
                    if i == 1:
                        cpu0, t0 = [cpu_s(pid) for pid in pids], time.monotonic()
                    n += 1
                    r = run_request(p, d, f"bench-{n}", seq_len, n % 8, timeout=120.0)
                    if not r.ok:
                        raise SystemExit(f"request {r.request_id} ended {r.state}")
                    nbytes = r.bytes
                    times.append(r.send_to_success_s * 1e3)
                cpu_ms = [(cpu_s(pid) - c) * 1e3 / repeat for pid, c in zip(pids, cpu0,
                                                                            strict=True)]
                wall = time.monotonic() - t0
                idle_ms = [rate * wall * 1e3 / repeat for rate in idle_rate]
                rows.append(RequestRow(mode, integrity, seq_len, nbytes,
                                       statistics.median(times[1:]), min(times[1:]), times[1:],
                                       *cpu_ms, *idle_ms))
            if profile_dir:
                try:
                    _profile_loop(p, d, (prefill.proc.pid, decode.proc.pid), 128,
                                  profile_seconds, profile_dir)
                except (OSError, subprocess.SubprocessError) as exc:  # no py-spy: no profile
                    print(f"profile skipped: {exc!r}", file=sys.stderr)
            if on_pair:  # last: a failure there (e.g. an overload) spoils nothing else
                on_pair(prefill, decode, p, d)
    finally:
        prefill.stop()
        decode.stop()
    return rows


def aggregate(prefill: str, decode: str, tokens: int = 8192, concurrency: int = 16,
              rounds: int = 3, source_slots: int = 8) -> dict[str, Any]:
    """``concurrency`` requests of ``tokens`` at once through :func:`kvbeam.scheduler.drive`,
    ``rounds`` times after a warm-up round: total bytes / wall time of each round, median.

    A round where a request fails ends the measurement: the result then says how many
    failed and how (no ``gbps``: a partial round is not an aggregate rate).
    """
    runs: list[float] = []
    out: dict[str, Any] = {"tokens": tokens, "concurrency": concurrency, "runs_gbps": runs}
    for k in range(rounds + 1):
        t0 = time.monotonic()
        res = drive(prefill, decode, [tokens] * concurrency, source_slots=source_slots,
                    concurrency=concurrency, timeout=300.0, prefix=f"agg{k}-{time.monotonic_ns()}")
        wall = time.monotonic() - t0
        bad = [r for r in res if not r.ok]
        if bad:
            return {**out, "error": f"round {k}: {len(bad)} of {len(res)} requests failed "
                                    f"after {wall:.1f} s", "failures": [r.state for r in bad]}
        if k:
            runs.append(sum(r.bytes for r in res) * 8 / wall / 1e9)
    return {**out, "gbps": statistics.median(runs)}


def fragmented(p: KvbeamClient, d: KvbeamClient, lens: Sequence[int], styles: Sequence[str],
               repeat: int) -> list[dict[str, Any]]:
    """Send-to-Success of requests with the engine-chosen lists of
    :func:`tests.bench.request_blocks.request_case` (the same lists the Mooncake peer
    moves), median of ``repeat`` after a warm-up; every request must end CRC32C-verified."""
    rows = []
    for style in styles:
        for tokens in lens:
            src, dst = request_case(tokens, style).client_lists()
            ms = []
            for i in range(repeat + 1):
                r = run_request(p, d, f"{style}-{tokens}-{i}-{time.monotonic_ns()}", tokens, 0,
                                src_indices=src, dst_indices=dst, timeout=120.0)
                if not r.verified:
                    raise RuntimeError(f"request {r.request_id} ended {r.state} (not verified)")
                if i:
                    ms.append(r.send_to_success_s * 1e3)
            rows.append({"lists": style, "tokens": tokens, "bytes": r.bytes, "runs_ms": ms,
                         "median_ms": statistics.median(ms)})
    return rows


def host_figures(repeat: int = 20) -> dict[str, Any]:
    """The host figures: 128- and 32k-token requests over TCP on loopback (unified,
    integrity on), each daemon's CPU per request beside them."""
    rows = run_requests(False, True, [128, 32768], repeat, transport="tcp")
    return {"small_request_ms": rows[0].median_ms, "host": platform.node(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "requests": [r.as_dict() for r in rows]}


def main() -> None:
    """Run and print the table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lens", default="128,1024,8192,32768")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--paged", action="store_true")
    parser.add_argument("--no-integrity", action="store_true")
    parser.add_argument("--daemon-flags", default="",
                        help="more flags for both daemons, space-separated (e.g. "
                             "'--qps-per-peer 2': the whole-request QP table of "
                             "docs/performance.md)")
    parser.add_argument("--profile", metavar="DIR",
                        help="profile the first length's requests with py-spy instead")
    parser.add_argument("--profile-seconds", type=float, default=25.0)
    parser.add_argument("--host-json", metavar="FILE",
                        help="host figures over TCP on loopback, written to FILE")
    args = parser.parse_args()
    if args.host_json:
        res = host_figures(max(args.repeat, 20))
        Path(args.host_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.host_json).write_text(json.dumps(res, indent=1))
        for r in res["requests"]:
            print(f"host tcp {r['tokens']:>6} tokens: {r['median_ms']:.1f} ms Send-to-Success, "
                  f"CPU per request prefill {r['prefill_cpu_ms']:.1f} ms, decode "
                  f"{r['decode_cpu_ms']:.1f} ms")
        print(f"host_small_request_ms={res['small_request_ms']:.1f}")
        return
    if args.profile:
        profile_requests(args.paged, int(args.lens.split(",")[0]), args.profile_seconds,
                         args.profile)
        return
    device = os.environ.get("KVBEAM_RDMA_DEVICE", "rxe0")
    gid = int(os.environ.get("KVBEAM_RDMA_GID_INDEX", "0"))
    ref_gbps = ib_write_bw(device, gid, 65536, 5, 18515)
    rows = run_requests(args.paged, not args.no_integrity,
                        [int(x) for x in args.lens.split(",")], args.repeat,
                        extra=args.daemon_flags.split())
    ref_bps = ref_gbps * 1e9 / 8
    print(f"\nwhole DSV4 requests ({rows[0].mode}, integrity "
          f"{'off' if args.no_integrity else 'on'}) over {device}; ib_write_bw 64 KiB in the "
          f"same run: {ref_gbps:.3f} Gb/s")
    print(f"{'tokens':>7} {'bytes':>10} {'send->ok ms':>12} {'best ms':>8} {'Gb/s':>7} "
          f"{'ratio':>6} {'raw ms (ib_write_bw)':>21}")
    for r in rows:
        raw_ms = r.bytes / ref_bps * 1e3
        print(f"{r.tokens:>7} {r.bytes:>10} {r.median_ms:>12.1f} {r.best_ms:>8.1f} "
              f"{r.gbps:>7.3f} {r.gbps / ref_gbps:>6.2f} {raw_ms:>21.1f}")
    print(f"ratio_vs_ib_write_bw={rows[-1].gbps / ref_gbps:.2f}")


if __name__ == "__main__":
    main()
