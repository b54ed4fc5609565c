"""Soak over RDMA: many concurrent requests for a bounded time, every one byte-verified.

Runs on the fault tests' daemon pair (two rxe devices joined by a veth wire, see
tests/rdma/netfaults.py). Workers drive requests end to end (Reserve, Send, wait for
decode's Success, Release) with seeded random lengths; decode reports Success only
after the WRITE WITH IMMEDIATE arrived and every moved buffer's XXH3-128 matched the
digests prefill computed over its fill pattern (``--fill-seed``), so every Success is a
byte-for-byte check. Prints requests/s, p50/p99 Send-to-Success latency and both
daemons' resident memory (VmRSS) before and after, and asserts the growth stays within
:data:`RSS_GROWTH_KIB`.

Knobs (environment): ``KVBEAM_SOAK_S`` seconds of load (default 120),
``KVBEAM_SOAK_CONCURRENCY`` requests in flight (default 8),
``KVBEAM_SOAK_MAX_TOKENS`` longest request (default 8192, about 2.8 MB: decode cannot see
RDMA writes land, so its Transferring deadline, 10 s in the guest, must cover a whole
request's bytes behind the other requests on the wire; 32k-token requests, 8 at a time,
at the guest's ~6 MB/s exceeded it).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvbeam.client import KvbeamClient
from kvbeam.scheduler import RequestResult, run_request
from tests.daemon_helpers import DECODE_SLOTS, free_slots, rss_kib
from tests.rdma.conftest import WirePair
from tests.waiting import wait_until

pytestmark = pytest.mark.rdma

SOAK_S = float(os.environ.get("KVBEAM_SOAK_S", "120"))
CONCURRENCY = int(os.environ.get("KVBEAM_SOAK_CONCURRENCY", "8"))
MAX_TOKENS = int(os.environ.get("KVBEAM_SOAK_MAX_TOKENS", "8192"))
#: Allowed VmRSS growth per daemon across the soak, KiB. Measured after a warm-up (the
#: first requests grow gRPC's and glibc's pools and the torch allocator), so what is left
#: is per-request state that is never freed; 48 MiB is far below what a leak of request
#: books (index arrays, statuses, plans) over hundreds of requests would show, and well
#: above allocator noise measured in the guest.
RSS_GROWTH_KIB = 48 * 1024
WARMUP = 16
SOURCE_SLOTS = 8  # prefill's num_req_slots


@pytest.mark.timeout(SOAK_S + 1800)  # its own length over pyproject's default limit
def test_soak(wire_pair: WirePair) -> None:
    pair = wire_pair
    pids = {"prefill": pair.prefill.proc.pid, "decode": pair.decode.proc.pid}
    with KvbeamClient(pair.prefill.address) as p, KvbeamClient(pair.decode.address) as d:
        warm = [run_request(p, d, f"soak-warm-{i}", 1 + i * 500, i % SOURCE_SLOTS,
                            timeout=120) for i in range(WARMUP)]
        assert all(r.ok for r in warm), [r for r in warm if not r.ok]
        before = {role: rss_kib(pid) for role, pid in pids.items()}

        results: list[RequestResult] = []
        lock = threading.Lock()
        end = time.monotonic() + SOAK_S

        def worker(w: int) -> None:
            rng = random.Random(f"soak-{w}")
            i = 0
            while time.monotonic() < end:
                r = run_request(p, d, f"soak-{w}-{i}", rng.randint(1, MAX_TOKENS),
                                (w + i) % SOURCE_SLOTS, timeout=120)
                with lock:
                    results.append(r)
                i += 1

        t0 = time.monotonic()
        threads = [threading.Thread(target=worker, args=(w,), name=f"soak-{w}")
                   for w in range(CONCURRENCY)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(SOAK_S + 300)
        elapsed = time.monotonic() - t0
        # Everything released: the slots are free again before memory is measured.
        assert wait_until(lambda: free_slots(d) == DECODE_SLOTS, 60)
    after = {role: rss_kib(pid) for role, pid in pids.items()}

    bad = [r for r in results if not r.ok]
    lat = np.array([r.send_to_success_s for r in results if r.ok]) * 1e3
    total_bytes = sum(r.bytes for r in results if r.ok)
    summary = {
        "seconds": round(elapsed, 1), "concurrency": CONCURRENCY, "requests": len(results),
        "failed": len(bad), "requests_per_s": round(len(results) / elapsed, 2),
        "MB_per_s": round(total_bytes / elapsed / 1e6, 2),
        "send_to_success_ms_p50": round(float(np.percentile(lat, 50)), 1) if len(lat) else None,
        "send_to_success_ms_p99": round(float(np.percentile(lat, 99)), 1) if len(lat) else None,
        "rss_kib_before": before, "rss_kib_after": after,
        "rss_growth_kib": {k: after[k] - before[k] for k in pids},
        "rss_growth_bound_kib": RSS_GROWTH_KIB,
    }
    print("SOAK " + json.dumps(summary))
    results_dir = os.environ.get("KVBEAM_RESULTS_DIR")
    if results_dir:
        Path(results_dir, "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
    assert results and not bad, bad[:5]
    assert "XXH3-128 mismatch" not in pair.decode.output
    for role in pids:
        assert after[role] - before[role] <= RSS_GROWTH_KIB, summary
