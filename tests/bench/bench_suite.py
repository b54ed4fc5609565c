"""``make bench``: every RDMA figure of issues 8 and 14 in one soft-RoCE guest boot.

Sections, in this order, each figure the median of ``--repeat`` runs beside its
reference measured in the same boot:

1. limits: ``ib_write_bw`` and ``ib_write_lat`` at 4 KiB, 64 KiB, 1 MiB on the device;
2. peer: Mooncake Transfer Engine (RDMA, same device, same 64 MiB buffers and block
   sizes, CRC-checked after each run) when it is installed (the ``bench`` extra);
3. whole-request peer: Mooncake TE moving the blocks kvbeam's planner makes for 8k-
   and 32k-token requests (slot-contiguous and engine-chosen lists,
   :mod:`tests.bench.request_blocks`), one ``batch_transfer_sync_write`` per request;
4. kvbeam raw blocks of the same sizes (:mod:`tests.bench.bench_transport`), CRC-checked;
   then both WR posters (compiled, pyverbs) moving the same 4 KiB blocks: posts/s, WRs/s
   and the time per post (:func:`tests.bench.bench_transport.poster_rates`);
5. scaling (:mod:`tests.bench.bench_scaling`): block size, blocks per request,
   concurrency, QPs per peer;
6. whole DSV4 requests through the daemons and the scheduler API, unified and
   paged, integrity on and off, each daemon's CPU per request
   (:mod:`tests.bench.bench_request`); on the first pair (unified, integrity on) also
   the engine-chosen lists the Mooncake peer moved, and 16 concurrent 8k requests;
7. handshake_pool (:mod:`tests.bench.bench_keys`): a handshake's data-plane time with
   a small decode pool and a 1 GiB one, beside what re-registering the pool costs
   (what every handshake did before memory windows);
8. engine_channel (:mod:`tests.bench.bench_engine_channel`): 128-token requests the way
   engines run them (two ``--pools engine`` daemons over RDMA, two engine processes on
   their attachments, no scheduler), each daemon's CPU per request and by thread,
   beside the same daemons through the gRPC scheduler API in the same run;
9. engine_layers (:mod:`tests.bench.bench_layers`): a request sent layer by layer
   against whole through the engine channel over RDMA (issue 48): from prefill's last
   layer to decode's Success, beside one layer's transfer and the fixed per-request
   cost, in a child process;
10. integrity_61l (:mod:`tests.bench.bench_digest`): the 61-layer layout (head_dim 512,
   NextN draft, 16k tokens, 182 buffers, about 107 MB) over RDMA, integrity on and off
   (two pairs, requests alternating), each daemon's CPU by thread, beside one thread's
   digests of the same request and a memory copy of its bytes (both pairs' pools, about
   1 GB, fit the guest's 3 GB; last, when nothing else holds memory).

Prints a table (:mod:`tests.bench.report`), writes everything to ``--json`` (default
``$KVBEAM_RESULTS_DIR/bench.json``), and ends with the targets table and one
``name=value`` line per target (:mod:`tests.bench.targets`), e.g.
``ratio_vs_ib_write_bw=0.NN`` (whole 32k-token unified request, integrity on,
bytes/s over ib_write_bw at 64 KiB). ``--report JSON [--host-json FILE]`` prints
an earlier run, first folding in the host figures (``bench_request --host-json``).
Plots: ``tests/bench/plot_bench.py`` on the host.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from kvbeam.client import KvbeamClient
from kvbeam.procs import DaemonProcess
from kvbeam.transport.options import TransportOptions
from tests.bench import bench_digest, bench_keys, bench_layers, targets
from tests.bench import bench_scaling as sc
from tests.bench.bench_request import (
    PairWork,
    RequestRow,
    aggregate,
    fragmented,
    run_requests,
)
from tests.bench.bench_threads import thread_breakdown
from tests.bench.bench_transport import (
    BUFFER,
    ib_write_bw,
    poster_rates,
    ref_seconds,
    run_kvbeam,
    sender_and_receiver,
)
from tests.bench.report import SIZES, report

#: Request lengths and list styles of the whole-request peer (Mooncake TE); the
#: engine-chosen styles are also sent through the daemons (``fragmented``).
PEER_LENS = (8192, 32768)
#: Requests per length whose CPU is split by thread (``tests.bench.bench_threads``).
THREAD_REQUESTS = 10
FRAGMENTED = ("pages", "engine")
LAT_ITERS = {4 << 10: 300, 64 << 10: 100, 1 << 20: 20}


def log(msg: str) -> None:
    """Progress on stderr (the table goes to stdout)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ib_write_lat(device: str, gid: int, size: int, iters: int, port: int,
                 timeout: float = 45.0) -> dict[str, float]:
    """One ``ib_write_lat`` run (server and client on ``device``): typical and average us.

    A run that does not finish within ``timeout`` is killed and reported as NaN
    (the rest of the suite still runs).
    """
    args = ["ib_write_lat", "-d", device, "-x", str(gid), "-F", "-s", str(size), "-n", str(iters),
            "-p", str(port)]
    nan = float("nan")
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.0)  # no readiness signal
        client = subprocess.run([*args, "127.0.0.1"], capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"ib_write_lat -s {size} did not finish in {timeout:.0f} s")
        return {"t_min_us": nan, "t_typical_us": nan, "t_avg_us": nan}
    finally:
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    for line in client.stdout.splitlines():
        f = line.split()
        if len(f) >= 6 and f[0] == str(size) and f[1].isdigit():
            return {"t_min_us": float(f[2]), "t_typical_us": float(f[4]), "t_avg_us": float(f[5])}
    log(f"ib_write_lat -s {size} printed no result: {client.stdout[-500:]} {client.stderr[-500:]}")
    return {"t_min_us": nan, "t_typical_us": nan, "t_avg_us": nan}


def limits(args: argparse.Namespace) -> dict[str, Any]:
    """ib_write_bw (median of --repeat) and ib_write_lat per size; a failed run is NaN."""
    out: dict[str, Any] = {"ib_write_bw": {}, "ib_write_lat": {}}
    for size in SIZES:
        runs = []
        for _ in range(args.repeat):
            try:
                runs.append(ib_write_bw(args.device, args.gid_index, size,
                                        ref_seconds(size, args.seconds), args.port))
            except (RuntimeError, subprocess.SubprocessError) as exc:
                log(f"ib_write_bw {size} B failed: {exc!r}")
        out["ib_write_bw"][str(size)] = {"runs_gbps": runs,
                                         "gbps": median(runs) if runs else float("nan")}
        log(f"ib_write_bw {size} B: {runs}")
        lat = ib_write_lat(args.device, args.gid_index, size, LAT_ITERS[size], args.port + 1)
        out["ib_write_lat"][str(size)] = lat
        log(f"ib_write_lat {size} B: {lat}")
    return out


def source_buffer() -> mmap.mmap:
    """The 64 MiB source both Mooncake and kvbeam write from (same random bytes)."""
    src = mmap.mmap(-1, BUFFER)
    src.write(np.random.default_rng(7).integers(0, 256, BUFFER, dtype=np.uint8).tobytes())
    return src


def _mooncake_child(extra: list[str], limit: float) -> dict[str, Any]:
    """``bench_mooncake`` in a child process with a time limit (a hang costs the limit,
    not the guest boot): its RESULT, or the reason there is none."""
    cmd = [sys.executable, "-m", "tests.bench.bench_mooncake", *extra]
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"error": f"Mooncake run did not finish within {limit:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            out: dict[str, Any] = json.loads(line[len("RESULT "):])
            return out
    return {"error": f"Mooncake run exited {done.returncode} without results "
                     f"(not installed? the bench extra: pip install '.[bench]')"}


def mooncake(args: argparse.Namespace) -> dict[str, Any]:
    """Mooncake TE per block size, or the reason it did not run."""
    return _mooncake_child(["--measure", ",".join(map(str, SIZES)), "--seconds",
                            str(args.seconds), "--repeat", str(args.repeat), "--device",
                            args.device],
                           60 + len(SIZES) * args.repeat * (args.seconds + 20))


def mooncake_request(args: argparse.Namespace) -> dict[str, Any]:
    """Mooncake TE moving whole requests' blocks (per list style and length), or why not."""
    styles = ("slot", *FRAGMENTED)
    return _mooncake_child(["--request", ",".join(map(str, PEER_LENS)), "--styles",
                            ",".join(styles), "--repeat", str(args.req_repeat), "--device",
                            args.device],
                           120 + len(styles) * len(PEER_LENS) * (args.req_repeat + 1) * 15)


def kvbeam_raw(args: argparse.Namespace, src: mmap.mmap) -> dict[str, Any]:
    """kvbeam's verbs transport, whole-buffer transfers of each size, two in flight."""
    options = TransportOptions(op_timeout_s=60.0)
    out: dict[str, Any] = {}
    with sender_and_receiver(args.device, args.gid_index, options, src) as (transport, link,
                                                                           peer):
        for size in SIZES:
            runs = []
            for _ in range(args.repeat):
                peer.call("fill", 0, b"\0" * BUFFER)
                runs.append(run_kvbeam(transport, link, peer, src, size, args.seconds))
            out[str(size)] = {"runs_gbps": [r[0] for r in runs],
                              "gbps": median(r[0] for r in runs),
                              "wrs_per_s": median(r[1] for r in runs),
                              "py_us_per_block": median(r[2] for r in runs),
                              "post_us_per_block": median(r[3] for r in runs),
                              "crc_ok": all(r[4] for r in runs)}
            log(f"kvbeam raw {size} B: {out[str(size)]['runs_gbps']}")
    return out


def scaling(args: argparse.Namespace) -> dict[str, Any]:
    """The four scaling curves (shorter runs: one each, args.scale_seconds)."""
    t = args.scale_seconds
    rig = sc.Rig(args.device, args.gid_index, BUFFER, TransportOptions(op_timeout_s=60.0))
    out: dict[str, Any] = {}
    try:
        sizes = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
        out["block_size"] = [p.as_dict() for p in sc.block_sizes(rig, sizes, t)]
        log("scaling: block sizes done")
        bpr = sc.blocks_per_request(rig, [1, 8, 64, 512], 16 << 10, t)
        out["blocks_per_request"] = {k: [p.as_dict() for p in v] for k, v in bpr.items()}
        log("scaling: blocks per request done")
        out["concurrency"] = [p.as_dict() for p in
                              sc.concurrency(rig, [1, 2, 4, 8, 16, 32, 64], 64 << 10, 16, t)]
        log("scaling: concurrency done")
        out["qps_per_peer"] = [p.as_dict() for p in sc.qps_per_peer(rig, [1, 2, 4], 64 << 10, t)]
        out["qps_per_peer_note"] = ("one RC QP per link: 2 and 4 QPs are that many links, "
                                    "each to its own receiver process")
        log("scaling: QPs per peer done")
    finally:
        rig.close()
    return out


def requests(args: argparse.Namespace, res: dict[str, Any]) -> list[dict[str, Any]]:
    """Whole requests: unified and paged, integrity on and off (one daemon pair each).

    On the first pair, also ``res["fragmented"]`` (engine-chosen lists) and
    ``res["aggregate"]`` (16 concurrent 8k requests) unless ``--skip``-ped.
    """
    rows: list[RequestRow] = []
    lens = [int(x) for x in args.lens.split(",")]
    skip = set(filter(None, args.skip.split(",")))

    def concurrent(key: str) -> PairWork:
        def work(prefill: DaemonProcess, decode: DaemonProcess, p: KvbeamClient,
                 d: KvbeamClient) -> None:
            if "aggregate" not in skip:
                res[key] = guarded(key, aggregate, prefill.address, decode.address)
                log(f"{key}: {res[key]}")
        return work

    def first_pair(prefill: DaemonProcess, decode: DaemonProcess, p: KvbeamClient,
                   d: KvbeamClient) -> None:
        if "fragmented" not in skip:
            res["fragmented"] = guarded("fragmented", fragmented, p, d, PEER_LENS, FRAGMENTED,
                                        args.req_repeat)
            log(f"fragmented lists: {res['fragmented']}")
        concurrent("aggregate")(prefill, decode, p, d)
        if "threads" not in skip:
            pids = {"prefill": prefill.proc.pid, "decode": decode.proc.pid}
            res["threads"] = {str(tokens): guarded(f"threads {tokens}", thread_breakdown, p, d,
                                                   pids, tokens, THREAD_REQUESTS)
                              for tokens in (128, 32768)}
            log(f"threads: {res['threads']}")

    # Both unified pairs run the concurrent requests: the target is with integrity on,
    # the pair with it off shows what integrity costs there.
    work_of = {(False, True): first_pair, (False, False): concurrent("aggregate_integrity_off")}
    for paged in (False, True):
        for integrity in (True, False):
            first = integrity and not paged
            # The first pair (unified, integrity on) is also profiled: 128-token requests
            # under py-spy, summarised by phase into the JSON.
            prof = os.path.join(args.results, "profile") if first else None
            rows += run_requests(paged, integrity, lens, args.req_repeat, profile_dir=prof,
                                 on_pair=work_of.get((paged, integrity)))
            log(f"requests {'paged' if paged else 'unified'} integrity {integrity}: "
                f"{[round(r.median_ms, 1) for r in rows[-len(lens):]]} ms")
    return [r.as_dict() for r in rows]


def profile_table(prof: Path) -> dict[str, Any]:
    """Per daemon: Python CPU ms per 128-token request by phase (py-spy, GIL held)."""
    from tests.bench.profile_summary import summarise

    info = (prof / "requests.txt").read_text().strip()
    nreq = int(info.split()[0])
    out: dict[str, Any] = {"info": info}
    for daemon in ("prefill", "decode"):
        counts = summarise(prof / f"{daemon}.txt")
        out[daemon] = {k: v / 250.0 / nreq * 1e3 for k, v in counts.most_common()}
    return out


def integrity_61l(repeat: int) -> dict[str, Any]:
    """Section 8: the 61-layer request over RDMA, integrity on and off, beside one
    thread's digests of it and a memory copy of its bytes."""
    lib = bench_digest.library_figures(pools=False)
    rows, _ = bench_digest.daemon_figures(repeat, "rdma")  # no plain floor in the guest
    return {"library": lib, "rdma": rows}


#: Sequential 128-token requests of the guest's engine-channel section (the flow phase
#: runs four times as many, ENGINE_INFLIGHT at once): TCG makes each one tens of ms.
ENGINE_REQUESTS = 40
ENGINE_INFLIGHT = 8


def engine_channel(results: str) -> dict[str, Any]:
    """Section 8: ``bench_engine_channel --transport rdma`` in a child process (its own
    daemons and engines), with a time limit; its figures (``--json``)."""
    out = Path(results) / "engine-channel.json"
    cmd = [sys.executable, "-m", "tests.bench.bench_engine_channel", "--transport", "rdma",
           "--requests", str(ENGINE_REQUESTS), "--flow", str(4 * ENGINE_REQUESTS),
           "--inflight", str(ENGINE_INFLIGHT), "--settle-ms", "0", "--json", str(out)]
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=1200)
    except subprocess.TimeoutExpired:
        return {"error": "bench_engine_channel did not finish within 1200 s"}
    log("engine channel (RDMA):\n" + "\n".join(
        line for line in done.stdout.splitlines() if line.startswith("#") or "=" in line))
    if done.returncode != 0 or not out.exists():
        return {"error": f"bench_engine_channel exited {done.returncode}: "
                         f"{done.stdout[-2000:]}"}
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def engine_layers(results: str) -> dict[str, Any]:
    """Section 9: ``bench_layers --transport rdma`` in a child process (its own daemons
    and engines), with a time limit; its figures (``--json``)."""
    out = Path(results) / "layers.json"
    cmd = [sys.executable, "-m", "tests.bench.bench_layers", "--transport", "rdma",
           "--json", str(out)]
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=900)
    except subprocess.TimeoutExpired:
        return {"error": "bench_layers did not finish within 900 s"}
    if done.returncode != 0 or not out.exists():
        return {"error": f"bench_layers exited {done.returncode}: {done.stdout[-2000:]}"}
    figures: dict[str, Any] = json.loads(out.read_text())
    log("layer by layer (RDMA):\n" + bench_layers.report(figures))
    return figures


def print_layers(res: dict[str, Any]) -> None:
    """Section 9's tables and lines, when it ran."""
    layers = res.get("engine_layers")
    if isinstance(layers, dict) and "rows" in layers:
        print(bench_layers.report(layers))
    elif isinstance(layers, dict):
        print(f"# engine_layers: {layers.get('error')}")


def guarded(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or ``{"error": ...}`` when it raises (logged with its traceback)."""
    try:
        return fn(*args)
    except (Exception, SystemExit) as exc:  # SystemExit: a request that did not succeed
        log(f"section {name} failed: {exc!r}\n{traceback.format_exc()}")
        return {"error": repr(exc)}


def report_file(path: Path, host_json: Path | None = None) -> None:
    """Print an earlier run's table; with ``host_json``, first fold the host figures
    into it (``res["host_tcp"]``, targets recomputed) and rewrite ``path``."""
    res = json.loads(path.read_text())
    if host_json is not None:
        res["host_tcp"] = json.loads(host_json.read_text())
        res["targets"] = targets.compute(res)
        path.write_text(json.dumps(res, indent=1, default=float))
    report(res)
    print_layers(res)


def main() -> None:
    """Run the sections, write the JSON, print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=os.environ.get("KVBEAM_RDMA_DEVICE", "rxe0"))
    p.add_argument("--gid-index", type=int,
                   default=int(os.environ.get("KVBEAM_RDMA_GID_INDEX", "0")))
    p.add_argument("--port", type=int, default=18515)
    p.add_argument("--seconds", type=int, default=3, help="per raw run (ib_write_bw at 1 MiB: 10)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--scale-seconds", type=float, default=1.5)
    p.add_argument("--lens", default="128,1024,8192,32768")
    p.add_argument("--req-repeat", type=int, default=5)
    p.add_argument("--skip", default="", help="comma list of sections to skip: mooncake, "
                   "mooncake_request,posters,scaling,requests,fragmented,aggregate,threads,"
                   "handshake_pool,engine_channel,engine_layers,integrity_61l "
                   "(quick iteration)")
    p.add_argument("--report", metavar="JSON", help="print the table of an earlier run and exit")
    p.add_argument("--host-json", metavar="FILE", help="with --report: fold these host "
                   "figures (bench_request --host-json) into JSON first (rewrites it)")
    p.add_argument("--results", default=os.environ.get("KVBEAM_RESULTS_DIR", "."),
                   help="where bench.json and profile/ go")
    p.add_argument("--json", help="default: RESULTS/bench.json")
    args = p.parse_args()
    if args.report:
        report_file(Path(args.report), Path(args.host_json) if args.host_json else None)
        return
    skip = set(filter(None, args.skip.split(",")))
    args.json = args.json or os.path.join(args.results, "bench.json")
    started = time.monotonic()
    res: dict[str, Any] = {"device": args.device, "repeat": args.repeat,
                           "req_repeat": args.req_repeat, "seconds": args.seconds,
                           "host": platform.node(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    src = source_buffer()
    res["limits"] = limits(args)
    # One guest boot is expensive and shared: a section that fails is recorded and the
    # others still run.
    res["mooncake"] = {} if "mooncake" in skip else guarded("mooncake", mooncake, args)
    if not {"mooncake", "mooncake_request"} & skip:
        res["mooncake_request"] = guarded("mooncake_request", mooncake_request, args)
    res["kvbeam_raw"] = guarded("kvbeam_raw", kvbeam_raw, args, src)
    if "posters" not in skip:  # both WR posters, the same blocks, this boot
        res["posters"] = guarded("posters", poster_rates, args.device, args.gid_index, src,
                                 4 << 10, args.seconds, args.repeat)
    if "scaling" not in skip:
        res["scaling"] = guarded("scaling", scaling, args)
    res["requests"] = [] if "requests" in skip else guarded("requests", requests, args, res)
    for sec in ("requests", "fragmented"):
        if isinstance(res.get(sec), dict):  # failed: keep the error, report no rows
            res[f"{sec}_error"] = res[sec].get("error")
            res[sec] = []
    if "handshake_pool" not in skip:
        res["handshake_pool"] = guarded("handshake_pool", bench_keys.handshake_pools,
                                        args.device, args.gid_index)
    if "engine_channel" not in skip:
        res["engine_channel"] = guarded("engine_channel", engine_channel, args.results)
    if "engine_layers" not in skip:
        res["engine_layers"] = guarded("engine_layers", engine_layers, args.results)
    if "integrity_61l" not in skip:
        res["integrity_61l"] = guarded("integrity_61l", integrity_61l, args.req_repeat)
    prof = Path(args.results) / "profile"
    if (prof / "requests.txt").exists():
        res["profile_128"] = guarded("profile", profile_table, prof)
    res["elapsed_s"] = time.monotonic() - started
    res["targets"] = targets.compute(res)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1, default=float))
    log(f"wrote {args.json} after {res['elapsed_s']:.0f} s")
    report(res)
    if isinstance(res.get("handshake_pool"), dict) and "error" not in res["handshake_pool"]:
        bench_keys.print_table(res["handshake_pool"])
    print_layers(res)
    crc = [v.get("crc_ok", True) for sec in ("mooncake", "kvbeam_raw")
           for v in res[sec].values() if isinstance(v, dict)]
    crc += [row.get("crc_ok", True) for per_len in (res.get("mooncake_request") or {}).values()
            if isinstance(per_len, dict) for row in per_len.values()]
    if not all(crc):
        sys.exit("CRC mismatch: a receiver's buffer differs from the source")


if __name__ == "__main__":
    main()
