"""``kvbeam plan``: print what a request moves, component by component."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvbeam.commands.check import print_verdict, verify
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.plan import TransferPlan, build_plan
from kvbeam.pools.spec import load_side_config

NAME = "plan"
HELP = "print the components and blocks a request moves (offsets relative to each buffer)"
DESCRIPTION = """\
Plan one request's transfer and print it: every component, every buffer, and the
coalesced (source offset, destination offset, length) blocks. Offsets are relative
to the start of each buffer. Without --decode, the destination uses the same
layout as the source (same config on both sides).

The configs first go through `kvbeam check` (the checks a daemon runs at start-up
and at the handshake): a plan between pools that cannot exchange state is refused
with check's report and its exit code.

exit codes:
  0  planned
  1  incompatible pools (a side's target/draft, or prefill against decode)
  2  a config or the request cannot be used

examples:
  kvbeam plan --config docker/config/prefill.yaml --request-slot 7 --seq-len 129
  kvbeam plan --config docker/config/prefill.yaml --request-slot 1 --seq-len 4096 \\
      --decode docker/config/decode.yaml --decode-slot 12 --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvbeam plan``."""
    parser.add_argument("--config", required=True, help="prefill side config (YAML)")
    parser.add_argument("--request-slot", type=int, required=True,
                        help="source request slot (req_pool_idx)")
    parser.add_argument("--seq-len", type=int, required=True, help="sequence length in tokens")
    parser.add_argument("--decode", help="decode side config (default: same as --config)")
    parser.add_argument("--decode-slot", type=int,
                        help="destination request slot (default: --request-slot)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--max-blocks", type=int, default=8,
                        help="blocks printed per buffer in the table "
                             "(default 8; --json prints all)")


def plan_to_dict(plan: TransferPlan, components: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON form of a plan."""
    return {
        "total_bytes": plan.total_bytes,
        "num_blocks": plan.num_blocks,
        "components": components,
        "buffers": [
            {
                "component": b.component,
                "buffer": b.buffer,
                "name": b.name,
                "items": b.items,
                "blocks": [[int(s), int(d), int(n)] for s, d, n in
                           zip(b.blocks.src, b.blocks.dst, b.blocks.lengths, strict=True)],
            }
            for b in plan.buffers
        ],
    }


def run(args: argparse.Namespace) -> int:
    """Check the configs as `kvbeam check` does, then plan and print."""
    decode_path = args.decode or args.config
    diffs = verify(args.config, decode_path)
    if diffs:
        return print_verdict(args.config, decode_path, diffs, as_json=args.json)
    src_cfg = load_side_config(args.config)
    dst_cfg = load_side_config(args.decode) if args.decode else src_cfg
    dst_slot = args.request_slot if args.decode_slot is None else args.decode_slot
    src, dst = build_side_layout(src_cfg), build_side_layout(dst_cfg)
    t0 = time.perf_counter()
    plan = build_plan(
        src, [0] * len(src.flat_buffers), request_indices(src_cfg.target, args.request_slot,
                                                          args.seq_len),
        dst, [0] * len(dst.flat_buffers), request_indices(dst_cfg.target, dst_slot, args.seq_len),
    )
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    components = [
        {"position": i, "name": c.name,
         "type": c.state_type.value if c.state_type else "KV", "buffers": len(c.buffers)}
        for i, c in enumerate(src.components)
    ]
    if args.json:
        json.dump(plan_to_dict(plan, components) | {"plan_ms": elapsed_ms}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    out = sys.stdout.write
    out(f"model {src_cfg.model}: slot {args.request_slot} -> slot {dst_slot}, "
        f"seq_len {args.seq_len}\n")
    out(f"state component types: {[t.value for t in src.state_types]}\n\n")
    out(f"{'pos':>3}  {'component':<20} {'type':<11} {'buffers':>7}\n")
    for c in components:
        out(f"{c['position']:>3}  {c['name']:<20} {c['type']:<11} {c['buffers']:>7}\n")
    out(f"\n{'buffer':<30} {'items':>6} {'blocks':>6} {'bytes':>10}  blocks (src, dst, len)\n")
    for b in plan.buffers:
        shown = [f"({int(s)}, {int(d)}, {int(n)})" for s, d, n in
                 zip(b.blocks.src[:args.max_blocks], b.blocks.dst[:args.max_blocks],
                     b.blocks.lengths[:args.max_blocks], strict=True)]
        more = f" ... +{len(b.blocks) - args.max_blocks}" if len(b.blocks) > args.max_blocks else ""
        out(f"{b.name:<30} {b.items:>6} {len(b.blocks):>6} {b.blocks.total_bytes:>10}  "
            f"{' '.join(shown)}{more}\n")
    out(f"\ntotal: {plan.total_bytes} bytes in {plan.num_blocks} blocks "
        f"(planned in {elapsed_ms:.2f} ms)\n")
    return 0
