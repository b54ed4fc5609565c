"""Benchmark: small requests at the engine's level, over the engine channel and over gRPC.

Two ``--pools engine`` daemons over TCP on loopback and two engine processes
(tests/bench/bench_engine_worker.py: EnginePools memory, engine-chosen lists, every
call through ``kvbeam.engine`` on the attachment). This process is the router: it mints
the request ids and hands them to both engines; nobody calls the scheduler API. Then the
same figures through the gRPC scheduler API (:class:`kvbeam.client.KvbeamClient`,
:func:`kvbeam.scheduler.run_request`) against the same daemons
and memory, in the same run. Target lines, each beside its gRPC figure::

    engine_poll_us=      median cost of one poll() of a finished request
    engine_small_request_ms=   128 tokens, prefill's send to decode seeing Success, median
    daemon_cpu_ms_per_small_request=  the larger daemon's process CPU over N requests
    small_requests_per_s=  16 in flight, one pair, whole lifecycle

The engines attach as the vLLM and sglang integrations do (``pushes="final"``: only a
request's end is pushed to them). Their processes' CPU per sequential request (the
engine's side of the channel, with the worker's command loop) is printed beside the
same figure from a second pair of workers attached with ``pushes="all"``, on the same
daemons, after the gRPC phase::

    engine_cpu_ms_per_small_request=  the larger engine process's CPU, pushes final
    engine_cpu_ms_per_small_request_all_pushes=  the same, every state change pushed
    small_requests_per_s_all_pushes=  small_requests_per_s with every change pushed

Over TCP, last, the floor under the first two in the same run
(:mod:`tests.bench.bench_floor`: the same four processes, sockets and bytes with none
of kvbeam in them): ``engine_small_request_floor_ms=`` and
``daemon_cpu_ms_per_small_request_floor=`` (the larger daemon's).

``daemon_threads=``: the busier daemon's OS threads after the engine channel's flow,
gRPC's handler pool aside (each daemon's threads by name on the line before it);
``daemon_threads_kvbeam=`` of them the threads kvbeam starts, ``daemon_threads_grpc=``
gRPC's own.

``--profile DIR``: py-spy both daemons and the prefill engine during the flow phase
(when the bench extra installed py-spy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvbeam.client import KvbeamClient
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.spec import load_side_config
from kvbeam.procs import DaemonProcess
from kvbeam.scheduler import run_request
from tests.attach_helpers import start_engine_pair
from tests.bench.bench_floor import floor, request_bytes
from tests.bench.bench_request import BENCH_DEADLINES, cpu_s
from tests.bench.bench_threads import cpu_by_group, thread_cpu
from tests.bench.line_process import LineProcess
from tests.fixtures import shipped_config

SEQ = 128
# The thread-name prefix of gRPC's handler pool (server/api/control.py), left out of
# daemon_threads as issue 47 counts them.
GRPC_HANDLER_POOL = "kvbeam-control"
#: The name prefix of every thread kvbeam starts (kvbeam/threads.py).
KVBEAM_THREADS = "kvbeam-"
ROOT = str(Path(__file__).resolve().parents[2])


class Worker(LineProcess):
    """A bench_engine_worker process, attached to its daemon (``pushes``: which state
    changes it is pushed, :func:`kvbeam.engine.attach`)."""

    def __init__(self, socket_path: str, config: str, role: str,
                 pushes: str = "final") -> None:
        super().__init__("tests.bench.bench_engine_worker",
                         ["--socket", socket_path, "--config", config, "--role", role,
                          "--pushes", pushes], "attached")
        self.socket_path, self.config, self.role = socket_path, config, role

    def stop(self) -> None:
        """Ask it to exit (killed after 10 s)."""
        if self.proc.poll() is None:
            self.write("exit")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@contextlib.contextmanager
def engine_workers(env: dict[str, str] | None = None, *, transport: str = "tcp",
                   flags: Sequence[str] = ()) -> Iterator[tuple[DaemonProcess, DaemonProcess,
                                                                 Worker, Worker]]:
    """Two ``--pools engine`` daemons over ``transport`` started with ``env`` (bench
    deadlines, then ``flags``; the default log level, as users run them) and an engine
    worker attached to each:
    (prefill, decode, its worker, its worker); all stopped at the end (the daemons by
    SIGTERM: their exit hooks run)."""
    work = Path(tempfile.mkdtemp(prefix="kvbeam-bench-"))
    work.chmod(0o700)
    prefill, decode = start_engine_pair(
        str(work / "p.sock"), str(work / "d.sock"), transport=transport, env=env,
        deadlines=[*BENCH_DEADLINES, *flags])
    workers: list[Worker] = []
    try:
        workers.append(Worker(str(work / "p.sock"), shipped_config("prefill"), "prefill"))
        workers.append(Worker(str(work / "d.sock"), shipped_config("decode"), "decode"))
        yield prefill, decode, workers[0], workers[1]
    finally:
        for worker in workers:
            worker.stop()
        prefill.stop()
        decode.stop()


def _lists(role: str, slot: int) -> dict[str, list[int]]:
    config = load_side_config(shipped_config(role))
    used = {b.index_kind for b in build_side_layout(config).flat_buffers}
    return {k.value: v.tolist() for k, v in request_indices(config.target, slot, SEQ).items()
            if k in used}


def _offer_counts(*metrics: str) -> str:
    """Each daemon's kvbeam_offers and BeginWrite counters (how the requests went)."""
    out = []
    for address in metrics:
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
        out += [line for line in text.splitlines()
                if line.startswith(("kvbeam_offers_total", "kvbeam_begin_writes_total"))]
    return "; ".join(out)


def _switches(pid: int) -> int:
    """Context switches (voluntary and not) of every thread of ``pid`` so far: each
    hand-off between threads costs one (or more) on the thread that sleeps."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended between listing and reading
            continue
        total += sum(int(line.split()[1]) for line in status.splitlines()
                     if "ctxt_switches:" in line)
    return total


def _spy(pid: int, out: str) -> subprocess.Popen[bytes] | None:
    """py-spy sampling ``pid`` until SIGINT (the bench extra's; else ``$PY_SPY``)."""
    exe = os.environ.get("PY_SPY") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        print(f"# no py-spy at {exe}: no profile", flush=True)
        return None
    return subprocess.Popen([exe, "record", "-p", str(pid), "-r", "250", "-f", "raw", "--gil",
                             "-o", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _sequential(pe: Worker, de: Worker, prefix: str, n: int, prefill_address: str,
                decode_address: str, settle_s: float = 0.0) -> list[float]:
    """``n`` requests one after another (ids ``prefix0``..): decode's engine reserves,
    ``settle_s`` later prefill's sends, decode's waits for Success and releases; each
    one's Send-to-Success ms (the engines' clocks)."""
    out = []
    for i in range(n):
        rid = f"{prefix}{i}"
        de.cmd(f"reserve {rid} {prefill_address}")
        if settle_s:
            time.sleep(settle_s)
        t0 = float(pe.cmd(f"send {rid} {decode_address}").split()[1])
        t1 = float(de.cmd(f"done {rid}").split()[1])
        assert pe.cmd(f"wait {rid}") == "Success"
        out.append((t1 - t0) * 1000)
    return out


#: A flow phase's warm-up: this many requests per place in flight, not measured.
WARM_FLOWS = 8


def _flow(pe: Worker, de: Worker, prefix: str, n: int, inflight: int, prefill_address: str,
          decode_address: str) -> tuple[float, int]:
    """``n`` requests, ``inflight`` at once, each engine starting its side as it frees a
    place: (requests per second from the first start to the last end, how many failed)."""
    de.write(f"flow {prefix} {n} {inflight} {prefill_address}")
    pe.write(f"flow {prefix} {n} {inflight} {decode_address}")
    d_flow, p_flow = de.read().split(), pe.read().split()
    start = min(float(d_flow[1]), float(p_flow[1]))
    end = max(float(d_flow[2]), float(p_flow[2]))
    return n / (end - start), int(d_flow[3]) + int(p_flow[3])


def _all_pushes(pe: Worker, de: Worker, prefill_address: str, decode_address: str,
                requests: int, flow: int, inflight: int
                ) -> tuple[list[float], float, float, int]:
    """``pe`` and ``de`` stopped (they detach) and a pair attached in their place with
    ``pushes="all"``: each engine process's CPU ms per sequential request, the requests'
    median Send-to-Success ms, then ``flow`` requests at ``inflight`` at once: requests
    per second and how many failed. The new pair is stopped before returning."""
    pe.stop()
    de.stop()
    workers = [Worker(pe.socket_path, pe.config, pe.role, pushes="all")]
    try:
        workers.append(Worker(de.socket_path, de.config, de.role, pushes="all"))
        p, d = workers
        _sequential(p, d, "aw", 5, prefill_address, decode_address)  # warm-up
        cpu0 = [cpu_s(w.proc.pid) for w in workers]
        lat = _sequential(p, d, "a", requests, prefill_address, decode_address)
        cpus = [(cpu_s(w.proc.pid) - was) * 1000 / requests
                for w, was in zip(workers, cpu0, strict=True)]
        _flow(p, d, "afw", inflight * WARM_FLOWS, inflight, prefill_address, decode_address)
        rate, failed = _flow(p, d, "af", flow, inflight, prefill_address, decode_address)
        return cpus, statistics.median(lat), rate, failed
    finally:
        for w in workers:
            w.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--flow", type=int, default=400)
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--profile", default="")
    ap.add_argument("--settle-ms", type=float, default=20.0,
                    help="also time sequential requests whose Send follows the reservation "
                         "by this much (decode's Offer is then kept before the Send)")
    ap.add_argument("--daemon-flags", default="",
                    help="extra flags for both daemons (e.g. '--integrity false')")
    ap.add_argument("--transport", choices=("tcp", "rdma"), default="tcp",
                    help="the daemons' data plane (rdma: the device in KVBEAM_RDMA_DEVICE, "
                         "as inside the soft-RoCE harness)")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    out: dict[str, tuple[float, float]] = {}
    with engine_workers(transport=args.transport, flags=[
            "--deadline-bootstrap-s", "60", "--deadline-waiting-s", "60",
            *args.daemon_flags.split()]) as (prefill, decode, pe, de):
        pids = (prefill.proc.pid, decode.proc.pid)
        # ---- the engine channel -----------------------------------------------------
        # Warm-up: the handshake, the first offers.
        _sequential(pe, de, "w", 5, prefill.address, decode.address)
        cpu0 = [cpu_s(p) for p in pids]
        engine_cpu0 = [cpu_s(w.proc.pid) for w in (pe, de)]
        threads0 = [thread_cpu(p) for p in pids]
        switches0 = [_switches(p) for p in pids]
        lat = _sequential(pe, de, "s", args.requests, prefill.address, decode.address)
        cpu1 = [cpu_s(p) for p in pids]
        engine_cpus = [(cpu_s(w.proc.pid) - was) * 1000 / args.requests
                       for w, was in zip((pe, de), engine_cpu0, strict=True)]
        by_thread = [cpu_by_group(p, was, thread_cpu(p), args.requests)
                     for p, was in zip(pids, threads0, strict=True)]
        switched = [(_switches(p) - was) / args.requests
                    for p, was in zip(pids, switches0, strict=True)]
        offers = _offer_counts(prefill.metrics, decode.metrics)
        settled = _sequential(pe, de, "t", args.requests // 2 if args.settle_ms else 0,
                              prefill.address, decode.address, args.settle_ms / 1000)
        chan_cpus = [(b - a) * 1000 / args.requests for a, b in zip(cpu0, cpu1, strict=True)]
        chan_cpu = max(chan_cpus)
        chan_poll = float(pe.cmd("poll 20000").split()[1])
        # Warm-up at the flow's depth first, as the all-pushes pair's: the first requests
        # at 16 in flight are slower (measured: 10-25% fewer per second), and a flow measured
        # cold against one measured warm compared the order, not the push modes.
        _flow(pe, de, "fw", args.inflight * WARM_FLOWS, args.inflight, prefill.address,
              decode.address)
        spies = []
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            for name, pid in (("prefill", pids[0]), ("decode", pids[1]),
                              ("prefill-engine", pe.proc.pid)):
                spy = _spy(pid, os.path.join(args.profile, f"{name}.txt"))
                if spy is not None:
                    spies.append(spy)
            time.sleep(1.0)  # py-spy attaches
        chan_rate, failed = _flow(pe, de, "f", args.flow, args.inflight, prefill.address,
                                  decode.address)
        # Each daemon's threads after the busiest phase of the engine channel, by kernel
        # name (kvbeam's threads name themselves there).
        threads = [Counter(name for name, _ in thread_cpu(p).values()) for p in pids]
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its samples and exits
            spy.wait(60)
        if args.profile:
            Path(args.profile, "requests.txt").write_text(
                f"{args.flow} requests at {args.inflight} in flight over the engine channel\n")
        no_grpc = pe.cmd("grpc") == de.cmd("grpc") == "grpc False"
        out["engine_poll_us"] = (chan_poll, 0.0)
        out["engine_small_request_ms"] = (statistics.median(lat), 0.0)
        out["daemon_cpu_ms_per_small_request"] = (chan_cpu, 0.0)
        out["small_requests_per_s"] = (chan_rate, 0.0)
        # ---- the gRPC scheduler API, same daemons and memory ---------------------------
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            src, dst = _lists("prefill", 0), _lists("decode", 0)
            glat = []
            cpu0 = [cpu_s(x) for x in pids]
            for i in range(args.requests):
                r = run_request(p, d, f"g{i}", SEQ, -1, src_indices=src, dst_indices=dst)
                assert r.ok, r
                glat.append(r.send_to_success_s * 1000)
            cpu1 = [cpu_s(x) for x in pids]
            g_cpus = [(b - a) * 1000 / args.requests for a, b in zip(cpu0, cpu1, strict=True)]
            g_cpu = max(g_cpus)
            # What Sender(address, ...).poll() is over gRPC: one Status call.
            last = f"g{args.requests - 1}"
            ptimes = []
            for _ in range(200):
                t0 = time.perf_counter_ns()
                p.status(last)
                ptimes.append(time.perf_counter_ns() - t0)
            g_poll = statistics.median(ptimes) / 1000
            # 16 in flight: each request's whole lifecycle through the scheduler API.
            lock = threading.Lock()
            free = list(range(16))

            def one(i: int) -> bool:
                with lock:
                    slot = free.pop()
                try:
                    return run_request(p, d, f"gf{i}", SEQ, -1, src_indices=src,
                                       dst_indices=_lists("decode", slot)).ok
                finally:
                    with lock:
                        free.append(slot)

            began = time.monotonic()
            with ThreadPoolExecutor(args.inflight) as pool:
                oks = list(pool.map(one, range(args.flow // 2)))
            g_rate = len(oks) / (time.monotonic() - began)
            failed += oks.count(False)
        for k, v in (("engine_poll_us", g_poll), ("engine_small_request_ms",
                     statistics.median(glat)), ("daemon_cpu_ms_per_small_request", g_cpu),
                     ("small_requests_per_s", g_rate)):
            out[k] = (out[k][0], v)
        # ---- the reference: engines pushed every state change, same daemons -----------
        all_cpus, all_lat, all_rate, all_failed = _all_pushes(
            pe, de, prefill.address, decode.address, args.requests, args.flow, args.inflight)
        failed += all_failed
    where = "TCP loopback" if args.transport == "tcp" else "RDMA"
    print(f"# engine channel vs gRPC scheduler API, {SEQ}-token requests, {where}, "
          f"{args.requests} sequential, {args.flow} at {args.inflight} in flight "
          f"(gRPC: {args.flow // 2}); failed={failed}; engines imported gRPC: {not no_grpc}")
    print(f"# offers/BeginWrites after the sequential channel phase: {offers}")
    for role, groups in zip(("prefill", "decode"), by_thread, strict=True):
        print(f"# {role} CPU ms per sequential request by thread: " + "; ".join(
            f"{g} {ms:.3f}" for g, ms in groups.items()))
    print(f"# context switches per sequential request (every thread): prefill "
          f"{switched[0]:.1f}, decode {switched[1]:.1f}")
    if settled:
        print(f"# engine_small_request_ms with decode's Offer kept before the Send "
              f"(reserved {args.settle_ms:g} ms earlier): {statistics.median(settled):.3f}")
    print(f"# each engine process's CPU ms per sequential request (kvbeam.engine and the "
          f"worker's command loop): pushes final prefill {engine_cpus[0]:.3f}, decode "
          f"{engine_cpus[1]:.3f}; pushes all prefill {all_cpus[0]:.3f}, decode "
          f"{all_cpus[1]:.3f} (its engine_small_request_ms {all_lat:.3f}; "
          f"{args.flow} at {args.inflight} in flight: {all_rate:.0f} requests/s, against "
          f"{out['small_requests_per_s'][0]:.0f} with pushes final)")
    print(f"engine_cpu_ms_per_small_request={max(engine_cpus):.3f} "
          f"engine_cpu_ms_per_small_request_all_pushes={max(all_cpus):.3f}")
    print(f"small_requests_per_s_final_pushes={out['small_requests_per_s'][0]:.3f} "
          f"small_requests_per_s_all_pushes={all_rate:.3f}")
    print(f"# each daemon's CPU ms per sequential request: engine channel prefill "
          f"{chan_cpus[0]:.3f}, decode {chan_cpus[1]:.3f}; gRPC API prefill {g_cpus[0]:.3f}, "
          f"decode {g_cpus[1]:.3f}")
    for k, (chan, grpc_) in out.items():
        print(f"{k}={chan:.3f} grpc_{k}={grpc_:.3f}")
    # Issue 47's count: the busier daemon's threads, gRPC's handler pool (kvbeam-control)
    # aside, after the engine channel's flow.
    pool_aside = [sum(n for name, n in c.items() if not name.startswith(GRPC_HANDLER_POOL))
                  for c in threads]
    for role, c in zip(("prefill", "decode"), threads, strict=True):
        print(f"# {role} threads after the engine channel's flow: {sum(c.values())}: "
              + ", ".join(f"{name} {n}" for name, n in sorted(c.items())))
    print(f"daemon_threads={max(pool_aside)}")
    # Of those, the threads kvbeam starts (named kvbeam-*: its loop, its executor) and
    # gRPC's own (its timer, its EventEngine pool and lifeguard, the Python server's
    # polling thread: gRPC sizes them, no setting bounds them): what limits the count.
    own = [sum(n for name, n in c.items() if name.startswith(KVBEAM_THREADS)
               and not name.startswith(GRPC_HANDLER_POOL)) for c in threads]
    print(f"daemon_threads_kvbeam={max(own)} "
          f"daemon_threads_grpc={max(p - o for p, o in zip(pool_aside, own, strict=True))}")
    floor_lines: dict[str, float] = {}
    if args.transport == "tcp":  # the floor needs nothing but sockets: the same run's
        # At least 1,000 requests: CPU is counted in 10 ms ticks, and the floor is cheap.
        nbytes = request_bytes()
        floor_ms, floor_p, floor_d = floor(max(args.requests, 1000), nbytes, integrity=True)
        floor_lines = {"engine_small_request_floor_ms": floor_ms,
                       "daemon_cpu_ms_per_small_request_floor": max(floor_p, floor_d)}
        print(f"# the floor (tests/bench/bench_floor.py: the same processes, sockets and "
              f"bytes, none of kvbeam): Send-to-Success {floor_ms:.3f} ms, daemon CPU "
              f"prefill {floor_p:.3f} / decode {floor_d:.3f} ms per request; the engine "
              f"channel is {out['engine_small_request_ms'][0] / floor_ms:.1f}x its latency")
        if settled:  # the same idle gap before each Send: the machine's wake-ups count
            idle_ms, _, _ = floor(len(settled), nbytes, integrity=True,
                                  idle_s=args.settle_ms / 1000)
            floor_lines["engine_small_request_floor_ms_settled"] = idle_ms
            print(f"# the floor with the Send {args.settle_ms:g} ms after the request before "
                  f"ended, as the kept-Offer requests above: {idle_ms:.3f} ms (the engine "
                  f"channel {statistics.median(settled) / idle_ms:.1f}x)")
        for k, v in floor_lines.items():
            print(f"{k}={v:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "transport": args.transport, "tokens": SEQ, "requests": args.requests,
            "flow": args.flow, "inflight": args.inflight, "failed": failed,
            "lines": {**{k: v[0] for k, v in out.items()},
                      **{f"grpc_{k}": v[1] for k, v in out.items()}, **floor_lines,
                      "daemon_threads": max(pool_aside), "daemon_threads_kvbeam": max(own)},
            "cpu_ms": dict(zip(("prefill", "decode"), chan_cpus, strict=True)),
            "engine_cpu_ms": dict(zip(("prefill", "decode"), engine_cpus, strict=True)),
            "engine_cpu_ms_all_pushes": dict(zip(("prefill", "decode"), all_cpus,
                                                 strict=True)),
            "small_requests_per_s_all_pushes": all_rate,
            "grpc_cpu_ms": dict(zip(("prefill", "decode"), g_cpus, strict=True)),
            "by_thread": dict(zip(("prefill", "decode"), by_thread, strict=True)),
            "switches": dict(zip(("prefill", "decode"), switched, strict=True))}, indent=1))


if __name__ == "__main__":
    main()
