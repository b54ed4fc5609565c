"""The daemon's code never imports torch (it costs about a minute per process under TCG).

A fresh interpreter imports every module a ``kvbeam prefill`` / ``kvbeam decode``
process can load (the CLI with all subcommands, the whole server, the pools) and must
find torch absent from ``sys.modules``. tests/host/test_no_torch.py checks running daemons.
"""

from __future__ import annotations

import subprocess
import sys

CODE = """
import importlib, pkgutil, sys
import kvbeam.cli, kvbeam.pools, kvbeam.server
kvbeam.cli.build_parser()
for pkg in (kvbeam.server, kvbeam.pools):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
print(len(sys.modules), sorted(m for m in sys.modules if m.split(".")[0] == "torch")[:3])
"""


def test_daemon_modules_leave_torch_out() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         check=True, timeout=120)
    count, _, torch_modules = out.stdout.strip().partition(" ")
    assert int(count) > 300  # the walk really imported the server (grpc, protobuf, ...)
    assert torch_modules == "[]"
