"""The GPU check (tests/gpu/gpu_check.py) on CPU tensors, as the GPU machine runs it: CI runs
it so that the script cannot rot before a GPU machine is lent.

``--from-tree --build-helpers``: kvbeam imported through the symlink farm (not this venv's
install) and every compiled helper built into it, exactly what a bare copy of the tree on
the GPU machine goes through; a small bandwidth request (``--tokens 2048``) keeps it short.
Every step must pass, except the dma-buf step, which has no exporter on this host (no
udmabuf, no DRM) and must say NOT RUN with why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_cpu_run_passes_every_step(tmp_path: Path) -> None:
    out = tmp_path / "steps.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/gpu/gpu_check.py"), "--cpu", "--from-tree",
         "--build-helpers", "--tokens", "2048", "--repeats", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path)
    text = proc.stdout + proc.stderr
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, text[-6000:]
    steps = {s["name"]: s for s in json.loads(out.read_text())}
    assert [n for n, s in steps.items() if s["status"] != "PASS"] == ["dmabuf"], steps
    assert steps["dmabuf"]["status"] == "NOT RUN"
    assert "no dma-buf exporter on this machine" in steps["dmabuf"]["lines"][0]
    # It ran from the farm, with helpers it built, not from this venv's install.
    assert "(no install)" in text and "compiled helpers: built " in text, text[:3000]
    assert "a daemon process imports " in text and "kvbeam-tree-" in text
    # The token comparison, both modes, and the bandwidth figures beside the plain copy.
    assert text.count("2/2 continuations equal to the colocated run") == 2, text
    # The integrations' staged paths (the vLLM worker side through two daemons, sglang's
    # pool layout with its metadata rows on the CPU).
    assert "ok   every block landed in decode's device cache exactly" in text, text
    assert "ok   sglang's pools (K/V on cpu, metadata rows on cpu)" in text, text
    bw = steps["bandwidth"]["figures"]
    assert bw["bytes"] == 2048 * 32 * 1024 and bw["staged_gbs"] > 0 and bw["plain_gbs"] > 0
