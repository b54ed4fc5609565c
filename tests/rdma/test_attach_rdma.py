"""Engine-attached memfd pools moved over RDMA (soft-RoCE): the daemons register the
engines' memory (MRs over MAP_SHARED memfd mappings), a request lands in the decode
engine's own memory, and the engine's SIGKILL deregisters and unmaps everything."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.procs import wait_until
from kvbeam.states import TransferState
from tests.attach_helpers import Engine, proc_counts, start_engine_daemon, write_config
from tests.daemon_helpers import SLOW_GUEST
from tests.fixtures import side
from tests.metrics_helpers import scrape, value
from tests.rdma.conftest import RdmaDevice

pytestmark = pytest.mark.rdma
SEQ = 700


def test_attached_memfd_pools_move_a_request_over_rdma(rdma_device: RdmaDevice,
                                                       tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", side())
    psock, dsock = str(tmp_path / "p.sock"), str(tmp_path / "d.sock")
    decode = start_engine_daemon("decode", dsock, transport="rdma", deadlines=SLOW_GUEST)
    prefill = start_engine_daemon("prefill", psock, transport="rdma", deadlines=SLOW_GUEST)
    engines: list[Engine] = []
    try:
        assert prefill.transport == decode.transport == "rdma"
        with KvbeamClient(prefill.address, timeout=30) as p, \
                KvbeamClient(decode.address, timeout=30) as d:
            before = proc_counts(decode.proc.pid)
            engines += [Engine(psock, cfg, seed=1, layout="packed"), Engine(dsock, cfg, seed=2)]
            pe, de = engines
            assert pe.attached and de.attached, (pe.first, de.first)
            assert p.wait_healthy(30) and d.wait_healthy(30)
            regions = value(scrape(decode.metrics), "kvbeam_engine_registered_regions")
            assert regions > 0
            res = d.reserve("rdma-1", SEQ, prefill.address)
            p.send("rdma-1", 0, SEQ, decode.address)
            for c in (p, d):
                st = c.wait("rdma-1", 120)
                assert st.state is TransferState.SUCCESS, str(st)
            assert de.digests(res.slot, SEQ) == pe.digests(0, SEQ)
            d.release("rdma-1")
            attached = proc_counts(decode.proc.pid)
            de.kill()
            assert wait_until(lambda: value(scrape(decode.metrics), "kvbeam_engine_attached") == 0,
                            60)
            wait_until(lambda: proc_counts(decode.proc.pid)["fds"] <= before["fds"], 10)
            after = proc_counts(decode.proc.pid)
            print(f"\nrdma decode daemon: before {before}, attached {attached} "
                  f"({int(regions)} regions), after SIGKILL {after}, regions "
                  f"{value(scrape(decode.metrics), 'kvbeam_engine_registered_regions')}")
            assert after["memfd_maps"] == 0 and after["fds"] <= before["fds"]
            assert value(scrape(decode.metrics), "kvbeam_engine_registered_regions") == 0
            assert not d.healthy(5.0)
    finally:
        for e in engines:
            e.stop()
        prefill.stop()
        decode.stop()
