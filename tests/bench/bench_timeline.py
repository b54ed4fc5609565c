"""Diagnostic: where a small request's time goes between an engine's Send and the decode
engine seeing Success, step by step, on both daemons.

``bench_calls`` counts the Python a request runs; this says when each step runs and how
long it takes, on which thread, in the daemons as they serve the engine channel's
sequential requests (bench_engine_channel's daemons and engine workers, 128-token
requests, TCP). The daemons start with tests/bench/timeline_site on ``PYTHONPATH``
(armed only by this bench's environment): each function in ``--specs`` is wrapped to
record its calls' start and end on CLOCK_MONOTONIC, the clock the engine workers time
the Send and the Success with. Per step, over the requests after the first 20: the
median start and end in microseconds from the Send (negative: before it, decode's
reservation) and the median duration, the n-th call of a function in one request as
``#n``. A wrapped call costs about a microsecond more, so the total is a little above
bench_engine_channel's.

``--settle-ms``: each Send follows its reservation by that much (decode's Offer is
then at prefill before the Send: the path without the Offer's hop).

Run: ``python -m tests.bench.bench_timeline [--requests 300] [--settle-ms 0]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time
from pathlib import Path

from tests.bench.bench_engine_channel import engine_workers

SITE = str(Path(__file__).resolve().parent / "timeline_site")
ROOT = str(Path(__file__).resolve().parents[2])
#: The steps timed by default: each daemon's handling of an engine frame, a peer frame
#: and a transport event, and the steps inside them on the request's path. A function
#: is wrapped where the caller looks it up (``module:name`` of the caller's module).
SPECS = ",".join([
    "kvbeam.server.engines.channel:EngineChannel.handle",
    "kvbeam.server.engines.channel:EngineChannel._push_state",
    "kvbeam.proto.engine_frames:decode",
    "kvbeam.server.core.decode:DecodeCore.reserve",
    "kvbeam.server.core.decode_driver:DecodeDriver.offer",
    "kvbeam.server.api.daemon:DaemonServicer._channel_request",
    "kvbeam.server.core.prefill:PrefillCore.send",
    "kvbeam.server.core.prefill:PrefillCore._plan",
    "kvbeam.server.core.prefill_driver:PrefillDriver._post",
    "kvbeam.server.core.prefill_driver:PrefillDriver._digest_job",
    "kvbeam.transport.tcp.link:TcpLink.write",
    "kvbeam.transport.tcp.transport:_Receiver._end",
    "kvbeam.server.api.daemon:DaemonServicer._handle_event",
    "kvbeam.server.core.decode_landing:LandingCheck.check",
    "kvbeam.server.state.lifecycle:TransferTable.create",
    "kvbeam.server.state.lifecycle:TransferTable.advance",
])


def run(requests: int, settle_s: float, out: str, specs: str) -> tuple[
        dict[int, str], list[tuple[float, float, float]]]:
    """``requests`` sequential requests (after 5 warm-up ones) with both daemons timing
    ``specs`` into ``out``; the daemons' pids by role, and each request's times: before
    its reservation was asked for, its Send, and decode's engine seeing its Success."""
    env = {"KVBEAM_BENCH_TIMELINE_DIR": out, "KVBEAM_BENCH_TIMELINE_SPECS": specs,
           "PYTHONPATH": os.pathsep.join([SITE, ROOT, os.environ.get("PYTHONPATH", "")])}
    sends = []
    with engine_workers(env) as (prefill, decode, pe, de):  # SIGTERM: records written
        for i in range(5 + requests):
            rid = f"t{i}"
            asked = time.monotonic()
            de.cmd(f"reserve {rid} {prefill.address}")
            if settle_s:
                time.sleep(settle_s)
            t0 = float(pe.cmd(f"send {rid} {decode.address}").split()[1])
            t1 = float(de.cmd(f"done {rid}").split()[1])
            if pe.cmd(f"wait {rid}") != "Success":
                raise RuntimeError(f"request {rid} did not succeed")
            if i >= 5:
                sends.append((asked, t0, t1))
        return {prefill.proc.pid: "P", decode.proc.pid: "D"}, sends


def timeline(out: str, roles: dict[int, str], times: list[tuple[float, float, float]],
             skip: int = 20) -> list[str]:
    """The table's rows: per step, its median start, end and duration from the Send."""
    records = []
    for pid, role in roles.items():
        path = Path(out, f"{pid}.tl")
        if not path.exists():
            raise RuntimeError(f"daemon {pid} wrote no timeline into {out}")
        for line in path.read_text().splitlines():
            name, began, ended, on = line.split(" ", 3)
            records.append((int(began) / 1e9, int(ended) / 1e9, f"{role} {name}", on))
    records.sort()
    steps: dict[str, list[tuple[float, float, str]]] = collections.defaultdict(list)
    at = 0
    for i, (asked, t0, t1) in enumerate(times):
        # A request's steps: from its reservation being asked for to the next one's
        # (prefill's own Success comes after decode's engine saw its own).
        hi = times[i + 1][0] if i + 1 < len(times) else t1 + 0.01
        while at < len(records) and records[at][0] < asked:
            at += 1
        seen: collections.Counter[str] = collections.Counter()
        while at < len(records) and records[at][0] < hi:
            start, end, tag, thread = records[at]
            key = f"{tag}#{seen[tag]}" if seen[tag] else tag
            seen[tag] += 1
            if i >= skip:
                steps[key].append(((start - t0) * 1e6, (end - t0) * 1e6, thread))
            at += 1
    done = [(t1 - t0) * 1e6 for _, t0, t1 in times[skip:]]
    rows = [f"{'step':<48} {'calls':>5} {'start us':>9} {'end us':>9} {'takes us':>9}  thread"]
    order = sorted(steps.items(), key=lambda kv: statistics.median(s for s, _, _ in kv[1]))
    for key, calls in order:
        if len(calls) < len(done) // 2:  # not on most requests' path
            continue
        thread = collections.Counter(t for _, _, t in calls).most_common(1)[0][0]
        rows.append(f"{key:<48} {len(calls):>5} "
                    f"{statistics.median(s for s, _, _ in calls):>9.0f} "
                    f"{statistics.median(e for _, e, _ in calls):>9.0f} "
                    f"{statistics.median(e - s for s, e, _ in calls):>9.0f}  {thread}")
    rows.append(f"{'decode engine sees Success':<48} {len(done):>5} "
                f"{statistics.median(done):>9.0f}")
    return rows


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--settle-ms", type=float, default=0.0,
                        help="each Send this long after its reservation (default: at once)")
    parser.add_argument("--specs", default=SPECS,
                        help="the functions timed: module:Class.method, comma separated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvbeam-timeline-out-") as out:
        roles, times = run(args.requests, args.settle_ms / 1000, out, args.specs)
        settled = (f", each Send {args.settle_ms:g} ms after its reservation"
                   if args.settle_ms else "")
        print(f"# a 128-token request over the engine channel, TCP, {args.requests} "
              f"sequential{settled}; medians over all but the first 20, microseconds from "
              "the prefill engine's Send; P prefill, D decode")
        for row in timeline(out, roles, times):
            print(row)


if __name__ == "__main__":
    main()
