"""A benchmark's child process, driven a line at a time over its stdin and stdout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])


class LineProcess:
    """``python -m MODULE ARGS`` in the repository root; its first line must be ``first``
    (it is ready then). Subclasses say how it stops."""

    def __init__(self, module: str, args: list[str], first: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1, cwd=ROOT)
        got = self.read()
        if got != first:
            raise RuntimeError(f"{module} answered {got!r} first, not {first!r}")

    def read(self) -> str:
        """The next line it writes (RuntimeError when it exited instead)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"process {self.proc.pid} exited ({self.proc.poll()})")
        return line.strip()

    def write(self, text: str) -> None:
        """Send it one line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def cmd(self, text: str) -> str:
        """One line there, one line back."""
        self.write(text)
        return self.read()
