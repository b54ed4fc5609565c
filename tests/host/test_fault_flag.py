"""Fault injection is armed only by ``--enable-fault-injection``, never by the environment alone.

Real daemon processes on loopback (TCP). The ``KVBEAM_FAULT_*`` variables name what to
inject (kvbeam/server/faults.py); a daemon started without the flag ignores them, says
so by name, and moves requests untouched; one started with the flag says at start-up,
as a WARNING, that fault injection is on and which faults are armed.
"""

from __future__ import annotations

import re

from kvbeam.scheduler import run_request
from kvbeam.server.faults import BREAK_LINK_ENV, CORRUPT_LANDED_ENV, ENABLE_FLAG
from tests.daemon_helpers import pair
from tests.waiting import wait_until


def test_fault_variables_without_the_flag_arm_nothing() -> None:
    with pair(prefill_env={BREAK_LINK_ENV: "1"},
              decode_env={CORRUPT_LANDED_ENV: "1"}) as (prefill, decode, p, d):
        result = run_request(p, d, "noflag", 3000, 1, timeout=60)
        assert result.ok and result.verified, (result, decode.output[-3000:])
        for daemon, env in ((prefill, BREAK_LINK_ENV), (decode, CORRUPT_LANDED_ENV)):
            assert "FAULT INJECT" not in daemon.output, daemon.output[-3000:]
            assert re.search(rf"WARNING .*{env} is set but fault injection is off \(no "
                             rf"{ENABLE_FLAG}\): ignored", daemon.output), daemon.output[-3000:]
        assert "resend" not in prefill.output


def test_the_flag_arms_the_faults_and_the_start_up_log_says_so() -> None:
    with pair(prefill_extra=[ENABLE_FLAG], prefill_env={BREAK_LINK_ENV: "1"},
              decode_extra=[ENABLE_FLAG]) as (prefill, decode, p, d):
        for daemon in (prefill, decode):
            assert re.search(rf"WARNING .*FAULT INJECTION ENABLED \({ENABLE_FLAG}\): "
                             r"this daemon breaks things on purpose", daemon.output), \
                daemon.output[-3000:]
        assert re.search(rf"WARNING .*FAULT INJECTION ARMED \({BREAK_LINK_ENV}=1\)",
                         prefill.output), prefill.output[-3000:]
        assert "FAULT INJECTION ARMED" not in decode.output  # enabled, nothing armed
        result = run_request(p, d, "flag", 3000, 1, timeout=60)
        assert result.ok, (result, prefill.output[-3000:])
        assert wait_until(lambda: "FAULT INJECTED: broke link" in prefill.output, 10), \
            prefill.output[-3000:]
