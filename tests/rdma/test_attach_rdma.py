"""Engine-attached memfd pools moved over RDMA (soft-RoCE): the daemons register the
engines' memory (MRs over MAP_SHARED memfd mappings), a request lands in the decode
engine's own memory, and the engine's SIGKILL deregisters and unmaps everything; a
new engine attaches to the same daemon and a request moves again. The engines' memfds
are sealed: an engine's ``ftruncate`` fails and cannot leave an MR over pages its file
no longer has; punching holes (which seals do not block) crashes nothing and never
passes for a good transfer."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.procs import DaemonProcess
from kvbeam.states import TransferState
from tests.attach_helpers import (
    Engine,
    fd_targets,
    proc_counts,
    start_engine_pair,
    write_config,
)
from tests.daemon_helpers import SLOW_GUEST
from tests.fixtures import side
from tests.metrics_helpers import scrape, value
from tests.rdma.conftest import RdmaDevice
from tests.waiting import wait_until

pytestmark = pytest.mark.rdma
SEQ = 700


def _regions(daemon: DaemonProcess) -> float:
    return value(scrape(daemon.metrics), "kvbeam_engine_registered_regions")


def _cycle(p: KvbeamClient, d: KvbeamClient, prefill: DaemonProcess, decode: DaemonProcess,
           pe: Engine, de: Engine, rid: str) -> dict[str, int]:
    """Move one request into the decode engine, then SIGKILL it; what decode held attached."""
    assert de.attached, de.first
    assert d.wait_healthy(30)
    # Prefill drops its link to decode's previous instance at its next heartbeat.
    assert wait_until(lambda: value(scrape(prefill.metrics), "kvbeam_peers") == 0, 30)
    assert _regions(decode) > 0
    res = d.reserve(rid, SEQ, prefill.address)
    p.send(rid, 0, SEQ, decode.address)
    for c in (p, d):
        st = c.wait(rid, 120)
        assert st.state is TransferState.SUCCESS, str(st)
    assert de.digests(res.slot, SEQ) == pe.digests(0, SEQ)
    d.release(rid)
    attached = proc_counts(decode.proc.pid)
    attached["regions"] = int(_regions(decode))
    de.kill()
    assert wait_until(lambda: value(scrape(decode.metrics), "kvbeam_engine_attached") == 0, 60)
    assert not d.healthy(5.0)
    return attached


def _punched(p: KvbeamClient, d: KvbeamClient, prefill: DaemonProcess, decode: DaemonProcess,
             pe: Engine, engines: list[Engine], dsock: str, cfg: str) -> None:
    """Both engines punch holes over all their registered memory, then a request moves:
    the MRs keep the old pages pinned while the CPU mappings see zeros, so the request
    may fail its digest check, but nothing crashes and no mismatch passes as Success."""
    engines.append(Engine(dsock, cfg, seed=9))
    de = engines[-1]
    assert de.attached and d.wait_healthy(30), de.first
    assert wait_until(lambda: value(scrape(prefill.metrics), "kvbeam_peers") == 0, 30)
    assert pe.cmd("punch") == "punched" and de.cmd("punch") == "punched"
    res = d.reserve("rdma-punched", SEQ, prefill.address)
    p.send("rdma-punched", 0, SEQ, decode.address)
    states = {side: c.wait("rdma-punched", 120) for side, c in (("prefill", p), ("decode", d))}
    landed, source = de.digests(res.slot, SEQ), pe.digests(0, SEQ)
    print(f"\nafter punching both engines' memory: {({k: str(v) for k, v in states.items()})}; "
          f"decode engine reads what the prefill engine reads: {landed == source}")
    for daemon in (prefill, decode):
        assert daemon.proc.poll() is None, (daemon.role, daemon.proc.poll(),
                                            daemon.output[-2000:])
    assert all(st.state in (TransferState.SUCCESS, TransferState.FAILED)
               for st in states.values()), states
    if states["decode"].state is TransferState.SUCCESS:
        assert landed == source, "a transfer into punched memory passed its digest check"
    assert p.healthy(5.0) and d.healthy(5.0)


def test_attached_memfd_pools_move_requests_over_rdma(rdma_device: RdmaDevice,
                                                      tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", side())
    psock, dsock = str(tmp_path / "p.sock"), str(tmp_path / "d.sock")
    prefill, decode = start_engine_pair(psock, dsock, transport="rdma", deadlines=SLOW_GUEST)
    engines: list[Engine] = []
    try:
        assert prefill.transport == decode.transport == "rdma"
        with KvbeamClient(prefill.address, timeout=30) as p, \
                KvbeamClient(decode.address, timeout=30) as d:
            pid = decode.proc.pid
            before, fds0 = proc_counts(pid), fd_targets(pid)
            engines.append(Engine(psock, cfg, seed=1, layout="packed"))
            pe = engines[0]
            assert pe.attached and p.wait_healthy(30), pe.first
            figures = []
            for n in (1, 2):  # the second cycle: a new engine on the same daemon
                if n == 2:  # sealed: shrinking or regrowing registered memory is refused
                    assert pe.cmd("resize 0") == "resize refused: EPERM"
                    assert pe.cmd(f"resize {1 << 30}") == "resize refused: EPERM"
                engines.append(Engine(dsock, cfg, seed=1 + n))
                attached = _cycle(p, d, prefill, decode, pe, engines[-1], f"rdma-{n}")
                wait_until(lambda: proc_counts(pid)["fds"] <= before["fds"], 10)
                after = proc_counts(pid)
                after["regions"] = int(_regions(decode))
                figures.append((attached, after))
                assert after["memfd_maps"] == 0 and after["regions"] == 0
            extra = Counter(fd_targets(pid)) - Counter(fds0)
            print(f"\nrdma decode daemon: before {before}; "
                  + "; ".join(f"cycle {i + 1}: attached {a}, after SIGKILL {b}"
                              for i, (a, b) in enumerate(figures))
                  + f"; fds open after that were not before: {dict(extra)}")
            # Nothing accumulates per attach: the second cycle ends where the first did.
            assert figures[1][1]["fds"] <= figures[0][1]["fds"], figures
            _punched(p, d, prefill, decode, pe, engines, dsock, cfg)
    finally:
        for e in engines:
            e.stop()
        prefill.stop()
        decode.stop()
