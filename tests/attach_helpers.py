"""Engine-attach test helpers: ``--pools engine`` daemons, engine processes (engine_peer.py).

Both start as fresh processes (never a fork after torch ran). An engine daemon is
ready when it prints its listening line; it is NOT_SERVING until an engine attaches,
so the usual readiness check (SERVING health) does not apply.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from kvbeam.errors import DaemonStartError
from kvbeam.pools.spec import SideConfig
from kvbeam.procs import DaemonProcess
from kvbeam.proto.attach_codec import config_to_mapping
from tests.daemon_helpers import FAST, STARTUP_S

_READY = re.compile(r"kvbeam (\w+) listening on (\S+) instance (\S+) transport (\w+)"
                    r"(?: metrics (\S+))?")


def write_config(path: Path, config: SideConfig) -> str:
    """Write a side YAML; returns its path."""
    path.write_text(yaml.safe_dump(config_to_mapping(config)))
    return str(path)


def _pump(proc: subprocess.Popen[str], lines: list[str], found: list[re.Match[str]],
          ready: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        m = _READY.search(line)
        if m and not found:
            found.append(m)
            ready.set()
    ready.set()


def start_engine_daemon(role: str, socket_path: str, *, config: str | None = None,
                        transport: str = "tcp", extra: Sequence[str] = (),
                        deadlines: Sequence[str] = FAST, user: str | None = None,
                        env: dict[str, str] | None = None) -> DaemonProcess:
    """A ``--pools engine`` daemon with /metrics; returns once it listens."""
    cmd = [sys.executable, "-m", "kvbeam.cli", role, "--pools", "engine", "--attach-socket",
           socket_path, "--listen", "127.0.0.1:0", "--transport", transport,
           "--metrics", "127.0.0.1:0", *deadlines, *extra]
    if config:
        cmd += ["--config", config]
    if user:  # setpriv: Popen(user=...) cannot exec the interpreter here, setpriv can
        gid = pwd.getpwnam(user).pw_gid
        cmd = ["setpriv", f"--reuid={user}", f"--regid={gid}", "--clear-groups", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, bufsize=1, cwd="/")
    lines: list[str] = []
    found: list[re.Match[str]] = []
    ready = threading.Event()
    threading.Thread(target=_pump, args=(proc, lines, found, ready), daemon=True).start()
    if not ready.wait(STARTUP_S) or not found:
        proc.kill()
        proc.wait(5)
        raise DaemonStartError(f"kvbeam {role} --pools engine did not start", "".join(lines))
    m = found[0]
    return DaemonProcess(role, proc, m.group(2), m.group(3), m.group(4), lines, m.group(5) or "")



def start_engine_pair(prefill_socket: str, decode_socket: str, **kwargs: Any
                      ) -> tuple[DaemonProcess, DaemonProcess]:
    """(prefill, decode) ``--pools engine`` daemons started at the same time (their
    start-ups overlap: each costs tens of seconds under TCG); ``kwargs`` go to both."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_engine_daemon, role, sock, **kwargs)
                   for role, sock in (("prefill", prefill_socket), ("decode", decode_socket))]
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < 2:
        for daemon in started:
            daemon.stop()
        next(f for f in futures if f.exception() is not None).result()  # raises its error
    return started[0], started[1]

class Engine:
    """A tests/engine_peer.py process: its memfd pools, attached to a daemon."""

    def __init__(self, socket_path: str, config: str, *, seed: int, layout: str = "kvbeam",
                 memory_kind: str = "host_shm") -> None:
        cmd = [sys.executable, "-m", "tests.engine_peer", "--socket", socket_path,
               "--config", config, "--seed", str(seed), "--layout", layout,
               "--memory-kind", memory_kind]
        root = str(Path(__file__).resolve().parent.parent)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1, cwd=root)
        #: ``attached INSTANCE`` or ``refused FIELD: MESSAGE``
        self.first = self._line(120.0)

    @property
    def attached(self) -> bool:
        """True when the first answer was an attach."""
        return self.first.startswith("attached ")

    def _line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        box: list[str] = []
        out = self.proc.stdout
        t = threading.Thread(target=lambda: box.append(out.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not box or not box[0]:
            done = self.proc.poll() is not None and self.proc.stderr is not None
            err = self.proc.stderr.read() if done and self.proc.stderr else ""
            raise RuntimeError(f"engine gave no answer (exit {self.proc.poll()}): {err}")
        return box[0].strip()

    def cmd(self, text: str, timeout: float = 60.0) -> str:
        """Send one command, return its answer line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def digests(self, slot: int, seq_len: int) -> list[int]:
        """CRC32C of each buffer's items of request (slot, seq_len) in the engine's memory."""
        answer = self.cmd(f"digests {slot} {seq_len}")
        assert answer.startswith("digests "), answer
        return [int(x) for x in answer.split()[1].split(",")]

    def kill(self) -> None:
        """SIGKILL (an engine crash)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        """Exit (closing the attachment)."""
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, OSError):
                self.cmd("exit", 5.0)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def proc_counts(pid: int) -> dict[str, int]:
    """What a process holds: open fds, kvbeam memfd mappings, RSS (KiB)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
               .splitlines() if line.startswith("VmRSS:"))
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")),
            "memfd_maps": sum(1 for line in maps if "memfd:kvbeam" in line),
            "rss_kib": rss}


def fd_targets(pid: int) -> list[str]:
    """What each open fd of a process points at (sorted), to name the ones that differ."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return sorted(out)
