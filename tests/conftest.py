"""Fixtures every kind of test may use (tests/unit, host, rdma, compose).

Kind-specific ones live next to their tests: the RDMA device and the veth wire in
tests/rdma/conftest.py, the docker engine and image in tests/compose/conftest.py.
Plain helpers (builders, runners, ports) are functions in the tests/*_helpers.py
modules and tests/fixtures.py, importable from anywhere.
"""

from __future__ import annotations

import os

import pytest

from kvbeam.proto.side import Role, SideInfo
from tests.control_helpers import (
    DECODE_SLOTS,
    config,
    rdma_endpoint,
    side,
    tcp_endpoint,
    with_slots,
)
from tests.tls_helpers import Pki, make_pki

# Every daemon a test starts (its environment is this process's) logs each request's
# progress, as the compose demo does: tests read those lines (and a failing test's
# output is read by people). A daemon's default is off (--log-requests); the tests of
# that default set KVBEAM_LOG_REQUESTS themselves.
os.environ.setdefault("KVBEAM_LOG_REQUESTS", "true")


@pytest.fixture
def prefill() -> SideInfo:
    """A prefill side (shipped-style config, TCP endpoint) for control-plane tests."""
    return side(Role.PREFILL, config(), tcp_endpoint(9001))


@pytest.fixture
def decode() -> SideInfo:
    """The matching decode side (RDMA endpoint, DECODE_SLOTS request slots)."""
    return side(Role.DECODE, with_slots(config(), DECODE_SLOTS), rdma_endpoint())


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A throw-away certificate authority (``openssl``) that issues test certificates."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def rogue_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A second, unrelated CA: what it signs must be refused by peers trusting :func:`pki`."""
    return make_pki(tmp_path_factory.mktemp("rogue"), "rogue-ca")
