"""Integrity: bytes corrupted after they land are caught every time (test-only fault hook).

Decode runs with ``KVBEAM_FAULT_CORRUPT_LANDED`` set (see :mod:`kvbeam.server.faults`):
it flips one byte of a request's landed items before recomputing the digests. Every
injected corruption must turn into Failed(integrity) on decode, and prefill must hear
of it; with integrity off the same corruption goes unnoticed, which is the point of
having the check.
"""

from __future__ import annotations

import re

import pytest

from kvbeam.errors import ConfigError
from kvbeam.scheduler import drive, run_request
from kvbeam.server.faults import CORRUPT_LANDED_ENV, ENABLE_FLAG, SEED_ENV, FaultHooks
from kvbeam.states import FailureReason, TransferState
from tests.daemon_helpers import pair
from tests.waiting import wait_until

F = TransferState.FAILED


def test_every_corruption_is_caught() -> None:
    env = {CORRUPT_LANDED_ENV: "1", SEED_ENV: "7"}
    with pair(decode_extra=[ENABLE_FLAG], decode_env=env) as (prefill, decode, p, d):
        results = drive(prefill.address, decode.address, [1, 127, 4096, 20000, 32768],
                        source_slots=8, concurrency=2, prefix="corrupt")
        assert [r.state.startswith("Failed(integrity") for r in results] == [True] * 5, results
        for r in results:
            # Prefill learns of decode's verdict either way the race goes: decode's abort
            # arrives after prefill's own Success (prefill logs it) or before the last write
            # completion reached prefill (prefill's request fails with decode's detail).
            notice = (f"request {r.request_id}: decode reports a failure after this side "
                      "ended: decode integrity check failed")

            def told(rid: str = r.request_id, n: str = notice) -> bool:
                st = p.status(rid)
                return n in prefill.output or (
                    st.state is F and "decode integrity check failed" in st.detail)

            assert wait_until(told, 10), notice
            dst = d.status(r.request_id)
            assert dst.reason is FailureReason.INTEGRITY and "XXH3-128 mismatch" in dst.detail
        assert decode.output.count("FAULT INJECTED: corrupted") == 5
        assert "FAULT INJECTION ARMED" in decode.output
        # every slot came back after the failures
        for i in range(16):
            d.reserve(f"after-{i}", 10, prefill.address)


def test_a_random_half_corrupted_matches_the_failures_one_for_one() -> None:
    env = {CORRUPT_LANDED_ENV: "0.5", SEED_ENV: "11"}
    with pair(decode_extra=[ENABLE_FLAG], decode_env=env) as (prefill, decode, _p, _d):
        lens = [1 + (i * 7919) % 30000 for i in range(24)]
        results = drive(prefill.address, decode.address, lens, source_slots=8, concurrency=4,
                        prefix="half")
        failed = {r.request_id for r in results if not r.ok}

        def injected_now() -> set[str]:
            return set(re.findall(r"FAULT INJECTED: corrupted request (\S+) ", decode.output))

        # The output arrives through a reader thread: wait for every failed request's line.
        wait_until(lambda: failed <= injected_now(), 10)
        injected = injected_now()
        assert injected == failed
        assert 0 < len(injected) < len(lens)  # both outcomes really happened
        assert all(r.state.startswith("Failed(integrity") for r in results if not r.ok)


def test_without_integrity_the_same_corruption_goes_unnoticed() -> None:
    env = {CORRUPT_LANDED_ENV: "1"}
    with pair(decode_env=env, decode_extra=[ENABLE_FLAG, "--integrity", "false"],
              prefill_extra=["--integrity", "false"]) as (_prefill, decode, p, d):
        assert run_request(p, d, "silent", 5000, 0).ok
        # The daemon's output reaches us through a reader thread: wait for the line.
        assert wait_until(lambda: "FAULT INJECTED: corrupted request silent" in decode.output,
                          10), decode.output[-2000:]


@pytest.mark.parametrize("env, message", [
    ({CORRUPT_LANDED_ENV: "often"}, "not a number"),
    ({CORRUPT_LANDED_ENV: "1.5"}, "must be in 0..1"),
    ({SEED_ENV: "x"}, "not an integer"),
])
def test_fault_variables_are_validated(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FaultHooks.from_env(env)


def test_no_variables_no_faults() -> None:
    assert not FaultHooks.from_env({}).armed
