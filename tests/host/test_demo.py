"""``kvbeam demo --transport tcp`` end to end: reference engines (default), ``--pools own``."""

from __future__ import annotations

import re

from tests.control_helpers import run_cli


def test_demo_runs_the_reference_engines_and_shows_equal_continuations() -> None:
    out = run_cli("demo", "--transport", "tcp", "--prompt-lens", "256,250", "-k", "6",
                  timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "(--pools engine), reference engines on tiny-unified-draft" in text
    rows = re.findall(r"^demo-\d+\s+(\d+)\s+((?:\d+ ){5}\d+)\s+((?:\d+ ){5}\d+)\s+(\w+)\s+(\d+)",
                      out.stdout, re.M)
    assert [int(r[0]) for r in rows] == [256, 250], out.stdout
    for _, moved, colocated, equal, nbytes in rows:
        assert moved == colocated and equal == "yes" and int(nbytes) > 0
    assert "2/2 continuations equal to the colocated run" in out.stdout
    assert "2 transfers XXH3-128-verified; transport tcp" in out.stdout


def test_demo_paged_without_draft() -> None:
    out = run_cli("demo", "--transport", "tcp", "--paged", "--no-draft", "--prompt-lens",
                  "224", "-k", "4", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reference engines on tiny-paged..." in out.stdout
    assert "1/1 continuations equal" in out.stdout


def test_demo_pools_own_keeps_the_transport_only_run() -> None:
    out = run_cli("demo", "--pools", "own", "--transport", "tcp", "--seq-lens", "128,1000,333",
                  timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3/3 Success (3 XXH3-128-verified)" in out.stdout
    assert "transport tcp" in out.stdout
    assert "reference engines" not in out.stdout
