"""Benchmark: planning time for large requests (host, no RDMA).

Prints the median and best planning time for a 128k-token request through every
component of a DSV4-like layout, unified and paged (target: < 10 ms), and for a
128-token request, whose planning is the fixed cost the send path pays per request.
Timed: ``build_plan`` and reading the plan's whole block batch and byte count, through
the compiled planner (pools/_plan.c, where it was built) and, beside it in the same run,
through the Python and numpy paths it replaced (``python ms``: numpy for large plans,
plain Python for small ones). Last, a 128-token request of docker/config/prefill.yaml
planned by each path (compiled; plain Python, as small plans were; numpy throughout).

Run: ``make bench-plan`` or ``python tests/bench/bench_plan.py``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from kvbeam.pools import plan as plan_module
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.plan import build_plan
from kvbeam.pools.spec import PoolSpec, SideConfig, load_side_config
from kvbeam.pools.types import IndexKind

TOKENS = 128 * 1024


def _config(unified: bool, page_size: int) -> SideConfig:
    target = PoolSpec(compression_ratios=(0, 4, 128) * 20 + (0,), unified_kv=unified,
                      sliding_window=128, num_draft_tokens=4, page_size=page_size,
                      num_req_slots=4, max_context_len=TOKENS, head_dim=512)
    draft = PoolSpec(compression_ratios=(0,), unified_kv=unified, sliding_window=128,
                     num_draft_tokens=4, page_size=page_size, num_req_slots=4,
                     max_context_len=TOKENS, head_dim=512)
    return SideConfig("dsv4-bench", target, draft)


def main() -> None:
    """Print one line per case."""
    print(f"{plan_module.planner()}")
    print(f"{'case':<32} {'buffers':>7} {'blocks':>7} {'MiB':>9} {'median ms':>10} "
          f"{'best ms':>8} {'python ms':>10}")
    cases = [(TOKENS, page, scatter) for page, scatter in ((256, False), (256, True), (128, True))]
    for unified in (True, False):
        for tokens, page_size, scatter in [*cases, (128, 256, False)]:
            cfg = _config(unified, page_size)
            lay = build_side_layout(cfg)
            addrs = [1 << 40] * len(lay.flat_buffers)
            src = request_indices(cfg.target, 1, tokens)
            dst = request_indices(cfg.target, 2, tokens)
            if scatter:  # decode pages scattered: no coalescing possible on the KV pages
                rng = np.random.default_rng(0)
                dst = dict(dst)
                dst[IndexKind.KV_PAGES] = rng.permutation(dst[IndexKind.KV_PAGES])
            runs: dict[bool, list[float]] = {True: [], False: []}
            saved = plan_module.COMPILED
            try:
                for _ in range(200 if tokens < TOKENS else 30):
                    for compiled in (saved, False):  # interleaved: the same machine state
                        plan_module.COMPILED = compiled
                        t0 = time.perf_counter()
                        plan = build_plan(lay, addrs, src, lay, addrs, dst)
                        _ = plan.blocks, plan.total_bytes  # what the send path reads
                        runs[compiled].append((time.perf_counter() - t0) * 1e3)
            finally:
                plan_module.COMPILED = saved
            times = runs[saved]
            name = f"{'unified' if unified else 'paged'} {tokens} page={page_size}" + (
                " scattered" if scatter else "")
            print(f"{name:<32} {len(lay.flat_buffers):>7} {plan.num_blocks:>7} "
                  f"{plan.total_bytes / 2**20:>9.1f} {statistics.median(times):>10.2f} "
                  f"{min(times):>8.2f} {statistics.median(runs[False]):>10.2f}")

    small_request_paths()


def small_request_paths(n: int = 2000) -> None:
    """A 128-token request of the shipped prefill config, planned by each path."""
    cfg = load_side_config(str(Path(__file__).resolve().parents[2] / "docker/config/prefill.yaml"))
    lay = build_side_layout(cfg)
    addrs = [(1 << 40) + (i << 24) for i in range(len(lay.flat_buffers))]
    src, dst = request_indices(cfg.target, 0, 128), request_indices(cfg.target, 1, 128)
    saved = plan_module.COMPILED, plan_module.SHORT_LIST, plan_module.SMALL_PLAN_BLOCKS
    out = {}
    try:
        for name, limits in (("compiled", saved), ("python", (False, *saved[1:])),
                             ("numpy", (False, 0, 0))):
            plan_module.COMPILED, plan_module.SHORT_LIST, plan_module.SMALL_PLAN_BLOCKS = limits
            runs = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(n):
                    build_plan(lay, addrs, src, lay, addrs, dst)
                runs.append((time.perf_counter() - t0) / n * 1e6)
            out[name] = statistics.median(runs)
    finally:
        plan_module.COMPILED, plan_module.SHORT_LIST, plan_module.SMALL_PLAN_BLOCKS = saved
    print(f"128-token request, docker/config/prefill.yaml ({len(lay.flat_buffers)} buffers): "
          f"{out['compiled']:.0f} us (same run: Python path {out['python']:.0f} us, numpy "
          f"path {out['numpy']:.0f} us)")


if __name__ == "__main__":
    main()
