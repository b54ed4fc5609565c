"""Benchmark: what a handshake costs on the data plane as decode's pool grows (RDMA).

Each handshake creates one link per side and connects both: on decode that is the
link's memory windows (allocated, then bound when it connects) over the pool's one
registration, so its cost should not grow with the pool. Before memory windows, each
handshake registered the whole pool again; that cost is measured beside it (one more
registration of the same, already resident, memory), with the pool's first
registration (at start-up or attach). The gRPC part of a handshake does not depend on
the pool (``bench_handshake.py``).

Run in the guest: ``tests/softroce/run_rdma_suite.sh --cmd 'python -m tests.bench.bench_keys'``;
``make bench`` runs it as the ``handshake_pool`` section of ``bench_suite``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from statistics import median
from typing import Any

from kvbeam.transport import Access, Region
from kvbeam.transport.options import TransportOptions
from kvbeam.transport.verbs import VerbsTransport
from tests.transport_peer import buffer_address

#: Pool sizes (MiB): a small one and the largest the 3 GB guest holds beside the rest.
POOLS_MIB = (64, 1024)
#: Regions per pool (one per layer and kind in a real pool; each link gets one window each).
REGIONS = 64
HANDSHAKES = 5


def _handshake(prefill: VerbsTransport, decode: VerbsTransport
               ) -> tuple[float, float, Any, Any]:
    """Both links created and connected as in a handshake; (seconds in all, of them
    creating decode's link, the links)."""
    start = time.perf_counter()
    ld = decode.create_link()
    created = time.perf_counter()
    lp = prefill.create_link()
    ld.connect(lp.endpoint)
    lp.connect(ld.endpoint)
    return time.perf_counter() - start, created - start, lp, ld


def pool_case(device: str, gid_index: int, mib: int, handshakes: int = HANDSHAKES
              ) -> dict[str, Any]:
    """One pool size: first registration, per-handshake time, one re-registration."""
    size = mib << 20
    options = TransportOptions(op_timeout_s=60.0)
    pool = mmap.mmap(-1, size)
    src = mmap.mmap(-1, 1 << 20)
    try:
        addr, step = buffer_address(pool), size // REGIONS
        regions = [Region(addr + i * step, step) for i in range(REGIONS)]
        with VerbsTransport(device, gid_index, options) as p, \
                VerbsTransport(device, gid_index, options) as d:
            assert isinstance(p, VerbsTransport) and isinstance(d, VerbsTransport)
            p.register([Region(buffer_address(src), 1 << 20)], Access.LOCAL)
            start = time.perf_counter()
            d.register(regions, Access.REMOTE_WRITE)
            first = time.perf_counter() - start
            times, creates = [], []
            for i in range(handshakes + 1):  # the first is a warm-up, not counted
                seconds, create, lp, ld = _handshake(p, d)
                if i:
                    times.append(seconds)
                    creates.append(create)
                lp.release()
                ld.release()
            start = time.perf_counter()  # what every handshake did before memory windows
            mrs = [d.device.register(r.addr, r.length, Access.REMOTE_WRITE) for r in regions]
            again = time.perf_counter() - start
            for mr in mrs:
                mr.close()
    finally:
        pool.close()
        src.close()
    return {"pool_mib": mib, "regions": REGIONS, "first_registration_s": first,
            "handshake_ms": [t * 1e3 for t in times],
            "handshake_median_ms": median(times) * 1e3,
            "decode_create_link_median_ms": median(creates) * 1e3, "reregistration_s": again}


def handshake_pools(device: str, gid_index: int, pools_mib: tuple[int, ...] = POOLS_MIB
                    ) -> dict[str, Any]:
    """Every pool size of :data:`POOLS_MIB`, keyed by its size in MiB."""
    return {str(mib): pool_case(device, gid_index, mib) for mib in pools_mib}


def print_table(out: dict[str, Any]) -> None:
    """The section's lines, as ``make bench`` prints them."""
    print(f"\n== handshake on the data plane vs decode pool size ({REGIONS} regions; "
          f"median of {HANDSHAKES} after a warm-up; decode link = its create_link)")
    print(f"{'pool MiB':>9} {'handshake ms':>12} {'min-max ms':>13} {'decode link ms':>14} "
          f"{'first reg s':>11} {'re-reg s':>8}")
    for row in out.values():
        if "error" in row:
            print(f"handshake_pool: FAILED: {row['error']}")
            continue
        runs = row["handshake_ms"]
        print(f"{row['pool_mib']:>9} {row['handshake_median_ms']:>12.1f} "
              f"{min(runs):>6.0f}-{max(runs):<6.0f} "
              f"{row.get('decode_create_link_median_ms', float('nan')):>14.1f} "
              f"{row['first_registration_s']:>11.2f} {row['reregistration_s']:>8.2f}")
    print("(re-reg s: the same memory registered once more, as every handshake did before "
          "memory windows)")


def main() -> None:
    """Run every pool size and print the table."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=os.environ.get("KVBEAM_RDMA_DEVICE", "rxe0"))
    p.add_argument("--gid-index", type=int,
                   default=int(os.environ.get("KVBEAM_RDMA_GID_INDEX", "0")))
    p.add_argument("--pools-mib", default=",".join(map(str, POOLS_MIB)))
    args = p.parse_args()
    sizes = tuple(int(x) for x in args.pools_mib.split(","))
    print_table(handshake_pools(args.device, args.gid_index, sizes))


if __name__ == "__main__":
    main()
