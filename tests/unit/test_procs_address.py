"""The address the test and demo helpers dial for a daemon they started (kvbeam/procs.py)."""

from __future__ import annotations

import pytest

from kvbeam.procs import local_address


@pytest.mark.parametrize(("reported", "dialed"), [
    ("0.0.0.0:5000", "127.0.0.1:5000"),  # a wildcard names no address to send to
    ("[::]:5000", "[::1]:5000"),
    ("127.0.0.1:5000", "127.0.0.1:5000"),
    ("[::1]:5000", "[::1]:5000"),
    ("decode-0.kv.svc:5000", "decode-0.kv.svc:5000"),
])
def test_a_wildcard_bind_is_dialed_on_loopback(reported: str, dialed: str) -> None:
    assert local_address(reported) == dialed
