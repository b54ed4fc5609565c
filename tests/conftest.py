"""Fixtures every kind of test may use (tests/unit, host, rdma, compose).

Kind-specific ones live next to their tests: the RDMA device and the veth wire in
tests/rdma/conftest.py, the docker engine and image in tests/compose/conftest.py.
Plain helpers (builders, runners, ports) are functions in the tests/*_helpers.py
modules and tests/fixtures.py, importable from anywhere.
"""

from __future__ import annotations

import pytest

from tests.tls_helpers import Pki, make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A throw-away certificate authority (``openssl``) that issues test certificates."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def rogue_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A second, unrelated CA: what it signs must be refused by peers trusting :func:`pki`."""
    return make_pki(tmp_path_factory.mktemp("rogue"), "rogue-ca")
