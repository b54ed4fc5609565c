"""Fixtures for RDMA tests (marker ``rdma``), run by ``make test-rdma``.

tests/softroce/run_rdma_suite.sh picks the device (a real NIC, host rdma_rxe or the qemu
soft-RoCE guest) and exports KVBEAM_RDMA_DEVICE / KVBEAM_RDMA_GID_INDEX. An RDMA test must never
pass by skipping: a missing device fails, and a skip of an rdma-marked test is turned into a
failure.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import NamedTuple

import pytest


class RdmaDevice(NamedTuple):
    name: str
    gid_index: int


@pytest.fixture(scope="session")
def rdma_device() -> RdmaDevice:
    """The RDMA device and GID index to use; a tuple, so tests can unpack it."""
    name = os.environ.get("KVBEAM_RDMA_DEVICE", "")
    if not name:
        pytest.fail(
            "KVBEAM_RDMA_DEVICE is not set: run RDMA tests through `make test-rdma` "
            "(tests/softroce/run_rdma_suite.sh), which provides a device",
            pytrace=False,
        )
    if not Path("/sys/class/infiniband", name).exists():
        pytest.fail(f"RDMA device {name!r} not found in /sys/class/infiniband", pytrace=False)
    return RdmaDevice(name, int(os.environ.get("KVBEAM_RDMA_GID_INDEX", "0")))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Report a skipped rdma test (importorskip, skipif, ...) as failed; xfail stays xfail."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("rdma"):
        report.outcome = "failed"
        report.longrepr = f"RDMA tests must not skip, but this one did: {report.longrepr}"
    return report
