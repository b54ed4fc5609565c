"""Benchmark: planning time for large requests (host, no RDMA).

Prints the median and best planning time for a 128k-token request through every
component of a DSV4-like layout, unified and paged (target: < 10 ms), and for a
128-token request, whose planning is the fixed cost the send path pays per request.
Timed: ``build_plan`` and reading the plan's whole block batch and byte count.

Run: ``make bench-plan`` or ``python tests/bench/bench_plan.py``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.plan import build_plan
from kvbeam.pools.spec import PoolSpec, SideConfig
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
    print(f"{'case':<32} {'buffers':>7} {'blocks':>7} {'MiB':>9} {'median ms':>10} {'best ms':>8}")
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
            times = []
            for _ in range(200 if tokens < TOKENS else 30):
                t0 = time.perf_counter()
                plan = build_plan(lay, addrs, src, lay, addrs, dst)
                _ = plan.blocks, plan.total_bytes  # what the send path reads: timed too
                times.append((time.perf_counter() - t0) * 1e3)
            name = f"{'unified' if unified else 'paged'} {tokens} page={page_size}" + (
                " scattered" if scatter else "")
            print(f"{name:<32} {len(lay.flat_buffers):>7} {plan.num_blocks:>7} "
                  f"{plan.total_bytes / 2**20:>9.1f} {statistics.median(times):>10.2f} "
                  f"{min(times):>8.2f}")


if __name__ == "__main__":
    main()
