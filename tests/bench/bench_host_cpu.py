"""Benchmark: fixed cost per request on the host, TCP on loopback (no RDMA).

Starts a prefill and a decode daemon over TCP, sends requests one at a time
through the scheduler API and prints, per request length, the median
Send-to-Success time and each daemon's process CPU time per request (utime +
stime from ``/proc/PID/stat`` over the timed requests). ``--lists engine`` sends
engine-chosen (random, fragmented) index lists instead of slot-contiguous ones.
With ``--profile DIR`` it then samples both daemons with py-spy during requests
of the first length, slot lists (summarise with :mod:`tests.bench.profile_summary`).

A diagnostic beside ``make bench-host`` (which prints ``host_small_request_ms=``
for the bench report): this one varies the lists and profiles.

Run: ``python -m tests.bench.bench_host_cpu [--lens 128,1024,8192,32768]``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import numpy as np

from kvbeam.client import KvbeamClient
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.spec import load_side_config
from kvbeam.scheduler import RequestResult, run_request
from tests.bench.bench_request import _profile_loop, cpu_s
from tests.daemon_helpers import start_both
from tests.engine_lists import as_mapping, random_lists
from tests.fixtures import shipped_config

#: Timed requests per length (after warm-ups): many small ones, fewer large ones.
REPEAT = {128: 100, 1024: 50, 8192: 30, 32768: 20}


def _sender(p: KvbeamClient, d: KvbeamClient, engine: bool) -> Callable[[str, int],
                                                                          RequestResult]:
    """One request: slot lists (slot cycles over 8), or fresh random engine lists each time."""
    pcfg, dcfg = (load_side_config(shipped_config(role)) for role in ("prefill", "decode"))
    play, dlay = build_side_layout(pcfg), build_side_layout(dcfg)
    rng = np.random.default_rng(1)
    count = [0]

    def one(rid: str, tokens: int) -> RequestResult:
        count[0] += 1
        if not engine:
            r = run_request(p, d, rid, tokens, count[0] % 8, timeout=120.0)
        else:
            s, t = random_lists(pcfg.target, play, tokens, rng), random_lists(
                dcfg.target, dlay, tokens, rng)
            r = run_request(p, d, rid, tokens, 0, src_indices=as_mapping(s),
                            dst_indices=as_mapping(t), timeout=120.0)
        if not r.ok:
            raise SystemExit(f"request {rid} ended {r.state}")
        return r

    return one


def main() -> None:
    """Print one line per request length."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lens", default="128,1024,8192,32768")
    parser.add_argument("--lists", choices=("slot", "engine"), default="slot")
    parser.add_argument("--no-integrity", action="store_true")
    parser.add_argument("--profile", metavar="DIR")
    parser.add_argument("--profile-seconds", type=float, default=25.0)
    args = parser.parse_args()
    flags = ["--integrity", "false" if args.no_integrity else "true"]
    prefill, decode = start_both(transport="tcp", prefill_extra=flags, decode_extra=flags)
    pids = (prefill.proc.pid, decode.proc.pid)
    lens = [int(x) for x in args.lens.split(",")]
    try:
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            one = _sender(p, d, args.lists == "engine")
            print(f"{'tokens':>7} {'bytes':>10} {'n':>3} {'send->ok ms':>12} {'best ms':>8} "
                  f"{'prefill cpu ms':>15} {'decode cpu ms':>14}  ({args.lists} lists)")
            n = 0
            for seq_len in lens:
                repeat = REPEAT.get(seq_len, 10)
                for _ in range(3):  # warm-up
                    n += 1
                    one(f"host-warm-{n}", seq_len)
                before = [cpu_s(pid) for pid in pids]
                times: list[float] = []
                nbytes = 0
                for _ in range(repeat):
                    n += 1
                    r = one(f"host-{n}", seq_len)
                    nbytes = r.bytes
                    times.append(r.send_to_success_s * 1e3)
                cpu = [(cpu_s(pid) - b) * 1e3 / repeat for pid, b in zip(pids, before,
                                                                           strict=True)]
                print(f"{seq_len:>7} {nbytes:>10} {repeat:>3} {statistics.median(times):>12.2f} "
                      f"{min(times):>8.2f} {cpu[0]:>15.2f} {cpu[1]:>14.2f}", flush=True)
            if args.profile:
                _profile_loop(p, d, pids, lens[0], args.profile_seconds, args.profile)
    finally:
        prefill.stop()
        decode.stop()


if __name__ == "__main__":
    main()
