"""A daemon command gets one OpenBLAS thread (numpy would start one per core)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvbeam.cli import one_blas_thread_for_daemons


@pytest.mark.parametrize(("argv", "set_"), [
    (["prefill", "--config", "x.yaml"], True),
    (["--log-level", "DEBUG", "decode"], True),
    (["status", "127.0.0.1:1", "r"], False),
    (["plan", "--config", "prefill"], False),  # a value, after the command
])
def test_only_daemon_commands_get_one_blas_thread(monkeypatch: pytest.MonkeyPatch,
                                                  argv: list[str], set_: bool) -> None:
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    one_blas_thread_for_daemons(argv)
    assert os.environ.get("OPENBLAS_NUM_THREADS") == ("1" if set_ else None)


def test_an_operators_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    one_blas_thread_for_daemons(["prefill"])
    assert os.environ["OPENBLAS_NUM_THREADS"] == "4"


def test_the_setting_precedes_numpys_import() -> None:
    """Set before the command modules import numpy: OpenBLAS reads it once, at import."""
    code = ("import sys; from kvbeam import cli; assert 'numpy' not in sys.modules; "
            "cli.one_blas_thread_for_daemons(['prefill']); cli.build_parser(); "
            "assert 'numpy' in sys.modules; import os; "
            "print(os.environ['OPENBLAS_NUM_THREADS'])")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True, timeout=60)
    assert out.stdout.strip() == "1"
