"""Daemons never load torch on the host path: own pools and ``--pools engine`` (real processes).

``import torch`` costs about a minute per process in the soft-RoCE guest (qemu TCG), so
a daemon that loads it, at import or lazily on first use, pays that on every start.
Checked through /proc/PID/maps after the daemons served requests: a loaded torch maps
its shared libraries (``.../torch/lib/libtorch_cpu.so``), whoever imported it.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvbeam.procs import DaemonProcess
from kvbeam.scheduler import drive
from tests.attach_helpers import Engine, start_engine_pair, write_config
from tests.daemon_helpers import pair
from tests.fixtures import side


def torch_mappings(pid: int) -> list[str]:
    """Paths of torch's files (libraries, extension modules) mapped into process ``pid``."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({ln.split()[-1] for ln in lines if "/torch/" in ln.split()[-1]})


def _serve_and_check(prefill: DaemonProcess, decode: DaemonProcess) -> None:
    results = drive(prefill.address, decode.address, [300, 700, 2000], source_slots=2,
                    concurrency=2)
    assert all(r.ok for r in results), results
    for daemon in (prefill, decode):
        assert daemon.proc.poll() is None
        assert torch_mappings(daemon.proc.pid) == [], daemon.role


def test_the_detector_sees_a_loaded_torch() -> None:
    import torch  # noqa: F401  (this test process may load it: only daemons must not)

    assert any("libtorch" in p for p in torch_mappings(os.getpid()))


def test_own_pools_daemons_never_load_torch() -> None:
    with pair() as (prefill, decode, _p, _d):
        _serve_and_check(prefill, decode)


def test_engine_pools_daemons_never_load_torch(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    cfg = write_config(tmp_path / "side.yaml", side())
    psock, dsock = str(tmp_path / "p.sock"), str(tmp_path / "d.sock")
    prefill, decode = start_engine_pair(psock, dsock)
    engines: list[Engine] = []
    try:
        engines = [Engine(psock, cfg, seed=1, layout="packed"), Engine(dsock, cfg, seed=2)]
        assert all(e.attached for e in engines), [e.first for e in engines]
        _serve_and_check(prefill, decode)
    finally:
        for e in engines:
            e.stop()
        prefill.stop()
        decode.stop()
