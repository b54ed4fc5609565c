"""4 prefill x 4 decode daemons on one soft-RoCE device: every prefill talks to every decode,
one handshake and one QP per pair, reused; QPs (per device) and MRs (per daemon, from
``rdma resource``) grow with peers, not with requests; aggregate bytes/s next to
ib_write_bw in the same boot.

All eight daemons start at once (under TCG each start-up costs about a minute)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from kvbeam.procs import DaemonProcess
from tests.bench.bench_transport import ib_write_bw
from tests.control_helpers import free_port
from tests.fleet_helpers import assert_per_peer_not_per_request, every_pair, fleet, table
from tests.rdma.conftest import RdmaDevice

pytestmark = pytest.mark.rdma

N = M = 4
#: Eight daemons starting at once on the guest's two vCPUs: with ``import torch`` in each
#: (about a minute alone under TCG) the first one was not ready after 300 s.
STARTUP_ALL_S = 1200.0


def rdma_objects(kind: str) -> dict[int, int]:
    """How many ``kind`` objects (qp, mr) each process holds, from ``rdma resource show``."""
    out = subprocess.run(["rdma", "resource", "show", kind], capture_output=True, text=True,
                         check=True).stdout
    counts: dict[int, int] = {}
    for line in out.splitlines():
        words = line.split()
        if "pid" in words:
            pid = int(words[words.index("pid") + 1])
            counts[pid] = counts.get(pid, 0) + 1
    return counts


def verbs_figures(daemons: list[DaemonProcess]) -> dict[str, dict[str, int]]:
    """MRs of each daemon, by control address (``rdma resource`` names MRs' pids; in the
    guest it named none for the daemons' QPs, so those are counted per device)."""
    mrs = rdma_objects("mr")
    return {d.address: {"mrs": mrs.get(d.proc.pid, 0)} for d in daemons}


def rc_qps() -> int:
    """RC QPs on the device (every daemon's), from ``rdma resource show qp``."""
    out = subprocess.run(["rdma", "resource", "show", "qp"], capture_output=True, text=True,
                         check=True).stdout
    return sum(" type RC " in f" {line} " for line in out.splitlines())


def test_4x4_every_pair_one_qp_reused(rdma_device: RdmaDevice, tmp_path: Path) -> None:
    device, gid_index = rdma_device
    t0 = time.monotonic()
    with fleet(N, M, tmp_path, transport="rdma", slots=4, max_context=2048,
               startup_s=STARTUP_ALL_S) as (prefills, decodes, _cfgs):
        started = time.monotonic() - t0
        everyone = [*prefills, *decodes]
        idle = verbs_figures(everyone)
        # RC QPs other processes still hold on the device (an earlier test's daemons
        # winding down in the same guest): the fleet's own count is on top of these.
        before = rc_qps()
        verbs: list[dict[str, dict[str, int]]] = []
        qps: list[int] = []

        def count() -> None:
            verbs.append(verbs_figures(everyone))
            qps.append(rc_qps())

        run = every_pair(prefills, decodes, seq_len=2000, rounds=2, timeout=120,
                         after_round=count)
        after_one, after_two = verbs
        assert_per_peer_not_per_request(run, prefills, decodes)
        # one QP per pair on each side, made by the first round's handshakes, kept after
        assert qps == [before + 2 * N * M] * 2, (before, qps)
        for d in everyone:
            a = d.address
            # memory registrations: made at start-up and per peer, never per request
            assert after_two[a]["mrs"] == after_one[a]["mrs"], (d.role, after_one[a], after_two[a])
        text = (table(run, prefills, decodes, extra=after_two)
                + f"\n  RC QPs on {device}: {qps} ({before} before)")
        idle_mrs = sorted({v["mrs"] for v in idle.values()})
    ref_gbps = ib_write_bw(device, gid_index, 65536, 3, free_port())
    ours_gbps = run.bytes_per_s() * 8 / 1e9
    print(f"\n{text}\n  MRs per daemon before any peer: {idle_mrs}\n"
          f"  ib_write_bw 64 KiB same boot: {ref_gbps:.3f} Gb/s; fleet round 2 "
          f"{ours_gbps:.3f} Gb/s aggregate = {ours_gbps / ref_gbps:.2f} x ib_write_bw\n"
          f"  start-up of {N + M} daemons {started:.1f} s, total {time.monotonic() - t0:.1f} s")
    assert ref_gbps > 0
