"""A stand-in inference engine for the attach tests: its own memfd pools, attached to a daemon.

Run as a fresh process (``python -m tests.engine_peer --socket S --config C``). It
allocates the pools (``--layout kvbeam``: EnginePools, one memfd per allocation;
``packed``: the engine's own allocation, every buffer in ONE memfd in reverse order
with gaps, so the daemon must use the engine's offsets), fills them with the
pattern of ``--seed``, attaches, prints ``attached INSTANCE`` (or ``refused FIELD:
MESSAGE``) and then serves commands on stdin, one answer line each:

- ``digests SLOT SEQ_LEN``: CRC32C of each buffer's items of that request, in
  layout order (the items the slot-based index lists name), ``digests a,b,...``
- ``detach`` / ``attach``: detach, or attach the same memory again
- ``resize NBYTES``: ``ftruncate`` every fd of the pools to NBYTES (an engine shrinking
  or growing memory a daemon maps): ``resized``, or ``resize refused: ERRNO_NAME``
- ``punch``: punch a hole over every fd's whole size (``FALLOC_FL_PUNCH_HOLE``, which
  size seals do not block; the pages read back as zeros): ``punched``
- ``close-fds``: close every fd of the pools (keeping the engine's own mappings and the
  attachment): ``closed``
- ``exit``
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import sys
from typing import Any

import crc32c
import numpy as np
import yaml

from kvbeam.engine import AttachError, BufferRef, EngineBuffers, EnginePools, attach
from kvbeam.engine.attach import Attachment
from kvbeam.pools.indices import request_indices
from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.shm import create_memfd, map_shared
from kvbeam.pools.spec import SideConfig

PAGE = 4096
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def resize(fds: list[int], nbytes: int) -> str:
    """``ftruncate`` every fd to ``nbytes``; the answer line."""
    try:
        for fd in fds:
            os.ftruncate(fd, nbytes)
    except OSError as exc:
        return f"resize refused: {errno.errorcode.get(exc.errno or 0, str(exc.errno))}"
    return "resized"


def punch(fds: list[int]) -> str:
    """Punch a hole over every fd's whole size; the answer line."""
    for fd in fds:
        if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0,
                           os.fstat(fd).st_size) != 0:
            return f"punch failed: {errno.errorcode.get(ctypes.get_errno(), '?')}"
    return "punched"


class Packed:
    """Every buffer in one memfd, last buffer first, a page of gap between buffers."""

    def __init__(self, config: SideConfig) -> None:
        self.layout = build_side_layout(config)
        flat = self.layout.flat_buffers
        offsets: dict[int, int] = {}
        at = PAGE  # nothing at offset 0: offsets are the engine's, not kvbeam's
        for i in reversed(range(len(flat))):
            offsets[i] = at
            at += -(-flat[i].nbytes // PAGE) * PAGE + PAGE
        self.fd = create_memfd("packed", at)
        self.map = map_shared(self.fd, at)
        self.offsets = [offsets[i] for i in range(len(flat))]

    def arrays(self) -> list[np.ndarray[Any, Any]]:
        return [np.frombuffer(self.map, dtype=np.uint8, count=b.nbytes, offset=o)
                for b, o in zip(self.layout.flat_buffers, self.offsets, strict=True)]

    def buffers(self) -> EngineBuffers:
        refs = iter(BufferRef(0, o, b.nbytes, b.item_len)
                    for b, o in zip(self.layout.flat_buffers, self.offsets, strict=True))
        return EngineBuffers([self.fd], [[next(refs) for _ in c.buffers]
                                         for c in self.layout.components])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--layout", choices=("kvbeam", "packed"), default="kvbeam")
    ap.add_argument("--memory-kind", default="host_shm")
    args = ap.parse_args()
    with open(args.config) as f:
        config = SideConfig.from_mapping(yaml.safe_load(f), args.config)
    if args.layout == "packed":
        packed = Packed(config)
        arrays, buffers = packed.arrays(), packed.buffers()
    else:
        pools = EnginePools(config)
        arrays = [pools.buffer_array(b) for b in pools.layout.flat_buffers]
        buffers = pools.buffers()
    rng = np.random.default_rng(args.seed)
    for a in arrays:
        a[:] = rng.integers(0, 256, len(a), dtype=np.uint8)
    layout = build_side_layout(config)

    def do_attach() -> Attachment | None:
        try:
            att = attach(args.socket, buffers, config, memory_kind=args.memory_kind)
        except AttachError as exc:
            print(f"refused {exc.field}: {exc}", flush=True)
            return None
        print(f"attached {att.instance_id}", flush=True)
        return att

    att = do_attach()
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "digests":
            idx = request_indices(config.target, int(cmd[1]), int(cmd[2]))
            out = []
            for buf, arr in zip(layout.flat_buffers, arrays, strict=True):
                items = arr.reshape(buf.items, buf.item_len)
                take = np.take(items, np.asarray(idx[buf.index_kind]), axis=0)
                out.append(crc32c.crc32c(np.ascontiguousarray(take).data))
            print("digests " + ",".join(map(str, out)), flush=True)
        elif cmd[0] == "detach":
            if att is not None:
                att.detach()
            att = None
            print("detached", flush=True)
        elif cmd[0] == "attach":
            att = do_attach()
        elif cmd[0] == "resize":
            print(resize(buffers.fds, int(cmd[1])), flush=True)
        elif cmd[0] == "punch":
            print(punch(buffers.fds), flush=True)
        elif cmd[0] == "close-fds":
            for fd in buffers.fds:
                os.close(fd)
            buffers.fds.clear()
            print("closed", flush=True)
        elif cmd[0] == "exit":
            break
    if att is not None:
        att.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
