"""What the containers rely on: decode's Success says how it was verified, ``kvbeam drive
--require-verified`` insists on it, and ``kvbeam health`` answers for HEALTHCHECKs."""

from __future__ import annotations

import subprocess
import sys

from kvbeam.scheduler import drive
from kvbeam.states import NOT_VERIFIED_NO_DIGESTS, VERIFIED_PREFIX
from tests.control_helpers import run_cli as _kvbeam
from tests.daemon_helpers import pair


def test_success_detail_says_xxh3_verified_and_health_answers() -> None:
    with pair() as (prefill, decode, _p, d):
        results = drive(prefill.address, decode.address, [100, 5000], source_slots=2)
        assert all(r.ok and r.verified for r in results), results
        assert all(r.detail.startswith(VERIFIED_PREFIX) for r in results)
        assert "XXH3-128 verified: " in d.status(results[0].request_id).detail
        ok = _kvbeam("health", decode.address)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok
        light = subprocess.run([sys.executable, "-m", "kvbeam.commands.health", "--quiet",
                                prefill.address], capture_output=True, text=True, timeout=60,
                               check=False)
        assert light.returncode == 0 and light.stdout == "", light
        drv = _kvbeam("drive", "--prefill", prefill.address, "--decode", decode.address,
                      "--requests", "2", "--prefix", "cli", "--require-verified")
        assert drv.returncode == 0, drv
        assert "2/2 Success (2 XXH3-128-verified)" in drv.stdout
    down = _kvbeam("health", decode.address, "--timeout", "1")
    assert down.returncode == 1 and "not serving" in down.stderr, down


def test_require_verified_fails_when_prefill_sends_no_digests() -> None:
    with pair(prefill_extra=["--integrity", "false"]) as (prefill, decode, _p, _d):
        results = drive(prefill.address, decode.address, [300], source_slots=1)
        assert results[0].ok and not results[0].verified
        assert results[0].detail == NOT_VERIFIED_NO_DIGESTS
        drv = _kvbeam("drive", "--prefill", prefill.address, "--decode", decode.address,
                      "--requests", "1", "--prefix", "cli", "--require-verified")
        assert drv.returncode == 1, drv
        assert "reached Success without XXH3-128 verification" in drv.stderr


def test_a_watch_opened_before_send_sees_the_reservation_then_success() -> None:
    """``open_watch`` starts WatchStatus at once: opened after Reserve and before Send, its
    first message is the reservation's state (not terminal), and the same stream then
    reports Success once prefill's Send moved the request."""
    from kvbeam.states import TransferState

    with pair() as (prefill, decode, p, d):
        d.reserve("early-watch", 200, prefill.address)
        with d.open_watch("early-watch", 60.0) as watch:
            first = next(watch.changes())
            assert not first.terminal and first.state is not TransferState.SUCCESS, first
            p.send("early-watch", 0, 200, decode.address)
            final = watch.wait()
        assert final.state is TransferState.SUCCESS and final.detail.startswith(VERIFIED_PREFIX)
        with d.open_watch("early-watch", 5.0) as late:  # a terminal request: one message
            assert late.wait().state is TransferState.SUCCESS
