"""``kvbeam check``: exit codes and messages on the shipped configs and on temp configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbeam.cli import main
from tests.control_helpers import run_cli
from tests.fixtures import CONFIGS

PREFILL = str(CONFIGS / "prefill.yaml")
DECODE = str(CONFIGS / "decode.yaml")
DECODE_PAGED = str(CONFIGS / "decode-paged.yaml")


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _with(source: str, old: str, new: str, tmp_path: Path, name: str) -> str:
    text = Path(source).read_text()
    assert old in text
    return _write(tmp_path, name, text.replace(old, new, 1))


def test_shipped_configs_are_compatible(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", PREFILL, DECODE]) == 0
    out = capsys.readouterr().out
    assert out.startswith("compatible: ")


def test_shipped_paged_configs_are_compatible() -> None:
    assert main(["check", str(CONFIGS / "prefill-paged.yaml"), DECODE_PAGED]) == 0


def test_unified_against_paged_is_incompatible(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", PREFILL, DECODE_PAGED]) == 1
    out = capsys.readouterr().out
    assert out.startswith("INCOMPATIBLE: ")
    assert "difference(s)" in out
    assert "- unified_kv [prefill/decode]: prefill and decode pools differ in unified-KV mode: " \
           "prefill=True, decode=False" in out
    assert "components.count" in out


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--json", PREFILL, DECODE_PAGED]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["compatible"] is False
    first = data["differences"][0]
    assert first["field"] == "unified_kv"
    assert first["values"] == {"prefill": "True", "decode": "False"}
    assert main(["check", "--json", PREFILL, DECODE]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == {"compatible": True, "prefill": PREFILL, "decode": DECODE, "differences": []}


def test_within_side_problem_uses_sglang_wording(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    bad = _with(DECODE, "draft:\n  compression_ratios: [0]    # NextN layers are SWA-only\n"
                "  unified_kv: true", "draft:\n  compression_ratios: [0]\n  unified_kv: false",
                tmp_path, "decode-bad.yaml")
    assert main(["check", PREFILL, bad]) == 1
    out = capsys.readouterr().out
    assert "- unified_kv [decode]: DSV4 target and draft pools must use the same unified-KV " \
           "mode: target=True, draft=False (decode side)" in out


def test_capacities_may_differ(tmp_path: Path) -> None:
    more = _with(DECODE, "num_req_slots: 16", "num_req_slots: 64", tmp_path, "d.yaml")
    more = _with(more, "num_req_slots: 16", "num_req_slots: 64", tmp_path, "d.yaml")
    assert main(["check", PREFILL, more]) == 0


def test_single_field_change_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = _with(DECODE, "page_size: 256", "page_size: 512", tmp_path, "d.yaml")
    other = _with(other, "page_size: 256", "page_size: 512", tmp_path, "d.yaml")
    assert main(["check", PREFILL, other]) == 1
    out = capsys.readouterr().out
    assert "- page_size [prefill/decode]: prefill and decode pools differ in page size: " \
           "prefill=256, decode=512" in out


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", PREFILL, str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read config" in capsys.readouterr().err


def test_invalid_yaml_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _write(tmp_path, "bad.yaml", "model: [unclosed\n")
    assert main(["check", bad, DECODE]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_invalid_field_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _with(DECODE, "page_size: 256", "page_size: -1", tmp_path, "d.yaml")
    assert main(["check", PREFILL, bad]) == 2
    assert "page_size" in capsys.readouterr().err


def test_json_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--json", PREFILL, str(tmp_path / "nope.yaml")]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["compatible"] is None
    assert "cannot read config" in data["error"]


def test_help_documents_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = capsys.readouterr().out
    for line in ("0  compatible", "1  incompatible", "2  a config cannot be used"):
        assert line in text


def test_console_script() -> None:
    result = run_cli("check", PREFILL, DECODE_PAGED)
    assert result.returncode == 1
    assert "INCOMPATIBLE" in result.stdout
