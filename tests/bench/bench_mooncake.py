"""Benchmark peer: Mooncake Transfer Engine's RDMA transport on the same device and buffers.

Mooncake TE is the C++ engine sglang and vLLM use; it is installed only for the
benchmark (``pip install '.[bench]'``: ``mooncake-transfer-engine-non-cuda``).
The target is a child process (``--serve``) that registers a buffer and answers
``crc``/``zero``/``exit`` on stdin; the initiator in this process writes its
source buffer into it as blocks of one size, all blocks of the buffer in one
``batch_transfer_sync_write`` call, for a fixed time. The target's buffer is
CRC-checked against the source after each run.

``--request``: a whole request instead: the blocks kvbeam's planner makes for a
request of each length (:mod:`tests.bench.request_blocks`: the same bytes, block
boundaries and sizes as the request benchmark's), all in one
``batch_transfer_sync_write`` per request, each call timed on its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbeam.transport.blocks import Blocks
from tests.transport_peer import buffer_address


@dataclass
class MooncakeRun:
    """One timed run: Gb/s, block writes per second, and whether the bytes arrived intact."""

    gbps: float
    blocks_per_s: float
    crc_ok: bool


def _engine(device: str, protocol: str = "rdma") -> Any:
    from mooncake.engine import TransferEngine  # optional: the bench extra

    te = TransferEngine()
    # P2PHANDSHAKE: no metadata server; the segment name is host:rpc_port.
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize failed ({rc})")
    return te


def serve(device: str, nbytes: int, protocol: str = "rdma") -> None:
    """Target side: register a zeroed buffer, print 'READY port addr', answer commands."""
    te = _engine(device, protocol)
    buf = mmap.mmap(-1, nbytes)
    addr = buffer_address(buf)
    if te.register_memory(addr, nbytes) != 0:
        raise RuntimeError("Mooncake register_memory failed on the target")
    print(f"READY {te.get_rpc_port()} {addr}", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "crc":
            print(zlib.crc32(buf), flush=True)
        elif cmd == "zero":
            buf.seek(0)
            buf.write(bytes(nbytes))
            print("ok", flush=True)
        elif cmd == "exit":
            break
    te.unregister_memory(addr)


class MooncakePeer:
    """Initiator in this process, target in a child; the same buffer size as kvbeam's runs
    unless ``target_nbytes`` says otherwise (a request's destination region)."""

    def __init__(self, device: str, src: mmap.mmap, target_nbytes: int | None = None,
                 protocol: str = "rdma") -> None:
        self.src = src
        self.nbytes = len(src)
        self.target_nbytes = target_nbytes or self.nbytes
        self.child = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.bench_mooncake", "--serve", "--device", device,
             "--nbytes", str(self.target_nbytes), "--protocol", protocol],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._line(lambda w: w[:1] == ["READY"]).split()
        self.segment = f"127.0.0.1:{ready[1]}"
        self.dst = int(ready[2])
        self.te = _engine(device, protocol)
        self.expected: bytearray | None = None  # run_blocks: what the target should hold
        self.src_addr = buffer_address(src)
        if self.te.register_memory(self.src_addr, self.nbytes) != 0:
            raise RuntimeError("Mooncake register_memory failed on the initiator")

    def _line(self, wanted: Callable[[list[str]], bool]) -> str:
        """The child's next answer; anything else it prints (its own logs) is skipped."""
        assert self.child.stdout is not None
        while True:
            line = self.child.stdout.readline()
            if not line:
                raise RuntimeError("Mooncake target exited")
            if wanted(line.split()):
                return line

    def _ask(self, cmd: str) -> str:
        assert self.child.stdin is not None
        self.child.stdin.write(cmd + "\n")
        self.child.stdin.flush()
        return self._line(lambda w: len(w) == 1 and (w[0] == "ok" or w[0].isdigit())).strip()

    def run(self, size: int, seconds: float) -> MooncakeRun:
        """Write the whole buffer as ``size`` blocks per call, repeatedly, for ``seconds``."""
        self._ask("zero")
        n = self.nbytes // size
        srcs = [self.src_addr + i * size for i in range(n)]
        dsts = [self.dst + i * size for i in range(n)]
        lens = [size] * n
        calls = 0
        start = time.perf_counter()
        while True:
            rc = self.te.batch_transfer_sync_write(self.segment, srcs, dsts, lens)
            if rc != 0:
                raise RuntimeError(f"Mooncake batch_transfer_sync_write returned {rc}")
            calls += 1
            if time.perf_counter() - start >= seconds:
                break
        elapsed = time.perf_counter() - start
        crc_ok = int(self._ask("crc")) == zlib.crc32(self.src)
        return MooncakeRun(calls * self.nbytes * 8 / elapsed / 1e9, calls * n / elapsed, crc_ok)

    def run_blocks(self, blocks: Blocks, repeat: int) -> dict[str, Any]:
        """``blocks`` (offsets into source and target) in one batch call, ``repeat`` times
        after a warm-up, each call timed. The target is not zeroed between calls: what it
        should hold is kept in :attr:`expected` (the source's blocks laid over zeros, in
        order) for one :meth:`check` at the end (a CRC of 165 MiB per case costs seconds
        under TCG)."""
        from statistics import median

        if self.expected is None:
            self._ask("zero")
            self.expected = bytearray(self.target_nbytes)
        srcs = [self.src_addr + int(x) for x in blocks.src]
        dsts = [self.dst + int(x) for x in blocks.dst]
        lens = [int(x) for x in blocks.lengths]
        runs_ms = []
        for _ in range(repeat + 1):
            start = time.perf_counter()
            rc = self.te.batch_transfer_sync_write(self.segment, srcs, dsts, lens)
            runs_ms.append((time.perf_counter() - start) * 1e3)
            if rc != 0:
                raise RuntimeError(f"Mooncake batch_transfer_sync_write returned {rc}")
        for s, d, n in zip(blocks.src.tolist(), blocks.dst.tolist(), blocks.lengths.tolist(),
                           strict=True):
            self.expected[d:d + n] = self.src[s:s + n]
        return {"runs_ms": runs_ms[1:], "median_ms": median(runs_ms[1:]), "blocks": len(blocks),
                "bytes": blocks.total_bytes}

    def check(self) -> bool:
        """Whether the target holds exactly what the :meth:`run_blocks` calls wrote."""
        return self.expected is not None and int(self._ask("crc")) == zlib.crc32(self.expected)

    def close(self) -> None:
        """Stop the target."""
        with contextlib.suppress(OSError, RuntimeError):
            self._ask("exit")
        try:
            self.child.wait(10)
        except subprocess.TimeoutExpired:
            self.child.kill()
        self.te.unregister_memory(self.src_addr)


def measure(device: str, sizes: list[int], seconds: float, repeat: int) -> dict[str, Any]:
    """Per size: Gb/s of each run, median, blocks/s, CRC check (source: the suite's bytes)."""
    from statistics import median

    import numpy as np

    src = mmap.mmap(-1, 64 << 20)
    # The same 64 MiB of random bytes as the kvbeam runs (same generator and seed).
    src.write(np.random.default_rng(7).integers(0, 256, len(src), dtype=np.uint8).tobytes())
    peer = MooncakePeer(device, src)
    out: dict[str, Any] = {}
    try:
        for size in sizes:
            runs = [peer.run(size, seconds) for _ in range(repeat)]
            out[str(size)] = {"runs_gbps": [r.gbps for r in runs],
                              "gbps": median(r.gbps for r in runs),
                              "blocks_per_s": median(r.blocks_per_s for r in runs),
                              "crc_ok": all(r.crc_ok for r in runs)}
            print(f"mooncake {size} B: {out[str(size)]}", file=sys.stderr, flush=True)
    finally:
        peer.close()
    return out


def measure_requests(device: str, lens: list[int], styles: list[str], repeat: int,
                     protocol: str = "rdma") -> dict[str, Any]:
    """Per list style and request length: the request's blocks in one batch call
    (:meth:`MooncakePeer.run_blocks`); source and target are the planner's regions."""
    import numpy as np

    from tests.bench.request_blocks import region_sizes, request_blocks, request_case

    src_bytes, dst_bytes = region_sizes()
    src = mmap.mmap(-1, src_bytes)
    src.write(np.random.default_rng(7).integers(0, 256, src_bytes, dtype=np.uint8).tobytes())
    peer = MooncakePeer(device, src, dst_bytes, protocol)
    out: dict[str, Any] = {}
    try:
        for style in styles:
            for tokens in lens:
                row = peer.run_blocks(request_blocks(request_case(tokens, style)), repeat)
                out.setdefault(style, {})[str(tokens)] = row
                print(f"mooncake request {style} {tokens}: {row}", file=sys.stderr, flush=True)
        crc_ok = peer.check()
    finally:
        peer.close()
    for per_len in out.values():  # one check covers every case's blocks
        for row in per_len.values():
            row["crc_ok"] = crc_ok
    return out


def main() -> None:
    """``--serve``: the target (used by :class:`MooncakePeer`); ``--measure``: JSON results."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--serve", action="store_true")
    p.add_argument("--measure", metavar="SIZES", help="comma-separated block sizes in bytes")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="rxe0")
    p.add_argument("--nbytes", type=int, default=64 << 20)
    p.add_argument("--request", metavar="LENS",
                   help="comma-separated request lengths in tokens: whole requests' blocks")
    p.add_argument("--styles", default="slot", help="index-list styles for --request")
    p.add_argument("--protocol", default="rdma", help="rdma, or tcp (a smoke test off RDMA)")
    args = p.parse_args()
    if args.serve:
        serve(args.device, args.nbytes, args.protocol)
    elif args.request:
        res = measure_requests(args.device, [int(x) for x in args.request.split(",")],
                               args.styles.split(","), args.repeat, args.protocol)
        print("RESULT " + json.dumps(res), flush=True)
    elif args.measure:
        res = measure(args.device, [int(x) for x in args.measure.split(",")], args.seconds,
                      args.repeat)
        print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
