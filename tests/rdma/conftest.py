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
from typing import TYPE_CHECKING, NamedTuple

import pytest

if TYPE_CHECKING:
    from kvbeam.procs import DaemonProcess
    from tests.rdma.netfaults import Wire


class RdmaDevice(NamedTuple):
    name: str
    gid_index: int


class WirePair(NamedTuple):
    """A prefill/decode daemon pair on two rxe devices joined by a veth wire."""

    prefill: DaemonProcess
    decode: DaemonProcess
    wire: Wire


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


@pytest.fixture(scope="session")
def wire(rdma_device: RdmaDevice) -> Generator[Wire, None, None]:
    """The veth wire between two rxe devices (tests/rdma/netfaults.py), removed at the end."""
    from tests.rdma import netfaults

    why = netfaults.allowed()
    if why:
        pytest.fail(why, pytrace=False)
    try:
        yield netfaults.setup()
    finally:
        netfaults.heal()
        netfaults.teardown()


@pytest.fixture(scope="session")
def wire_pair(wire: Wire) -> Generator[WirePair, None, None]:
    """Prefill on rxeA and decode on rxeB, joined by a veth wire that tests may cut.

    Shared by the fault tests and the soak (a daemon start costs tens of seconds under TCG);
    the fault tests leave it healthy. Prefill runs with --enable-fault-injection and two
    test-only fault hooks armed (see kvbeam/server/faults.py): writes outside decode's
    memory for request ids starting with ``qperr-``, and one broken QP for the first
    request starting with ``qpbreak-``.
    """
    from kvbeam.server.faults import BREAK_LINK_ENV, ENABLE_FLAG, OUTSIDE_MR_ENV
    from tests.daemon_helpers import start_both

    prefill, decode = start_both(
        transport="rdma", prefill_extra=[*wire.rdma_args("prefill"), ENABLE_FLAG],
        decode_extra=wire.rdma_args("decode"),
        prefill_env={OUTSIDE_MR_ENV: "qperr-", BREAK_LINK_ENV: "1:qpbreak-"})
    try:
        yield WirePair(prefill, decode, wire)
    finally:
        prefill.stop()
        decode.stop()
