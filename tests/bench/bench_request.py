"""Benchmark: whole DSV4 requests through the daemons over RDMA, beside ib_write_bw.

Run in the soft-RoCE guest (``make bench``) or on any host with an RDMA device.
Starts a prefill and a decode daemon (RDMA, integrity on: decode checks the
CRC32C of every moved buffer before Success), sends requests of several lengths
one at a time and reports the median Send-to-Success time and bytes/s, next to
``ib_write_bw`` at 64 KiB measured in the same run. Also prints the raw
transport time for the same bytes from the same boot's ``ib_write_bw`` figure.

The last line is machine-readable: ``ratio_vs_ib_write_bw=0.NN`` (32k-token
request bytes/s over ib_write_bw's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from kvbeam.client import KvbeamClient
from tests.bench.bench_transport import ib_write_bw
from tests.daemon_helpers import start_both


def main() -> None:
    """Run and print the table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lens", default="128,1024,8192,32768")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--paged", action="store_true")
    args = parser.parse_args()
    device = os.environ.get("KVBEAM_RDMA_DEVICE", "rxe0")
    gid = int(os.environ.get("KVBEAM_RDMA_GID_INDEX", "0"))
    ref_gbps = ib_write_bw(device, gid, 65536, 5, 18515)
    prefill, decode = start_both(paged=args.paged, transport="rdma")
    rows = []
    try:
        with KvbeamClient(prefill.address) as p, KvbeamClient(decode.address) as d:
            n = 0
            for seq_len in [int(x) for x in args.lens.split(",")]:
                times, nbytes = [], 0
                for _ in range(args.repeat + 1):  # the first is a warm-up
                    rid = f"bench-{n}"
                    n += 1
                    d.reserve(rid, seq_len, prefill.address)
                    t0 = time.perf_counter()
                    p.send(rid, n % 8, seq_len, decode.address)
                    st = d.wait(rid, 120)
                    dt = time.perf_counter() - t0
                    if str(st) != "Success":
                        raise SystemExit(f"request {rid} ended {st}")
                    d.release(rid)
                    nbytes = st.bytes_total
                    times.append(dt)
                med = statistics.median(times[1:])
                rows.append((seq_len, nbytes, med, min(times[1:])))
    finally:
        prefill.stop()
        decode.stop()
    ref_bps = ref_gbps * 1e9 / 8
    mode = "paged" if args.paged else "unified"
    print(f"\nwhole DSV4 requests ({mode}, integrity on) over {device}; ib_write_bw 64 KiB "
          f"in the same run: {ref_gbps:.3f} Gb/s")
    print(f"{'tokens':>7} {'bytes':>10} {'send->ok ms':>12} {'best ms':>8} {'Gb/s':>7} "
          f"{'ratio':>6} {'raw ms (ib_write_bw)':>21}")
    for seq_len, nbytes, med, best in rows:
        gbps = nbytes * 8 / med / 1e9
        raw_ms = nbytes / ref_bps * 1e3
        print(f"{seq_len:>7} {nbytes:>10} {med * 1e3:>12.1f} {best * 1e3:>8.1f} {gbps:>7.3f} "
              f"{gbps / ref_gbps:>6.2f} {raw_ms:>21.1f}")
    last = rows[-1]
    print(f"ratio_vs_ib_write_bw={last[1] * 8 / last[2] / 1e9 / ref_gbps:.2f}")


if __name__ == "__main__":
    main()
