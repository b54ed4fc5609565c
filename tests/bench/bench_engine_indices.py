"""Benchmark: slot-contiguous against engine-chosen (shuffled, fragmented) index lists.

Two parts, for the same request sizes:

1. Planning (in-process, DSV4-like 61-layer layout of ``bench_plan``): blocks per
   request, validation time of the engine's lists, plan time.
2. Over TCP, or RDMA in the guest (two daemons, the shipped unified config, integrity on):
   median Send-to-Success time and bytes/s through the scheduler API.

"engine" lists are random picks without replacement from the whole pool on each
side, every kind: the worst case for coalescing (almost every item its own
block). "pages" shuffles the pages and state items the same way but keeps each
request's ring rows one ring (``slot * ring + pos % ring`` of a random slot, as
sglang's unified pool lays them out): what an engine's free list gives.

Run: ``python -m tests.bench.bench_engine_indices [--runs 5] [--transport rdma]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from kvbeam.client import KvbeamClient
from kvbeam.pools.engine_indices import validate
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import SideLayout, build_side_layout
from kvbeam.pools.plan import build_plan
from kvbeam.pools.spec import PoolSpec, load_side_config
from kvbeam.pools.types import IndexKind
from kvbeam.scheduler import run_request
from tests.bench.bench_plan import _config
from tests.daemon_helpers import start_both
from tests.engine_lists import as_mapping, random_lists
from tests.fixtures import shipped_config


def page_lists(spec: PoolSpec, lay: SideLayout, tokens: int,
               rng: np.random.Generator) -> dict[IndexKind, np.ndarray]:
    """Shuffled pages and state items, the ring rows of one random slot's ring."""
    lists = random_lists(spec, lay, tokens, rng)
    if IndexKind.SWA_RING_ROWS in lists:
        slot = int(rng.integers(spec.num_req_slots))
        lists[IndexKind.SWA_RING_ROWS] = request_indices(spec, slot, tokens)[
            IndexKind.SWA_RING_ROWS]
    return lists


def _median_ms(fn: Callable[[], object], runs: int = 20) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def plan_part() -> None:
    """Blocks, validation and plan time per request size, slot vs engine lists."""
    print(f"{'layout':<8} {'tokens':>7} {'lists':<7} {'blocks':>7} {'MiB':>7} "
          f"{'validate ms':>11} {'plan ms':>8}")
    for unified in (True, False):
        cfg = _config(unified, 256)
        lay = build_side_layout(cfg)
        addrs = [1 << 40] * len(lay.flat_buffers)
        rng = np.random.default_rng(0)
        for tokens in (4096, 32768, 131072):
            cases = {
                "slot": (request_indices(cfg.target, 1, tokens),
                         request_indices(cfg.target, 2, tokens)),
                "engine": (random_lists(cfg.target, lay, tokens, rng),
                           random_lists(cfg.target, lay, tokens, rng)),
                "pages": (page_lists(cfg.target, lay, tokens, rng),
                          page_lists(cfg.target, lay, tokens, rng)),
            }
            for name, (src, dst) in cases.items():
                plan = build_plan(lay, addrs, src, lay, addrs, dst)
                v_ms = (_median_ms(partial(validate, "decode", cfg.target, lay, dst, {}, tokens))
                        if name != "slot" else 0.0)
                p_ms = _median_ms(partial(build_plan, lay, addrs, src, lay, addrs, dst))
                print(f"{'unified' if unified else 'paged':<8} {tokens:>7} {name:<7} "
                      f"{plan.num_blocks:>7} {plan.total_bytes / 2**20:>7.1f} {v_ms:>11.2f} "
                      f"{p_ms:>8.2f}")


def transfer_rows(p: KvbeamClient, d: KvbeamClient, sizes: Sequence[int], runs: int,
                  paged: bool = False) -> list[dict[str, Any]]:
    """Median Send-to-Success per size and list style between two running daemons.

    Every request must end CRC32C-verified (AssertionError otherwise).
    """
    pcfg, cfg = (load_side_config(shipped_config(role, paged)) for role in ("prefill", "decode"))
    play, lay = build_side_layout(pcfg), build_side_layout(cfg)
    addrs = [1 << 40] * len(lay.flat_buffers)
    rng = np.random.default_rng(1)
    rows = []
    for tokens in sizes:
        for name in ("slot", "pages", "engine"):
            ms, nbytes, blocks = [], 0, 0
            for i in range(runs + 1):  # the first run warms the connection up
                if name == "slot":
                    s = request_indices(pcfg.target, 0, tokens)
                    dst = request_indices(cfg.target, 0, tokens)
                else:
                    pick = random_lists if name == "engine" else page_lists
                    s = pick(pcfg.target, play, tokens, rng)
                    dst = pick(cfg.target, lay, tokens, rng)
                blocks = build_plan(play, addrs, s, lay, addrs, dst).num_blocks
                engine = name != "slot"
                r = run_request(p, d, f"{name}-{tokens}-{i}-{time.monotonic_ns()}", tokens, 0,
                                src_indices=as_mapping(s) if engine else None,
                                dst_indices=as_mapping(dst) if engine else None, timeout=120)
                assert r.verified, r
                if i:
                    ms.append(r.send_to_success_s * 1e3)
                    nbytes = r.bytes
            med = statistics.median(ms)
            rows.append({"tokens": tokens, "lists": name, "blocks": blocks, "bytes": nbytes,
                         "median_ms": round(med, 1), "mb_s": round(nbytes / med / 1e3)})
    return rows


def transfer_part(runs: int, transport: str) -> None:
    """Send-to-Success over ``transport``, slot vs engine lists, one daemon pair."""
    prefill, decode = start_both(transport=transport)
    try:
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            rows = transfer_rows(p, d, (1024, 8192, 32768), runs)
    finally:
        prefill.stop()
        decode.stop()
    print(f"\n{transport}: {'tokens':>7} {'lists':<7} {'blocks':>7} {'MiB':>7} "
          f"{'median ms':>10} {'MB/s':>8}")
    for r in rows:
        print(f"{'':<{len(transport) + 2}}{r['tokens']:>7} {r['lists']:<7} {r['blocks']:>7} "
              f"{r['bytes'] / 2**20:>7.1f} {r['median_ms']:>10.1f} {r['mb_s']:>8}")


def main() -> None:
    """Both parts."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--transport", default="tcp", help="tcp or rdma (the guest)")
    ap.add_argument("--no-plan", action="store_true")
    ap.add_argument("--no-transfer", action="store_true")
    args = ap.parse_args()
    if not args.no_plan:
        plan_part()
    if not args.no_transfer:
        transfer_part(args.runs, args.transport)


if __name__ == "__main__":
    main()
