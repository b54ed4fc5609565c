"""``kvbeam plan`` on the shipped configs."""

from __future__ import annotations

import json

import pytest

from kvbeam.cli import main
from tests.control_helpers import run_cli
from tests.fixtures import shipped_config

PREFILL = shipped_config("prefill")
DECODE = shipped_config("decode")


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", PREFILL, "--request-slot", "7", "--seq-len", "129"]) == 0
    out = capsys.readouterr().out
    assert "state component types: ['SWA', 'SWA_RING', 'C128_STATE', 'SWA_RING']" in out
    assert "draft.swa_ring" in out
    # C128 state item 15 of 131072 bytes for slot 7, L 129 (ring 256)
    assert "(1966080, 1966080, 131072)" in out


def test_json_against_decode_layout(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--config", PREFILL, "--request-slot", "1", "--seq-len", "4096",
                 "--decode", DECODE, "--decode-slot", "12", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_blocks"] == len([b for buf in data["buffers"] for b in buf["blocks"]])
    assert data["components"][-1]["name"] == "draft.swa_ring"
    total = sum(n for buf in data["buffers"] for _, _, n in buf["blocks"])
    assert total == data["total_bytes"] > 0


def test_bad_slot_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", PREFILL, "--request-slot", "99", "--seq-len", "10"]) == 2
    assert "request slot 99 out of range" in capsys.readouterr().err


def test_console_script_help() -> None:
    r = run_cli("plan", "--help")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "--request-slot" in out and "--decode-slot" in out
