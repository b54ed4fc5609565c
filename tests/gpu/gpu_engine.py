"""A prefill engine process for the GPU check's kill step: device KV, a staging buffer, attached.

Run as a fresh process (``python -m tests.gpu.gpu_engine --socket S --tokens N --device D``;
the GPU check sets PYTHONPATH when kvbeam is not installed). It allocates its KV on the
device (kvbeam's :class:`~kvbeam.pools.allocate.AllocatedSide` in the paged bench layout),
fills it with the pattern of ``--seed``, attaches a staging buffer for one request of
``--tokens`` to its daemon and prints one JSON line per event on stdout:

- ``{"attached": INSTANCE, "free": BYTES}`` (the device's free memory, CUDA only) or
  ``{"refused": MESSAGE}``;
- on the command ``stage`` (stdin): the request's blocks (a seeded permutation) gathered
  into the staging buffer, ``{"blocks": [...], "lists": {"KV_PAGES": [...]}, "bytes": N}``;
- on ``exit``: detaches, frees everything and exits.

The GPU check SIGKILLs it while the daemons move the staged request.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from kvbeam.engine.attach import attach
from kvbeam.engine.staging import StagingBuffer
from kvbeam.errors import AttachError
from kvbeam.pools.allocate import AllocatedSide
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.types import IndexKind
from tests.bench.bench_staging import bench_config


def request_blocks(tokens: int, items: int, seed: int) -> list[int]:
    """The request's device blocks: scattered (a seeded permutation of the pool's)."""
    n = -(-tokens // 16)
    return [int(b) for b in np.random.default_rng(seed).permutation(items)[:n]]


def _say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def main() -> int:
    """Serve the commands; exit status 0 after ``exit``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    config = bench_config(args.tokens)
    kv = AllocatedSide(build_side_layout(config), args.device)
    kv.fill_pattern(args.seed)
    staging = StagingBuffer(config, device=args.device, requests=1, tokens=args.tokens)
    try:
        attachment = attach(args.socket, staging.pools)
    except AttachError as exc:
        _say({"refused": str(exc)})
        return 1
    free = -1
    if staging.on_cuda:
        import torch

        free = int(torch.cuda.mem_get_info()[0])
    _say({"attached": attachment.instance_id, "free": free, "pinned": staging.pinned_bytes})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "stage":
            blocks = request_blocks(args.tokens, kv.layout.flat_buffers[0].items, args.seed)
            staged = staging.stage_out(kv, {IndexKind.KV_PAGES: blocks})
            assert staged.copy is not None
            staged.copy.wait()
            _say({"blocks": blocks, "lists": staged.named_lists(), "bytes": staged.nbytes})
        elif cmd == "exit":
            break
    attachment.close()
    staging.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
