"""``memory_kind: dmabuf`` against a real daemon (TCP): its refusals, and the daemon unharmed.

This host has no dma-buf exporter (no udmabuf, no DRM): the dma-buf attaches that move
bytes run in the soft-RoCE guest with vgem (tests/rdma/test_dmabuf_rdma.py). Here a
daemon run with ``--integrity false`` (with it on, tests/host/test_attach_faults.py sees
the integrity refusal) is handed memfds described as dma-bufs: refused naming the fd,
holding nothing afterwards, and an engine's host memory attaches right after.
"""

from __future__ import annotations

from pathlib import Path

from tests.attach_helpers import Engine, proc_counts, start_engine_daemon, write_config
from tests.fixtures import side
from tests.metrics_helpers import scrape, value
from tests.waiting import wait_until


def test_memfds_described_as_dmabufs_are_refused_and_the_daemon_serves_on(tmp_path: Path
                                                                          ) -> None:
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", side())
    sock = str(tmp_path / "d.sock")
    daemon = start_engine_daemon("decode", sock, config=cfg, extra=["--integrity", "false"])
    engines: list[Engine] = []
    try:
        before = proc_counts(daemon.proc.pid)
        engines.append(Engine(sock, cfg, seed=1, memory_kind="dmabuf"))
        answer = engines[-1].first
        assert answer.startswith("refused fds[0]: attach refused by the daemon on "), answer
        assert ": fds[0] (components[2][0] target.layer0.swa_ring): not a dma-buf (statfs " \
            "type 0x1021994)" in answer, answer
        engines[-1].stop()
        wait_until(lambda: proc_counts(daemon.proc.pid)["fds"] <= before["fds"], 5)
        after = proc_counts(daemon.proc.pid)
        assert after["fds"] == before["fds"] and after["memfd_maps"] == 0, (before, after)
        engines.append(Engine(sock, cfg, seed=2))  # host memory: attaches at once
        assert engines[-1].attached, engines[-1].first
        assert wait_until(lambda: value(scrape(daemon.metrics), "kvbeam_engine_attached") == 1,
                          10)
    finally:
        for e in engines:
            e.stop()
        daemon.stop()
