"""``python -m kvbeam.refengine``: colocated vs prefill -> copy -> decode, side by side.

Prints the token table for a config (a side config YAML, or the built-in tiny one)
and, with ``--sensitivity``, the effect of leaving out or shifting each component.
"""

from __future__ import annotations

import argparse

import torch

from kvbeam.pools.spec import load_side_config
from kvbeam.refengine.configs import tiny_config
from kvbeam.refengine.faults import format_effects, sensitivity
from kvbeam.refengine.run import SplitRun, compare, make_prompt


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; exit status 0 when the continuations are identical."""
    ap = argparse.ArgumentParser(prog="python -m kvbeam.refengine", description=__doc__)
    ap.add_argument("--config", help="side config YAML (default: the built-in tiny config)")
    ap.add_argument("--paged", action="store_true", help="tiny config: paged SWA mode")
    ap.add_argument("--no-draft", action="store_true", help="tiny config: no NextN draft")
    ap.add_argument("--length", type=int, default=250, help="prompt tokens")
    ap.add_argument("-k", type=int, default=12, help="continued tokens")
    ap.add_argument("--seed", type=int, default=0, help="weights seed")
    ap.add_argument("--device", default="cpu",
                    help="where both engines compute and keep their KV (cpu, cuda)")
    ap.add_argument("--sensitivity", action="store_true",
                    help="also leave out / shift each component and show what changes")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = (load_side_config(args.config) if args.config
           else tiny_config(unified=not args.paged, draft=not args.no_draft))
    prompt = make_prompt(args.length, 512)
    result = compare(cfg, prompt, args.k, seed=args.seed, device=args.device)
    print(f"config {cfg.source}, device {args.device}")
    print(result.table())
    if args.sensitivity:
        split = SplitRun(cfg, prompt, seed=args.seed, device=args.device)
        print(format_effects(sensitivity(split, args.k), args.k))
    return 0 if result.equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
