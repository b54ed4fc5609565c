"""A scheduler over 2 prefill x 3 decode daemons (TCP) survives a decode SIGKILL and a
prefill restart mid-run: every request ends in Success exactly once (docs/fleet.md)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvbeam.client import KvbeamClient
from kvbeam.fleet import Fleet
from kvbeam.procs import DaemonProcess
from kvbeam.scheduler import RequestResult, run_fleet_request
from kvbeam.server.faults import ENABLE_FLAG, WRITE_DELAY_ENV
from tests.daemon_helpers import STARTUP_S
from tests.fleet_helpers import figures, fleet, landings, slots_held, spawn_role
from tests.waiting import wait_until

log = logging.getLogger(__name__)

REQUESTS = 60
CONCURRENCY = 6
#: Prefill waits this long before posting each write (the slow-wire fault hook), so a
#: request stays in flight on both daemons long enough for the kills below to catch
#: attempts mid-transfer: without it, on a loaded machine, the decode's held slots were
#: sometimes all Success-awaiting-Release at the kill (no resend to observe) or the
#: prefill never had two transfers live at once while polled.
SLOW_WIRE = {WRITE_DELAY_ENV: "0.25"}


def _base_id(attempt_id: str) -> str:
    return attempt_id.split(".r")[0]


def _busy(d: DaemonProcess) -> int:
    """Requests in flight on a daemon now: decode's held slots, prefill's live transfers."""
    with KvbeamClient(d.address) as c:
        cap = c.capacity()
    return cap.slots_held if d.role == "decode" else cap.live_transfers


def test_decode_killed_and_prefill_restarted_mid_run_every_request_succeeds_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvbeam.scheduler")
    with fleet(2, 3, tmp_path, prefill_extra=[ENABLE_FLAG],
               prefill_env=SLOW_WIRE) as (prefills, decodes, cfgs):
        done = Counter[str]()
        lock = threading.Lock()
        lens = [512 + (i * 2654435761) % 3500 for i in range(REQUESTS)]

        def one(f: Fleet, i: int) -> RequestResult:
            r = run_fleet_request(f, f"fo-{i}", lens[i], i % 4, timeout=30.0)
            with lock:
                done["n"] += 1
            return r

        victim, restarted = decodes[0], prefills[0]
        replacement = None
        try:
            with Fleet([p.address for p in prefills], [d.address for d in decodes]) as f, \
                    ThreadPoolExecutor(CONCURRENCY) as pool:
                futures = [pool.submit(one, f, i) for i in range(REQUESTS)]
                assert wait_until(lambda: done["n"] >= 10, 60)
                # Kill each while it has requests in flight (so resends must happen).
                assert wait_until(lambda: _busy(victim) >= 2, 30, interval=0.001)
                t_kill = time.monotonic()
                victim.kill()  # SIGKILL: its reservations and landings are gone
                assert wait_until(lambda: done["n"] >= 25, 60)
                assert wait_until(lambda: _busy(restarted) >= 2, 30, interval=0.001)
                restarted.kill()  # and a prefill crashes, then comes back on its port
                replacement = spawn_role("prefill", cfgs["prefill"], listen=restarted.address,
                                         extra=[ENABLE_FLAG], env=SLOW_WIRE).ready(STARTUP_S)
                results = [fut.result() for fut in futures]
            t_all = time.monotonic() - t_kill

            bad = [r for r in results if not r.ok]
            assert not bad, bad
            retried = [r for r in results if r.attempts > 1]
            assert retried, "neither failure made the scheduler resend anything"
            # None twice: across all three decodes (the killed one's log up to its death
            # included) each request landed under exactly one attempt id.
            landed = Counter(_base_id(rid) for d in decodes for rid in landings(d))
            # A Success on the victim may lack its log line: decode logs just after the state
            # changes, and SIGKILL can fall in between. Only those may be missing.
            unlogged = {r.request_id for r in results} - set(landed)
            assert all(r.decode == victim.address for r in results
                       if r.request_id in unlogged), unlogged
            assert set(landed) <= {r.request_id for r in results}
            assert max(landed.values()) == 1, [k for k, n in landed.items() if n > 1]
            # The survivors' books match the scheduler's and hold no slot.
            survivors = decodes[1:]
            for d in survivors:
                assert wait_until(lambda d=d: slots_held(d) == 0, 10), d.address
                fig = figures(d)
                assert fig["slots_held"] == 0
                assert fig["success"] == sum(r.decode == d.address for r in results)
            # Each failure made the scheduler resend what it had in flight there.
            resends = [m.getMessage() for m in caplog.records if "resending" in m.getMessage()]
            by_decode = sum(f"-> {victim.address} " in m for m in resends)
            by_prefill = sum(f"on {restarted.address} ->" in m for m in resends)
            assert by_decode >= 1 and by_prefill >= 1, resends
            recovery = max(r.recovery_s for r in retried)
            log.warning("failover 2x3: decode %s SIGKILLed, prefill %s SIGKILLed and "
                        "restarted; %d/%d Success, %d retried (%d resends), recovery max "
                        "%.0f ms, kill to last Success %.1f s", victim.address,
                        restarted.address, len(results) - len(bad), len(results),
                        len(retried), sum(r.attempts - 1 for r in retried), recovery * 1e3,
                        t_all)
            print(f"\nFAILOVER killed=decode(SIGKILL)+prefill(SIGKILL, restart) "
                  f"requests={len(results)} success={len(results) - len(bad)} "
                  f"retried={len(retried)} resends={sum(r.attempts - 1 for r in retried)} "
                  f"(on the killed decode {by_decode}, on the restarted prefill {by_prefill}) "
                  f"recovery_max_ms={recovery * 1e3:.0f}")
        finally:
            if replacement is not None:
                replacement.stop()
