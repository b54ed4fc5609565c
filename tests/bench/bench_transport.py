"""Benchmark: raw block writes through kvbeam's verbs transport next to ib_write_bw.

Run where an RDMA device exists (here: inside the soft-RoCE guest)::

    tests/softroce/run_rdma_suite.sh --cmd 'python tests/bench/bench_transport.py --repeat 3'

For each block size it measures, in this one run: ``ib_write_bw -d DEV -x GID -F
--report_gbits -s SIZE -D SECONDS`` (server and client on the same device), then
kvbeam writing whole batches of SIZE blocks (64 MiB per transfer) from this
process into a spawned receiver process, keeping two transfers in flight, for
the same duration (ib_write_bw gets at least 10 s where its 128-deep queue holds
over 32 MiB, e.g. 1 MiB messages: under TCG a 3 s run measured nothing);
``--qps N`` gives the link N RC QPs on both ends (requests striped over them);
``--repeat`` alternates the two that many times and reports
medians. It prints bytes/s, WRs posted/s, Python CPU time per block (write():
checks, keys and WR arrays; plus the progress thread's bookkeeping) and wall
time inside ibv_post_send per block (where rxe does its sending), and the ratio
to ib_write_bw. The receiver's buffer is CRC-checked after each size.
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from statistics import median
from typing import Any

import numpy as np

from kvbeam.transport.base import Access, EventKind
from kvbeam.transport.blocks import Blocks
from kvbeam.transport.endpoint import Region
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.verbs import VerbsTransport
from kvbeam.transport.verbs.link import VerbsLink
from tests.transport_peer import PeerConfig, PeerProcess, buffer_address

BUFFER = 64 << 20


@dataclass
class Row:
    """One block size's figures."""

    size: int
    ref_gbps: float
    gbps: float
    wrs_per_s: float
    py_us_per_block: float
    post_us_per_block: float
    crc_ok: bool


def parse_size(text: str) -> int:
    """4K / 64K / 1M / 4096 to bytes."""
    m = re.fullmatch(r"(\d+)([KkMm]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20}[m.group(2).lower()]


def ref_seconds(size: int, seconds: int) -> int:
    """ib_write_bw's -D for a size: at least 10 s once its 128-deep send queue holds more
    than 32 MiB, which under TCG takes seconds to drain (a 3 s run of 1 MiB messages
    measured nothing or a fraction of a window)."""
    return seconds if size * 128 <= 32 << 20 else max(seconds, 10)


def ib_write_bw(device: str, gid_index: int, size: int, seconds: int, port: int) -> float:
    """Average Gb/s of ib_write_bw with server and client on ``device``; one retry with
    -D 10 if a run completed nothing."""
    gbps = _ib_write_bw(device, gid_index, size, seconds, port)
    if gbps == 0.0 and seconds < 10:
        print(f"ib_write_bw -s {size} -D {seconds} completed nothing; rerunning with -D 10",
              file=sys.stderr)
        gbps = _ib_write_bw(device, gid_index, size, 10, port)
    return gbps


def _ib_write_bw(device: str, gid_index: int, size: int, seconds: int, port: int) -> float:
    args = ["ib_write_bw", "-d", device, "-x", str(gid_index), "-F", "--report_gbits",
            "-s", str(size), "-D", str(seconds), "-p", str(port)]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)  # let the server listen (ib_write_bw has no readiness signal)
    client = subprocess.run([*args, "127.0.0.1"], capture_output=True, text=True,
                            timeout=seconds * 10 + 60)
    server.wait(timeout=seconds * 10 + 60)
    for line in client.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[0] == str(size) and fields[1].isdigit():
            return float(fields[3])
    raise RuntimeError(f"ib_write_bw printed no result:\n{client.stdout}\n{client.stderr}")


@contextmanager
def sender_and_receiver(device: str, gid_index: int, options: TransportOptions, src: mmap.mmap
                        ) -> Iterator[tuple[VerbsTransport, VerbsLink, PeerProcess]]:
    """A sender transport with ``src`` registered, linked to a receiver process holding a
    BUFFER-byte remote-write region; both closed afterwards."""
    peer = PeerProcess(PeerConfig("rdma", BUFFER, Access.REMOTE_WRITE, device=device,
                                  gid_index=gid_index, options=options))
    transport = VerbsTransport(device, gid_index, options)
    try:
        transport.register([Region(buffer_address(src), BUFFER)], Access.LOCAL)
        link = transport.create_link()
        peer.connect(link.endpoint)
        link.connect(peer.endpoint)
        yield transport, link, peer
    finally:
        transport.close()
        peer.close()


def run_kvbeam(transport: VerbsTransport, link: VerbsLink, peer: PeerProcess, src: mmap.mmap,
               size: int, seconds: float) -> tuple[float, float, float, float, bool]:
    """Write BUFFER bytes as SIZE blocks repeatedly for ``seconds``; two transfers in flight."""
    n = BUFFER // size
    src_addr = buffer_address(src)
    offsets = np.arange(n, dtype=np.uint64) * np.uint64(size)
    blocks = Blocks(np.uint64(src_addr) + offsets, np.uint64(peer.addr) + offsets,
                    np.full(n, size, dtype=np.uint64))
    transport.events(0)
    before = (link.stats.wrs, link.stats.prepare_s, link.stats.book_s, link.stats.post_s)
    done = sent = 0
    start = time.perf_counter()
    while True:
        while sent - done < 2 and time.perf_counter() - start < seconds:
            link.write(sent & 0xFFFF_FFFF, blocks, notify=True)
            sent += 1
        if done == sent:
            break
        for event in transport.events(30.0):
            if event.kind is EventKind.COMPLETED:
                if not event.ok:
                    raise RuntimeError(f"transfer failed: {event}")
                done += 1
    elapsed = time.perf_counter() - start
    total_blocks = done * n
    wrs = link.stats.wrs - before[0]
    py_s = (link.stats.prepare_s - before[1]) + (link.stats.book_s - before[2])
    post_s = link.stats.post_s - before[3]
    peer.events(done, 60.0)  # drain the receiver's notifications
    crc_ok = peer.call("crc", 0, BUFFER) == zlib.crc32(src)
    return (done * BUFFER * 8 / elapsed / 1e9, wrs / elapsed, py_s / total_blocks * 1e6,
            post_s / total_blocks * 1e6, crc_ok)


#: The posters make bench compares (TransportOptions.poster), in the order it runs them.
POSTERS = ("compiled", "pyverbs")


def poster_rates(device: str, gid_index: int, src: mmap.mmap, size: int, seconds: float,
                 repeat: int) -> dict[str, Any]:
    """Each poster moving the same BUFFER of ``size`` blocks for ``seconds``, ``repeat`` times.

    Per poster (medians): posts/s and WRs/s over the run (bounded by the wire as well),
    the time inside ``Poster.post`` per post and per WR, and posts/s of that time alone
    (what one core could post), with the receiver's CRC after each run.
    """
    out: dict[str, Any] = {"block": size}
    for kind in POSTERS:
        options = TransportOptions(op_timeout_s=60.0, poster=kind)
        runs = []
        with sender_and_receiver(device, gid_index, options, src) as (transport, link, peer):
            assert transport.poster == kind, f"asked for the {kind} poster, got {transport.poster}"
            for _ in range(repeat):
                peer.call("fill", 0, b"\0" * BUFFER)
                posts, post_s = link.stats.posts, link.stats.post_s
                start = time.perf_counter()
                _, wrs_per_s, _, _, crc_ok = run_kvbeam(transport, link, peer, src, size, seconds)
                elapsed = time.perf_counter() - start
                posts, post_s = link.stats.posts - posts, link.stats.post_s - post_s
                runs.append({"posts_per_s": posts / elapsed, "wrs_per_s": wrs_per_s,
                             "us_per_post": post_s / posts * 1e6,
                             "us_per_wr": post_s / (wrs_per_s * elapsed) * 1e6,
                             "post_capacity_per_s": posts / post_s, "crc_ok": crc_ok})
        out[kind] = {k: (all(r[k] for r in runs) if k == "crc_ok" else median(r[k] for r in runs))
                     for k in runs[0]}
    return out


def print_poster_rates(rates: dict[str, Any]) -> None:
    """The posters' table (``make bench``'s "WR posting" lines)."""
    print(f"\n== WR posting, {int(rates['block']) >> 10} KiB blocks, same boot (posts/s and "
          "WRs/s over the run; us inside post_send per post and per WR; posts/s of that time)")
    print(f"{'poster':>9} {'posts/s':>9} {'WRs/s':>10} {'us/post':>9} {'us/WR':>7} "
          f"{'posts/s cpu':>12} {'crc':>4}")
    for kind in POSTERS:
        r = rates.get(kind)
        if isinstance(r, dict):
            print(f"{kind:>9} {r['posts_per_s']:>9.0f} {r['wrs_per_s']:>10.0f} "
                  f"{r['us_per_post']:>9.1f} {r['us_per_wr']:>7.2f} "
                  f"{r['post_capacity_per_s']:>12.0f} {'ok' if r['crc_ok'] else 'BAD':>4}")
    c, o = rates.get("compiled"), rates.get("pyverbs")
    if isinstance(c, dict) and isinstance(o, dict) and c["us_per_post"]:
        print(f"compiled / pyverbs: {o['us_per_post'] / c['us_per_post']:.1f}x less time per "
              f"post, {c['wrs_per_s'] / o['wrs_per_s']:.2f}x the WRs/s")


def main() -> None:
    """Parse arguments, measure, print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=os.environ.get("KVBEAM_RDMA_DEVICE", "rxe0"))
    p.add_argument("--gid-index", type=int,
                   default=int(os.environ.get("KVBEAM_RDMA_GID_INDEX", "0")))
    p.add_argument("--sizes", default="4K,64K,1M")
    p.add_argument("--seconds", type=int, default=3)
    p.add_argument("--port", type=int, default=18515, help="ib_write_bw's TCP port")
    p.add_argument("--posting", choices=["compiled", "pyverbs"], default="compiled",
                   help="compiled: the C helper builds each chain from the WR descriptors; "
                   "pyverbs: one pyverbs SendWR per WR")
    p.add_argument("--signal-every", type=int, default=TransportOptions.signal_every)
    p.add_argument("--sq-depth", type=int, default=TransportOptions.sq_depth)
    p.add_argument("--max-chain", type=int, default=TransportOptions.max_chain)
    p.add_argument("--qps", type=int, default=TransportOptions.qps_per_peer,
                   help="RC QPs per link (qps_per_peer) on both ends; requests are striped")
    p.add_argument("--repeat", type=int, default=1, help="alternate reference and kvbeam N times")
    p.add_argument("--no-reference", action="store_true", help="skip ib_write_bw")
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    options = TransportOptions(signal_every=args.signal_every, sq_depth=args.sq_depth,
                               max_chain=args.max_chain, op_timeout_s=60.0,
                               qps_per_peer=args.qps, poster=args.posting)

    src = mmap.mmap(-1, BUFFER)
    src.write(np.random.default_rng(7).integers(0, 256, BUFFER, dtype=np.uint8).tobytes())
    rows = []
    with sender_and_receiver(args.device, args.gid_index, options, src) as (transport, link,
                                                                           peer):
        for size in sizes:
            runs = []
            for _ in range(args.repeat):
                ref = (0.0 if args.no_reference else
                       ib_write_bw(args.device, args.gid_index, size,
                                   ref_seconds(size, args.seconds), args.port))
                peer.call("fill", 0, b"\0" * BUFFER)
                runs.append(Row(size, ref, *run_kvbeam(transport, link, peer, src, size,
                                                       args.seconds)))
                print(f"  {size:>8} B: ib_write_bw {ref:.3f} Gb/s, kvbeam {runs[-1].gbps:.3f} "
                      "Gb/s", file=sys.stderr, flush=True)
            rows.append(Row(size, median([r.ref_gbps for r in runs]),
                            median([r.gbps for r in runs]), median([r.wrs_per_s for r in runs]),
                            median([r.py_us_per_block for r in runs]),
                            median([r.post_us_per_block for r in runs]),
                            all(r.crc_ok for r in runs)))

    print(f"\nkvbeam verbs transport vs ib_write_bw on {args.device} (gid {args.gid_index}), "
          f"{args.seconds} s each, median of {args.repeat}, {args.posting} posting, signal every "
          f"{args.signal_every}, SQ {args.sq_depth}, chain {args.max_chain}, {args.qps} QP(s)")
    print(f"{'block':>8} {'ib_write_bw':>12} {'(-D)':>4} {'kvbeam':>10} {'ratio':>6} "
          f"{'WRs/s':>10} {'py us/blk':>10} {'post us/blk':>12} {'crc':>4}")
    for r in rows:
        ratio = r.gbps / r.ref_gbps if r.ref_gbps else float("nan")
        print(f"{r.size:>8} {r.ref_gbps:>7.3f} Gb/s {ref_seconds(r.size, args.seconds):>4} "
              f"{r.gbps:>5.3f} Gb/s {ratio:>6.2f} {r.wrs_per_s:>10.0f} "
              f"{r.py_us_per_block:>10.2f} {r.post_us_per_block:>12.2f} "
              f"{'ok' if r.crc_ok else 'BAD':>4}")
    if not all(r.crc_ok for r in rows):
        sys.exit("CRC mismatch: the receiver's buffer differs from the source")


if __name__ == "__main__":
    main()
