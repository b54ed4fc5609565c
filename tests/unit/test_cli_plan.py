"""``kvbeam plan`` on the shipped configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbeam.cli import main
from kvbeam.pools.checks import SAME_UNIFIED, SWA_ONLY
from tests.control_helpers import run_cli
from tests.fixtures import shipped_config

PREFILL = shipped_config("prefill")
DECODE = shipped_config("decode")
DECODE_PAGED = shipped_config("decode", paged=True)


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


# ---- the local checks: `kvbeam plan` refuses what `kvbeam check` and the daemons refuse ----
def _draft_with(tmp_path: Path, old: str, new: str) -> str:
    """The shipped prefill config with one line of its draft pool changed."""
    text = Path(PREFILL).read_text()
    head, draft = text.split("\ndraft:\n")
    assert old in draft
    path = tmp_path / "bad-draft.yaml"
    path.write_text(head + "\ndraft:\n" + draft.replace(old, new, 1))
    return str(path)


def _plan_and_check(config: str, capsys: pytest.CaptureFixture[str],
                    *extra: str) -> tuple[int, str, int, str]:
    """(exit, stdout) of `kvbeam plan --config CONFIG`, then of `kvbeam check CONFIG CONFIG`."""
    plan_code = main(["plan", "--config", config, "--request-slot", "1", "--seq-len", "64",
                      *extra])
    plan_out = capsys.readouterr().out
    check_code = main(["check", *extra, config, config])
    return plan_code, plan_out, check_code, capsys.readouterr().out


def test_plan_refuses_a_draft_that_is_not_swa_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _draft_with(tmp_path, "compression_ratios: [0]", "compression_ratios: [4]")
    plan_code, plan_out, check_code, check_out = _plan_and_check(config, capsys)
    assert plan_code == check_code == 1
    assert plan_out == check_out
    assert plan_out.startswith("INCOMPATIBLE: ")
    assert f"{SWA_ONLY}: draft compression_ratios=[4]" in plan_out
    assert "blocks" not in plan_out  # no plan printed


def test_plan_refuses_target_and_draft_in_different_unified_modes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _draft_with(tmp_path, "unified_kv: true", "unified_kv: false")
    plan_code, plan_out, check_code, check_out = _plan_and_check(config, capsys, "--json")
    assert plan_code == check_code == 1
    assert json.loads(plan_out) == json.loads(check_out)
    data = json.loads(plan_out)
    assert data["compatible"] is False
    assert {d["field"] for d in data["differences"]} == {"unified_kv"}
    assert all(d["message"].startswith(f"{SAME_UNIFIED}: target=True, draft=False")
               for d in data["differences"])


def test_plan_refuses_an_incompatible_decode_side(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--config", PREFILL, "--request-slot", "1", "--seq-len", "64",
                 "--decode", DECODE_PAGED])
    assert code == 1
    out = capsys.readouterr().out
    assert out.startswith(f"INCOMPATIBLE: {PREFILL} (prefill) and {DECODE_PAGED} (decode): ")
    assert "prefill and decode pools differ in unified-KV mode" in out
