"""Benchmark: fixed cost per request on the host, TCP on loopback (no RDMA).

Starts a prefill and a decode daemon over TCP, sends requests one at a time
through the scheduler API and prints, per request length, the median
Send-to-Success time and each daemon's process CPU time per request (utime +
stime from ``/proc/PID/stat`` over the timed requests). With ``--profile DIR``
it then samples both daemons with py-spy during 128-token requests (summarise
with :mod:`tests.bench.profile_summary`).

Run: ``python -m tests.bench.bench_host_cpu [--lens 128,1024,8192,32768]``.
"""

from __future__ import annotations

import argparse
import os
import statistics

from kvbeam.client import KvbeamClient
from kvbeam.scheduler import run_request
from tests.bench.bench_request import _profile_loop
from tests.daemon_helpers import start_both

_TICK = os.sysconf("SC_CLK_TCK")
#: Timed requests per length (after warm-ups): many small ones, fewer large ones.
REPEAT = {128: 100, 1024: 50, 8192: 30, 32768: 20}


def cpu_s(pid: int) -> float:
    """Process CPU time (user + system) of ``pid`` so far, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


def main() -> None:
    """Print one line per request length."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lens", default="128,1024,8192,32768")
    parser.add_argument("--no-integrity", action="store_true")
    parser.add_argument("--profile", metavar="DIR")
    parser.add_argument("--profile-seconds", type=float, default=25.0)
    args = parser.parse_args()
    flags = ["--integrity", "false" if args.no_integrity else "true", "--log-level", "WARNING"]
    prefill, decode = start_both(transport="tcp", prefill_extra=flags, decode_extra=flags)
    pids = (prefill.proc.pid, decode.proc.pid)
    try:
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            print(f"{'tokens':>7} {'bytes':>10} {'n':>3} {'send->ok ms':>12} {'best ms':>8} "
                  f"{'prefill cpu ms':>15} {'decode cpu ms':>14}")
            n = 0
            for seq_len in [int(x) for x in args.lens.split(",")]:
                repeat = REPEAT.get(seq_len, 10)
                for _ in range(3):  # warm-up
                    n += 1
                    run_request(p, d, f"host-warm-{n}", seq_len, n % 8, timeout=120.0)
                before = [cpu_s(pid) for pid in pids]
                times: list[float] = []
                nbytes = 0
                for _ in range(repeat):
                    n += 1
                    r = run_request(p, d, f"host-{n}", seq_len, n % 8, timeout=120.0)
                    if not r.ok:
                        raise SystemExit(f"request {r.request_id} ended {r.state}")
                    nbytes = r.bytes
                    times.append(r.send_to_success_s * 1e3)
                cpu = [(cpu_s(pid) - b) * 1e3 / repeat for pid, b in zip(pids, before,
                                                                           strict=True)]
                print(f"{seq_len:>7} {nbytes:>10} {repeat:>3} {statistics.median(times):>12.2f} "
                      f"{min(times):>8.2f} {cpu[0]:>15.2f} {cpu[1]:>14.2f}", flush=True)
            if args.profile:
                _profile_loop(p, d, pids, 128, args.profile_seconds, args.profile)
    finally:
        prefill.stop()
        decode.stop()


if __name__ == "__main__":
    main()
