"""Benchmark: staging overhead on CPU (kvbeam.engine.staging), beside plain copies.

A request's blocks are gathered out of an engine's KV (ordinary CPU tensors, its
blocks scattered: a shuffled free list) into the staging buffer (memfds) and scattered
from a second staging buffer into another engine's KV at other blocks: what the engine
process pays on top of the transfer when its KV is not the attached memory. Beside it,
in the same run, the same bytes copied plainly: one contiguous ``memcpy`` per layer into a
host buffer and one back out (two copies, like the staged path's gather and scatter; numpy
on one thread, as the staged CPU path copies), and a single memcpy of the bytes. Printed:
the median of each (interleaved rounds), GB/s, and ``staging_ratio`` = gather + scatter /
the plain copy out + in (target <= 1.5).

Run: ``make bench-staging`` or ``python tests/bench/bench_staging.py [--tokens N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvbeam.engine.staging import StagingBuffer
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.paged import paged_side_config, paged_spec
from kvbeam.pools.spec import SideConfig
from kvbeam.pools.types import IndexKind

#: Staging's target (issue 46): gather + scatter at most this times the plain copies.
TARGET_RATIO = 1.5


def bench_config(tokens: int, layers: int = 8) -> SideConfig:
    """A vLLM-like paged pool (bf16, 16-token blocks of 8 KV heads x 128): 32 KiB a token
    over 8 layers; room for two requests of ``tokens``."""
    spec = paged_spec(num_layers=layers, block_size=16, num_kv_heads=8, head_size=128,
                      dtype="bfloat16", inner_layout="LBHNC", num_blocks=2 * tokens // 16)
    return paged_side_config("bench-staging", spec)


def _interleaved(fs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """The median seconds of each function, run in turn round by round (so a busy
    moment of the shared host slows every one of them, not one)."""
    times: dict[str, list[float]] = {name: [] for name in fs}
    for _ in range(repeats):
        for name, f in fs.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    """Print the figures and the ratio line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="request length (tokens)")
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args(argv)
    config = bench_config(args.tokens)
    layout = build_side_layout(config)
    blocks = args.tokens // config.target.page_size
    rng = np.random.default_rng(0)
    src_kv, dst_kv = AllocatedSide(layout), AllocatedSide(layout)
    src_kv.fill_pattern(1)
    items = layout.flat_buffers[0].items
    src_lists = {IndexKind.KV_PAGES: rng.permutation(items)[:blocks]}
    dst_lists = {IndexKind.KV_PAGES: rng.permutation(items)[:blocks]}
    with StagingBuffer(config, requests=1, tokens=args.tokens) as out, \
            StagingBuffer(config, requests=1, tokens=args.tokens) as inn:
        staged = out.stage_out(src_kv, src_lists)
        landing = inn.reserve(dst_lists)
        nbytes = staged.nbytes
        out.release(staged)

        def gather() -> None:
            s = out.stage_out(src_kv, src_lists)
            out.release(s)

        def scatter() -> None:
            inn.stage_in(landing, dst_kv, dst_lists).wait()

        # The plain reference: the same bytes, contiguous, one memcpy per layer (numpy on
        # this thread, as the staged CPU path copies) into a host buffer and back out.
        per = nbytes // len(layout.flat_buffers)
        host = np.empty(nbytes, dtype=np.uint8)
        src_parts = [src_kv.buffer_array(b)[:per] for b in layout.flat_buffers]
        dst_parts = [dst_kv.buffer_array(b)[:per] for b in layout.flat_buffers]

        def plain_out() -> None:
            for i, v in enumerate(src_parts):
                host[i * per:(i + 1) * per] = v

        def plain_in() -> None:
            for i, v in enumerate(dst_parts):
                v[:] = host[i * per:(i + 1) * per]

        fs = {"gather": gather, "scatter": scatter, "out": plain_out, "in": plain_in}
        for f in fs.values():  # warm: every page faulted in
            f()
        t = _interleaved(fs, args.repeats)
        t_gather, t_scatter, t_out, t_in = t["gather"], t["scatter"], t["out"], t["in"]
        inn.release(landing)
    staged_s, plain_s = t_gather + t_scatter, t_out + t_in
    mib = nbytes / 2**20
    print(f"request: {args.tokens} tokens, {blocks} blocks x {len(layout.flat_buffers)} layers "
          f"({layout.flat_buffers[0].item_len >> 10} KiB blocks), {mib:.1f} MiB; torch threads "
          f"{torch.get_num_threads()}; median of {args.repeats}, interleaved")
    rows = [("staging gather (KV -> staging)", t_gather), ("staging scatter (staging -> KV)",
            t_scatter), ("plain copy out (one memcpy)", t_out), ("plain copy in (one memcpy)",
            t_in)]
    for name, secs in rows:
        print(f"  {name:<34} {secs * 1e3:8.2f} ms  {nbytes / secs / 1e9:6.2f} GB/s")
    ratio = staged_s / plain_s
    print(f"staging_ms={staged_s * 1e3:.2f} plain_ms={plain_s * 1e3:.2f}")
    print(f"staging_ratio={ratio:.2f} (gather + scatter / plain copy out + in; target <= "
          f"{TARGET_RATIO}: {'met' if ratio <= TARGET_RATIO else 'NOT met'})")
    print(f"staging_vs_one_memcpy={staged_s / t_out:.2f} (gather + scatter / one plain copy "
          f"of the bytes)")


if __name__ == "__main__":
    main()
