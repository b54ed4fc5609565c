"""What the containers rely on: decode's Success says how it was verified, ``kvbeam drive
--require-verified`` insists on it, and ``kvbeam health`` answers for HEALTHCHECKs."""

from __future__ import annotations

import subprocess
import sys

from kvbeam.scheduler import drive
from kvbeam.states import NOT_VERIFIED_NO_DIGESTS, VERIFIED_PREFIX
from tests.control_helpers import run_cli as _kvbeam
from tests.daemon_helpers import pair


def test_success_detail_says_crc32c_verified_and_health_answers() -> None:
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
