"""Benchmark: integrity's digests beside the wire (host, no RDMA).

1. XXH3-128 GB/s (python ``xxhash``) on one thread for the region sizes of the
   61-layer layout, and aggregate GB/s of 2 and 4 threads digesting different
   buffers (it scales only where the binding releases the GIL), with the process's
   CPU seconds per wall second beside each (the cores it really got).
2. Whether a digest call releases the GIL: a pure-Python loop's iterations per second
   while another thread digests, over its rate alone (about 1.0: released; much
   less: held), for a buffer below and above the binding's threshold (64 KiB).
3. One 61-layer request's digests (head_dim 512, 16k tokens, 182 buffers) on the
   calling thread and on :class:`kvbeam.pools.digest_pool.DigestPool` of 2 and 4
   threads; and a small request's (128 tokens of docker/config/prefill.yaml), which
   the pool digests on the calling thread (``INLINE_BELOW_BYTES``), beside the same
   job handed to 2 pool threads. Where the compiled helper (pools/_xxh3.c) is in use,
   each beside the same parts digested through python-xxhash on one thread ("python").
4. That request over TCP on loopback between two daemons, integrity on and off,
   beside a memory copy of the same bytes measured in the same run (the floor a
   loopback transfer cannot beat), with each daemon's CPU per request.

The last lines are machine-readable: ``integrity_61l_ratio=N.NN`` (integrity on over
off, median Send-to-Success; the target is at most 1.15) and
``digest_gbps_one_thread=N.N``.

Run: ``make bench-digest`` (part of ``make bench-host``) or
``python -m tests.bench.bench_digest [--json FILE] [--repeat N] [--skip-daemons]``; in
the soft-RoCE guest ``--transport rdma --skip-library --repeat 3`` (both daemon pairs'
pools, about 1 GB, fit its 3 GB).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvbeam.client import KvbeamClient
from kvbeam.pools import digest
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.digest import digest_many, digest_parts, request_digests
from kvbeam.pools.digest_pool import INLINE_BELOW_BYTES, DigestPool
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.plan import list_for
from kvbeam.pools.spec import PoolSpec, SideConfig, load_side_config
from kvbeam.procs import DaemonProcess, start_daemon
from kvbeam.scheduler import run_request
from tests.bench.bench_request import BENCH_DEADLINES, stat_cpu_s
from tests.bench.plain_stream import PlainStream
from tests.daemon_helpers import SLOW_GUEST

#: The 61-layer request: DeepSeek-V4's C4/C128 alternation, NextN draft, head_dim 512.
TOKENS = 16384
RATIOS = (0, 4, 128) * 20 + (0,)
#: Request slots of each daemon in the TCP case (two: a request and the next one).
SLOTS = 2
#: Region sizes of that layout's request (bytes moved per buffer, see part 1).
SIZES = (8192, 65536, 131072, 524288, 4 << 20)


def dsv4_61(slots: int = SLOTS, tokens: int = TOKENS) -> SideConfig:
    """The 61-layer DSV4-like layout (the planning and handshake benches' own)."""
    common: dict[str, Any] = {"unified_kv": True, "sliding_window": 128,
                              "num_draft_tokens": 4, "page_size": 256,
                              "num_req_slots": slots, "max_context_len": tokens,
                              "head_dim": 512}
    return SideConfig("dsv4-61", PoolSpec(compression_ratios=RATIOS, **common),
                      PoolSpec(compression_ratios=(0,), **common))


def _yaml(cfg: SideConfig, path: Path) -> str:
    """The layout as a daemon config file (the shipped configs' format)."""
    def pool(spec: PoolSpec) -> str:
        ratios = ", ".join(str(r) for r in spec.compression_ratios)
        return (f"  compression_ratios: [{ratios}]\n  unified_kv: true\n"
                f"  sliding_window: {spec.sliding_window}\n"
                f"  num_draft_tokens: {spec.num_draft_tokens}\n  page_size: {spec.page_size}\n"
                f"  num_req_slots: {spec.num_req_slots}\n"
                f"  max_context_len: {spec.max_context_len}\n  head_dim: {spec.head_dim}\n"
                f"  dtype: {spec.dtype}\n")
    assert cfg.draft is not None
    path.write_text(f"model: {cfg.model}\ntarget:\n{pool(cfg.target)}draft:\n{pool(cfg.draft)}")
    return str(path)


def _cpu() -> float:
    return time.process_time()


def _threads_gbps(size: int, threads: int, seconds: float = 0.6) -> tuple[float, float]:
    """(aggregate GB/s, process CPU s per wall s) of ``threads`` threads digesting
    their own ``size``-byte buffer over and over for about ``seconds``."""
    bufs = [np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8)
            for i in range(threads)]
    reps = max(4, int(seconds * 8e9 / size / threads))  # ~8 GB/s: about ``seconds``
    for b in bufs:
        xxhash.xxh3_128_intdigest(b.data)

    def work(b: np.ndarray[Any, Any]) -> None:
        for _ in range(reps):
            xxhash.xxh3_128_intdigest(b.data)

    pool = [threading.Thread(target=work, args=(b,)) for b in bufs]
    c0, t0 = _cpu(), time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    wall = time.perf_counter() - t0
    return size * reps * threads / wall / 1e9, (_cpu() - c0) / wall


def _gil_released(size: int = 256 << 20) -> tuple[float, int]:
    """(ms of one digest call of ``size`` bytes, iterations a Python loop in another
    thread made during that call). Held GIL: about none (the loop cannot run while
    the call lasts, whatever the load); released: thousands."""
    buf = np.ones(size, dtype=np.uint8)
    xxhash.xxh3_128_intdigest(buf.data)  # pages touched once
    stamps: list[float] = []
    go, stop = threading.Event(), threading.Event()

    def spin() -> None:
        go.set()
        while not stop.is_set():
            stamps.append(time.perf_counter())

    t = threading.Thread(target=spin)
    t.start()
    go.wait()
    time.sleep(0.01)
    t0 = time.perf_counter()
    xxhash.xxh3_128_intdigest(buf.data)
    t1 = time.perf_counter()
    stop.set()
    t.join()
    return (t1 - t0) * 1e3, sum(1 for s in stamps if t0 < s < t1)


def _median_ms(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """(median wall ms, median process CPU ms) of ``n`` calls of ``fn``."""
    wall, cpu = [], []
    for _ in range(n):
        c0, t0 = _cpu(), time.perf_counter()
        fn()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((_cpu() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def small_request_figures(n: int = 300) -> dict[str, tuple[float, float]]:
    """A 128-token request's digests (docker/config/prefill.yaml): median wall and CPU
    microseconds as the pool runs them (on the calling thread) and handed to 2 threads."""
    from tests.fixtures import shipped_config

    cfg = load_side_config(shipped_config("prefill"))
    side = AllocatedSide(build_side_layout(cfg))
    side.fill_pattern(1)
    idx = request_indices(cfg.target, 0, 128)
    out = {}
    if digest.COMPILED:  # the reference: the same parts through python-xxhash, inline
        wall, cpu = _median_ms(lambda: digest_many(digest_parts(side, idx), compiled=False), n)
        out["python"] = (wall * 1e3, cpu * 1e3)
    for name, inline_below in (("inline", INLINE_BELOW_BYTES), ("pool_2", 0)):
        with DigestPool(2, inline_below=inline_below) as pool:
            wall, cpu = _median_ms(lambda p=pool: p.digests(side, idx).result(),  # type: ignore[misc]
                                   n)
        out[name] = (wall * 1e3, cpu * 1e3)
    return out


def library_figures(pools: bool = True) -> dict[str, Any]:
    """Parts 1-3: the binding's GB/s, its GIL, and one request's digests by pool size;
    without ``pools`` only the request's digests on one thread and the memory copy (the
    guest, where the rest would take minutes)."""
    out: dict[str, Any] = {"xxhash": xxhash.VERSION, "cores": os.cpu_count(), "sizes": []}
    for size in SIZES if pools else ():
        row: dict[str, Any] = {"bytes": size}
        for n in (1, 2, 4):
            gbps, cores = _threads_gbps(size, n)
            row[f"gbps_{n}"], row[f"cores_{n}"] = gbps, cores
        out["sizes"].append(row)
    if pools:
        out["gil_call_ms"], out["gil_other_thread_iterations"] = _gil_released()
    cfg = dsv4_61(slots=1)
    side = AllocatedSide(build_side_layout(cfg))
    side.fill_pattern(1)
    idx = request_indices(cfg.target, 0, TOKENS)
    nbytes = sum(len(list_for(idx, None, c.pool, b.index_kind)) * b.item_len
                 for c in side.layout.components for b in c.buffers)
    out["request_bytes"] = nbytes
    out["request_buffers"] = len(side.layout.flat_buffers)
    out["request_sizes"] = digest_parts(side, idx).part_bytes()
    want = request_digests(side, idx)
    out["digester"] = digest.digester()
    out["request_ms"] = {"inline": _median_ms(lambda: request_digests(side, idx), 9)}
    if digest.COMPILED:  # the reference: python-xxhash, a call per buffer
        parts = digest_parts(side, idx)
        if digest_many(parts, compiled=False) != want:
            raise SystemExit("python-xxhash gave other digests than the compiled helper")
        out["request_ms"]["python"] = _median_ms(
            lambda: digest_many(digest_parts(side, idx), compiled=False), 9)
    # The pools digest on their own threads: process CPU counts them too.
    for threads in (2, 4) if pools else ():
        with DigestPool(threads) as pool:
            if pool.digests(side, idx).result() != want:
                raise SystemExit(f"the pool of {threads} gave other digests than inline")
            out["request_ms"][f"pool_{threads}"] = _median_ms(
                lambda p=pool: p.digests(side, idx).result(), 9)  # type: ignore[misc]
    if pools:
        out["small_request_us"] = small_request_figures()
    # The same bytes copied once in memory (one core): the floor of any transfer.
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    out["memcpy_ms"] = _median_ms(lambda: np.copyto(dst, src), 9)
    return out


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid`` so far, summed by thread name with its
    number dropped (``kvbeam-digest_0`` and ``kvbeam-digest_1`` are ``kvbeam-digest``)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip().rstrip("0123456789").rstrip("_-")
            out[name or "?"] = out.get(name or "?", 0.0) + stat_cpu_s((task / "stat").read_text())
        except OSError:  # the thread ended meanwhile
            continue
    return out


def daemon_figures(repeat: int, transport: str = "tcp", whole: bool = False,
                   plain: list[int] | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Part 4: the 61-layer request over ``transport`` (TCP on loopback; rdma in the
    soft-RoCE guest), integrity on and off; with ``whole`` also integrity on with decode's
    sub-batches off (``--verify-sub-batch-mib 0``: the request digested whole after its
    last byte), the reference for what the sub-batches change.

    The daemon pairs run at once and the requests alternate between them (off, on,
    off, on, ...), so a neighbour's load falls on all alike. CPU per request is each
    daemon's, and split by thread name (/proc/PID/task). With ``plain`` (the request's
    bytes per buffer) the same pieces also go between two plain processes, off and on,
    in the same rotation (:mod:`tests.bench.plain_stream`: the floor under the ratio).
    Returns the rows by mode, and the plain floor's (None without ``plain``).
    """
    modes: dict[str, list[str]] = {"off": ["--integrity", "false"], "on": ["--integrity", "true"]}
    if whole:
        modes["on_whole"] = ["--integrity", "true", "--verify-sub-batch-mib", "0"]
    pairs: dict[str, tuple[DaemonProcess, DaemonProcess]] = {}
    rows: dict[str, Any] = {}
    floor: dict[str, list[float]] = {"off": [], "on": [], "off_cpu": [], "on_cpu": []}
    with tempfile.TemporaryDirectory(prefix="kvbeam-bench-61l-") as tmp, \
            contextlib.ExitStack() as stack:
        stream = stack.enter_context(PlainStream(plain)) if plain else None
        cfg = _yaml(dsv4_61(), Path(tmp) / "dsv4-61.yaml")
        try:
            for m, mode_flags in modes.items():
                flags = ["--transport", transport, *mode_flags,
                         *(SLOW_GUEST if transport == "rdma" else []), *BENCH_DEADLINES]
                decode = start_daemon("decode", cfg, extra=[*flags, "--fill-seed", "2"],
                                      timeout=300.0)
                pairs[m] = (start_daemon("prefill", cfg, extra=[*flags, "--fill-seed", "1"],
                                         timeout=300.0), decode)
            clients = {m: (KvbeamClient(pairs[m][0].address), KvbeamClient(pairs[m][1].address))
                       for m in modes}
            times: dict[str, list[float]] = {m: [] for m in modes}
            nbytes: dict[str, int] = {}
            cpu0: dict[str, list[dict[str, float]]] = {}
            for i in range(repeat + 1):  # the first of each is a warm-up
                for m in modes:
                    if i == 1:
                        cpu0[m] = [thread_cpu_s(d.proc.pid) for d in pairs[m]]
                    p, d = clients[m]
                    r = run_request(p, d, f"b61-{m}-{i}", TOKENS, i % SLOTS, timeout=120.0)
                    if not r.ok or (m != "off" and not r.verified):
                        raise SystemExit(f"request {r.request_id} ended {r.state}")
                    nbytes[m] = r.bytes
                    if i:
                        times[m].append(r.send_to_success_s * 1e3)
                if stream is not None:
                    for on in (False, True):
                        wall, cpu = stream.request(on)
                        if i:
                            floor["on" if on else "off"].append(wall)
                            floor["on_cpu" if on else "off_cpu"].append(cpu)
            for m in modes:
                split = []
                for daemon, before in zip(pairs[m], cpu0[m], strict=True):
                    now = thread_cpu_s(daemon.proc.pid)
                    split.append({k: (v - before.get(k, 0.0)) * 1e3 / repeat
                                  for k, v in now.items() if v - before.get(k, 0.0) > 0})
                rows[m] = {
                    "bytes": nbytes[m], "median_ms": statistics.median(times[m]),
                    "best_ms": min(times[m]), "runs_ms": times[m],
                    "prefill_cpu_ms": sum(split[0].values()),
                    "decode_cpu_ms": sum(split[1].values()),
                    "prefill_threads_ms": split[0], "decode_threads_ms": split[1]}
            for p, d in clients.values():
                p.close()
                d.close()
        finally:
            for pair in pairs.values():
                for daemon in pair:
                    daemon.stop()
    plain_rows = None if stream is None else {
        m: {"median_ms": statistics.median(floor[m]),
            "sender_cpu_ms": statistics.median(floor[f"{m}_cpu"])} for m in ("off", "on")}
    return rows, plain_rows


def print_daemon_figures(rows: dict[str, Any], transport: str, memcpy_ms: float,
                         plain: dict[str, Any] | None = None) -> None:
    """Part 4's lines (also in ``make bench``'s guest report) and the ratio line; with
    ``plain`` (:func:`daemon_figures`'s floor) the floor's line and ratio too."""
    where = "TCP on loopback" if transport == "tcp" else "RDMA"
    print(f"61-layer {TOKENS}-token request over {where} (median of "
          f"{len(rows['on']['runs_ms'])}, Send to Success):")
    labels = {"on_whole": "on, sub-batches off (--verify-sub-batch-mib 0)"}
    for name, r in rows.items():
        print(f"  integrity {labels.get(name, name):<3}: {r['median_ms']:.1f} ms "
              f"(best {r['best_ms']:.1f}), "
              f"{r['bytes'] / 1e6:.1f} MB; CPU per request prefill "
              f"{r['prefill_cpu_ms']:.1f} ms, decode {r['decode_cpu_ms']:.1f} ms")
        for side in ("prefill", "decode"):
            top = sorted(r[f"{side}_threads_ms"].items(), key=lambda kv: -kv[1])[:5]
            print(f"    {side} by thread: " + ", ".join(f"{k} {v:.1f}" for k, v in top))
    print(f"  memory copy of the same bytes: {memcpy_ms:.1f} ms")
    if plain:  # tests/bench/plain_stream.py: the floor under the ratio on this machine
        print(f"  plain floor (two plain processes, the same pieces over the same loopback, "
              f"digested on the threads that move them; python-xxhash): off "
              f"{plain['off']['median_ms']:.1f} ms, on {plain['on']['median_ms']:.1f} ms; "
              f"sender CPU {plain['off']['sender_cpu_ms']:.1f} -> "
              f"{plain['on']['sender_cpu_ms']:.1f} ms")
        print(f"integrity_61l_floor_ratio="
              f"{plain['on']['median_ms'] / plain['off']['median_ms']:.2f}")
    suffix = "" if transport == "tcp" else "_rdma"
    print(f"integrity_61l{suffix}_ratio={rows['on']['median_ms'] / rows['off']['median_ms']:.2f}")


def main() -> None:
    """Print the figures (and write them as JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--skip-daemons", action="store_true",
                        help="parts 1-3 only (no daemons)")
    parser.add_argument("--transport", choices=("tcp", "rdma"), default="tcp",
                        help="part 4's data plane (rdma: in the soft-RoCE guest, with "
                             "--skip-library)")
    parser.add_argument("--skip-library", action="store_true",
                        help="of parts 1-3 only the request's digests on one thread and the "
                             "memory copy (minutes in the guest otherwise)")
    args = parser.parse_args()
    lib = library_figures(pools=not args.skip_library)
    mb = lib["request_bytes"] / 1e6
    if lib["sizes"]:
        print(f"XXH3-128 (python xxhash {lib['xxhash']}), {lib['cores']} cores: aggregate GB/s "
              "of N threads on their own buffers, the cores the process got (CPU s per wall "
              "s), and GB per CPU second (per core)")
        print(f"{'bytes':>9} " + " ".join(f"{f'{n} thread(s)':>24}" for n in (1, 2, 4)))
        for row in lib["sizes"]:
            print(f"{row['bytes']:>9} " + " ".join(
                f"{row[f'gbps_{n}']:>7.1f} ({row[f'cores_{n}']:.2f} cores) "
                f"{row[f'gbps_{n}'] / row[f'cores_{n}']:>5.1f}/core" for n in (1, 2, 4)))
        print(f"GIL: one {lib['gil_call_ms']:.1f} ms digest call of 256 MiB; a Python loop in "
              f"another thread ran {lib['gil_other_thread_iterations']} iterations meanwhile "
              "(0 would mean the call holds the GIL)")
    print(f"request digests: {lib['digester']}")
    print(f"61-layer {TOKENS}-token request ({lib['request_buffers']} buffers, {mb:.1f} MB), "
          "median wall ms (process CPU ms); python: python-xxhash on one thread:")
    for name, (wall, cpu) in lib["request_ms"].items():
        print(f"  digests {name:<7}: {wall:6.1f} ms ({cpu:6.1f} CPU ms), {mb / wall:5.1f} GB/s")
    print(f"  memory copy of the same bytes (numpy copyto): {lib['memcpy_ms'][0]:.1f} ms")
    for name, (wall, cpu) in lib.get("small_request_us", {}).items():
        print(f"128-token request's digests {name:<7}: {wall:6.0f} us ({cpu:6.0f} CPU us)")
    res: dict[str, Any] = {"library": lib}
    if not args.skip_daemons:
        rows, plain = daemon_figures(
            args.repeat, args.transport, whole=args.transport == "tcp",
            plain=lib["request_sizes"] if args.transport == "tcp" else None)
        res[args.transport] = rows
        if plain is not None:
            res["plain_floor"] = plain
        print_daemon_figures(rows, args.transport, lib["memcpy_ms"][0], plain)
    if lib["sizes"]:
        print(f"digest_gbps_one_thread={lib['sizes'][3]['gbps_1']:.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
