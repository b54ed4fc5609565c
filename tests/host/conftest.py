"""Fixtures of the host tests that start servers once per session.

:func:`sglang_plain`: one plain sglang server's outputs, shared by the served sglang
modules (tests/host/test_sglang_server.py, tests/host/test_sglang_staged.py), so a
``make test-sglang`` run starts it once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.sglang_server_helpers import PlainOutputs


@pytest.fixture(scope="session")
def sglang_plain(tmp_path_factory: pytest.TempPathFactory) -> PlainOutputs:
    """The plain server's greedy outputs of every served sglang test's prompts (the
    server is stopped before any pair starts)."""
    from tests.sglang_server_helpers import IN_FLIGHT, LENGTHS, plain_outputs

    keys = tuple((n, 0) for n in LENGTHS) + IN_FLIGHT
    return plain_outputs(tmp_path_factory.mktemp("sglang-plain"), keys)
