"""A request that takes longer to move than the Transferring deadline still succeeds.

Transferring's deadline is sized by the request's bytes (``--transfer-floor-mbps``):
at least bytes / floor rate. Prefill's test-only slow-wire hook
(``KVBEAM_FAULT_WRITE_DELAY_S``) makes each write take 3 s to start, three times the
configured 1 s deadline; with a floor rate that allows it, neither side fails the
request while it is still being written.
"""

from __future__ import annotations

import time

from kvbeam.scheduler import run_request
from kvbeam.server.faults import ENABLE_FLAG, WRITE_DELAY_ENV
from tests.daemon_helpers import pair

DELAY_S = 3.0
DEADLINE = ["--deadline-transfer-s", "1", "--transfer-floor-mbps", "0.001"]


def test_slow_wire_longer_than_the_transfer_deadline_succeeds() -> None:
    with pair(decode_extra=DEADLINE, prefill_extra=[*DEADLINE, ENABLE_FLAG],
              prefill_env={WRITE_DELAY_ENV: str(DELAY_S)}) as (prefill, decode, p, d):
        t0 = time.monotonic()
        result = run_request(p, d, "slow", 4096, 0, timeout=30)
        took = time.monotonic() - t0
        assert result.ok, result
        assert took > DELAY_S > 1.0  # longer than the configured Transferring deadline
        assert "FAULT INJECTION ARMED" in prefill.output
        for side in (prefill, decode):
            assert "failed: timeout" not in side.output, side.output[-2000:]
